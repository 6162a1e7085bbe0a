"""Weight quantization of an exported graph's MatMuls (ONNX Runtime's MatMulNBits / MatMulInteger kernels).

``int8`` and ``int4`` quantize every MatMul with a constant weight in blocks of ``BLOCK_SIZE``
along the input dimension (symmetric, one fp32 scale per block), computed by ORT's CPU kernels
(``MatMulNBits``) with int8 activations (accuracy level 4). int4 keeps the lm_head in int8: on small
models int4 logits drift most there (docs/decode-step-study, section 5); in a fused graph that lm_head
runs on the integer kernel (``MatMulIntegerToFloat``, export/quantize_integer.py: as fast for one
position, nearly flat in Q), its input smoothed (export/smooth.py). ``w8a8`` puts every MatMul on the
integer kernel: a verify pass of 5 costs ~1.1 decode steps instead of ~1.8. Quantization changes the model:
speculative decoding stays exact with respect to the QUANTIZED target, and the export judges how
far the quantized model moved from the unquantized torch model on real text (KL and top-1 agreement
on the calibration text: export/parity.py's ``BOUNDS["int8"]`` / ``BOUNDS["int4"]``).

``QuantOptions`` spells out every other choice the kernels offer (block size, zero points, accuracy
level per group of MatMuls, which groups stay fp32, ``MatMulInteger`` instead of ``MatMulNBits`` for
int8); ``tools/bench/verify_curve.py`` times them (docs/bench/verify-curve.md). Groups: ``attention``
(q/k/v and o projections), ``mlp`` (everything else in the layers), ``lm_head`` (the MatMul that
produces ``logits``).

Example::

    quantize_graph(Path("engine/target.onnx"), "int4")                       # what `--quantize int4` does
    quantize_proto(proto, parse_options("int4,block=64,attention.acc=1"))   # an experiment
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

BLOCK_SIZE = 32  # weights per scale, along the MatMul's input dimension
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations (the fast CPU path)
GROUPS = ("attention", "mlp", "lm_head")
KERNELS = ("nbits", "integer")  # MatMulNBits (export/quantize.py) | MatMulInteger (export/quantize_integer.py)


class QuantizeError(RuntimeError):
    pass


@dataclass(frozen=True)
class GroupQuant:
    """How one group of MatMuls is quantized."""

    bits: int | None = 4  # 4 | 8 | None: left fp32
    kernel: str = "nbits"  # "nbits" (MatMulNBits) | "integer" (MatMulIntegerToFloat: 8 bits, export/quantize_integer.py)
    accuracy_level: int = ACCURACY_LEVEL  # nbits: ORT's attribute; 0/1 fp32, 2 fp16, 3 bf16, 4 int8 activations

    def check(self, group: str) -> None:
        if (self.bits not in (None, 4, 8) or self.kernel not in KERNELS or not 0 <= self.accuracy_level <= 4
                or (self.kernel == "integer" and self.bits not in (None, 8))):
            raise QuantizeError(f"invalid quantization of {group}: {self} (bits 4|8|fp32, kernel "
                                f"{'|'.join(KERNELS)} (integer: 8 bits only), accuracy level 0..4)")


@dataclass(frozen=True)
class QuantOptions:
    """How to quantize a graph's MatMuls, per group (the defaults: ``--quantize int4``)."""

    attention: GroupQuant = GroupQuant()  # q/k/v (packed) and o projections
    mlp: GroupQuant = GroupQuant()  # the layers' other MatMuls
    lm_head: GroupQuant = GroupQuant(bits=8, kernel="integer")  # on small models int4 logits drift most here
    # (docs/decode-step-study); the integer kernel: as fast at Q = 1, flat in Q (docs/bench/verify-curve.md)
    block_size: int = BLOCK_SIZE  # nbits: 16 | 32 | 64 | 128 | 256 weights per scale along K
    symmetric: bool = True  # nbits: False adds a zero point per block
    smooth: float | None = 0.5  # integer kernel: SmoothQuant strength (export/smooth.py); None: no smoothing

    def check(self) -> "QuantOptions":
        for group in GROUPS:
            getattr(self, group).check(group)
        if self.block_size not in (16, 32, 64, 128, 256):
            raise QuantizeError(f"invalid block size {self.block_size}: 16, 32, 64, 128 or 256")
        if self.smooth is not None and not 0 <= self.smooth <= 1:
            raise QuantizeError(f"invalid smoothing strength {self.smooth}: 0..1")
        return self


W8 = GroupQuant(bits=8, kernel="integer")
SCHEMES = {
    "int8": QuantOptions(GroupQuant(bits=8), GroupQuant(bits=8), GroupQuant(bits=8)),  # the most accurate
    "int4": QuantOptions(),  # the fastest decode step
    "w8a8": QuantOptions(W8, W8, W8),  # MatMulIntegerToFloat everywhere: the cheapest verify pass
}
GROUP_KEYS = {"bits": ("bits", lambda v: None if v == "fp32" else int(v)), "kernel": ("kernel", str),
              "acc": ("accuracy_level", int)}


def parse_options(spec: str) -> QuantOptions:
    """A scheme name, then ``key=value`` changes in order, comma-separated. Keys: ``block``, ``sym`` (0/1),
    ``smooth`` (0..1, or none);
    ``bits`` (4, 8, fp32), ``kernel`` (nbits, integer), ``acc`` (0..4) for every group, or for one group as
    ``<group>.<key>``: ``int4,block=64,attention.acc=1,lm_head.kernel=integer``.

    >>> parse_options("int4,mlp.acc=1").mlp.accuracy_level
    1
    """
    name, *changes = [p.strip() for p in spec.split(",") if p.strip()] or [""]
    if name not in SCHEMES:
        raise QuantizeError(f"unknown quantization {name!r}; choose one of {', '.join(SCHEMES)}")
    opts = SCHEMES[name]
    for change in changes:
        key, _, value = change.partition("=")
        group, _, field = key.rpartition(".")
        try:
            if key in ("block", "sym", "smooth"):
                opts = replace(opts, **({"block_size": int(value)} if key == "block" else
                                        {"symmetric": value not in ("0", "false")} if key == "sym" else
                                        {"smooth": None if value in ("0", "none") else float(value)}))
            elif field in GROUP_KEYS and group in ("", *GROUPS):
                attr, cast = GROUP_KEYS[field]
                opts = replace(opts, **{g: replace(getattr(opts, g), **{attr: cast(value)})
                                        for g in ((group,) if group else GROUPS)})
            else:
                raise QuantizeError(f"unknown quantization option {key!r} in {spec!r}")
        except ValueError:
            raise QuantizeError(f"bad value in {change!r} ({spec!r})") from None
    return opts.check()


def parity_scheme(spec: str) -> str:
    """The export/parity.py bounds a quantized graph is judged by: its scheme's (w8a8: int8's)."""
    base = spec.split(",")[0].strip()
    return "int8" if base == "w8a8" else base


def matmul_group(node) -> str:
    """The group of a MatMul node: fused graphs name them l<i>.qkv / l<i>.o / l<i>.gate ..., traced ones
    /model/layers.<i>/self_attn/... ."""
    if "logits" in node.output:
        return "lm_head"
    name = node.name.rsplit("/", 1)[0] if "/" in node.name else re.sub(r"_Q\d+$", "", node.name)
    return "attention" if "self_attn" in name or name.split(".")[-1] in ("qkv", "q", "k", "v", "o") else "mlp"


def quantize_graph(path: Path, scheme: str | QuantOptions, external_data: bool = False,
                   calibration_ids=None, activation_max: dict | None = None) -> dict:
    """Quantize the graph at ``path`` in place; returns {"scheme", "bits", "block_size", "matmuls", "options",
    "smoothed"}. ``calibration_ids``: token ids the smoothing statistics are taken on (none: no smoothing);
    ``activation_max``: those statistics by input name, measured elsewhere (export/smooth.py). With ``external_data`` the
    weights are read from and written to ``<name>.data`` one tensor at a time (export/tensor_store.py)."""
    import onnx

    from .tensor_store import TensorStore, compact

    opts = (parse_options(scheme) if isinstance(scheme, str) else scheme.check())
    stats = {}
    data = path.with_name(path.name + ".data")
    store = TensorStore(path.parent, data if external_data else None)
    proto = onnx.load(str(path), load_external_data=False)
    proto = quantize_proto(proto, opts, calibration_ids, stats, store, activation_max)
    count = sum(n.op_type in ("MatMulNBits", "MatMulIntegerToFloat") for n in proto.graph.node)
    if count == 0:
        raise QuantizeError(f"{path.name}: no MatMul with a constant weight to quantize")
    if external_data:
        compact(proto, store)
    onnx.save(proto, str(path))
    bits = sorted({g.bits for g in (opts.attention, opts.mlp) if g.bits})
    return {"scheme": scheme.split(",")[0] if isinstance(scheme, str) else "custom", "bits": bits[0] if bits else None,
            "block_size": opts.block_size, "matmuls": count, "options": asdict(opts), **stats}


def quantize_proto(proto, opts: QuantOptions, calibration_ids=None, stats: dict | None = None,
                   store=None, activation_max: dict | None = None):
    """``proto`` with its MatMuls quantized as ``opts`` says (changed in place). The integer kernel needs a
    fused graph: elsewhere its groups get 8-bit MatMulNBits. ``stats`` (a dict) receives {"smoothed": inputs
    smoothed, "kernels": group -> kernel used}; ``store`` reads and writes the weights (default: in the proto)."""
    from .tensor_store import TensorStore

    store = store or TensorStore()
    fused = any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)
    plan = {g: getattr(opts, g) if fused else replace(getattr(opts, g), kernel="nbits") for g in GROUPS}
    integer = lambda n: bool(plan[matmul_group(n)].bits) and plan[matmul_group(n)].kernel == "integer"  # noqa: E731
    smoothed = 0
    if any(q.bits and q.kernel == "integer" for q in plan.values()):
        from .quantize_integer import integer_matmuls

        if opts.smooth is not None and (calibration_ids is not None or activation_max is not None):
            from .fused_call import graph_max_len
            from .smooth import smooth_inputs

            smoothed = smooth_inputs(proto, integer, calibration_ids, graph_max_len(proto), opts.smooth, store,
                                     activation_max)
        integer_matmuls(proto, integer, store)
    if stats is not None:
        stats.update(smoothed=smoothed, kernels={g: q.kernel if q.bits else "fp32" for g, q in plan.items()})
    nbits = lambda n: bool(plan[matmul_group(n)].bits) and plan[matmul_group(n)].kernel == "nbits"  # noqa: E731
    nbits_matmuls(proto, opts, lambda n: plan[matmul_group(n)], nbits, store)
    return proto


def nbits_matmuls(proto, opts: QuantOptions, group_of, include, store) -> int:
    """Replace, in ``proto``, each MatMul by a constant fp32 weight W [K, N] with ``include(node)`` by
    ``MatMulNBits`` (com.microsoft) of its group's bits and accuracy level, one weight at a time: the node
    and tensors ONNX Runtime's MatMulNBitsQuantizer makes (``<W>_Q<bits>`` packed [N, blocks, bytes],
    ``<W>_scales`` [N, blocks], ``<W>_zero_points`` when asymmetric; node ``<name>_Q<bits>``), quantized by
    the same C++ routines. Returns how many."""
    from onnx import TensorProto, helper

    from .tensor_store import drop_unread

    try:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits
    except ImportError as e:
        raise QuantizeError(f"quantization needs onnxruntime's quantization routines ({e})") from None
    g = proto.graph
    inits = {i.name: i for i in g.initializer}
    nodes, used, count = [], set(), 0
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or w.data_type != TensorProto.FLOAT or len(w.dims) != 2 or not include(node):
            nodes.append(node)
            continue
        bits, block = group_of(node).bits, opts.block_size
        k, n = (int(d) for d in w.dims)
        blocks = -(-k // block)
        weight = store.array(w).astype(np.float32)
        if blocks * block > k:
            weight = np.pad(weight, ((0, blocks * block - k), (0, 0)))
        packed = np.zeros((n, blocks, block * bits // 8), np.uint8)
        zero = np.zeros((n, -(-blocks // (8 // bits))), np.uint8)
        scales = np.zeros((n, blocks), np.float32)
        (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(
            packed, np.ascontiguousarray(weight), scales, zero, block, n, k, opts.symmetric)
        del weight
        ins = [node.input[0], f"{w.name}_Q{bits}", f"{w.name}_scales"]
        g.initializer.extend([store.tensor(ins[1], packed), store.tensor(ins[2], scales)])
        if not opts.symmetric:
            ins.append(f"{w.name}_zero_points")
            g.initializer.append(store.tensor(ins[3], zero))
        nodes.append(helper.make_node("MatMulNBits", ins, list(node.output), name=f"{node.name}_Q{bits}" if node.name
                                      else "", domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                                      accuracy_level=group_of(node).accuracy_level))
        used.add(w.name)
        count += 1
    del g.node[:]
    g.node.extend(nodes)
    drop_unread(proto, used)
    if count and not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return count
