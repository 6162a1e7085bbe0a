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
                   calibration_ids=None) -> dict:
    """Quantize the graph at ``path`` in place; returns {"scheme", "bits", "block_size", "matmuls", "options",
    "smoothed"}. ``calibration_ids``: token ids the smoothing statistics are taken on (none: no smoothing)."""
    import onnx

    opts = (parse_options(scheme) if isinstance(scheme, str) else scheme.check())
    stats = {}
    proto = quantize_proto(onnx.load(str(path)), opts, calibration_ids, stats)
    count = sum(n.op_type in ("MatMulNBits", "MatMulIntegerToFloat") for n in proto.graph.node)
    if count == 0:
        raise QuantizeError(f"{path.name}: no MatMul with a constant weight to quantize")
    if external_data:
        data = path.with_name(path.name + ".data")
        data.unlink(missing_ok=True)  # onnx refuses to write over it
        onnx.save(proto, str(path), save_as_external_data=True, location=data.name)
    else:
        onnx.save(proto, str(path))
    bits = sorted({g.bits for g in (opts.attention, opts.mlp) if g.bits})
    return {"scheme": scheme.split(",")[0] if isinstance(scheme, str) else "custom", "bits": bits[0] if bits else None,
            "block_size": opts.block_size, "matmuls": count, "options": asdict(opts), **stats}


def quantize_proto(proto, opts: QuantOptions, calibration_ids=None, stats: dict | None = None):
    """``proto`` with its MatMuls quantized as ``opts`` says (may be the same object, changed). The integer
    kernel needs a fused graph: elsewhere its groups get 8-bit MatMulNBits. ``stats`` (a dict) receives
    {"smoothed": inputs smoothed, "kernels": group -> kernel used}."""
    fused = any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)
    plan = {g: getattr(opts, g) if fused else replace(getattr(opts, g), kernel="nbits") for g in GROUPS}
    integer = lambda n: bool(plan[matmul_group(n)].bits) and plan[matmul_group(n)].kernel == "integer"  # noqa: E731
    smoothed = 0
    if any(q.bits and q.kernel == "integer" for q in plan.values()):
        from .quantize_integer import integer_matmuls

        if opts.smooth is not None and calibration_ids is not None:
            from .fused_call import graph_max_len
            from .smooth import smooth_inputs

            smoothed = smooth_inputs(proto, integer, calibration_ids, graph_max_len(proto), opts.smooth)
        integer_matmuls(proto, integer)
    if stats is not None:
        stats.update(smoothed=smoothed, kernels={g: q.kernel if q.bits else "fp32" for g, q in plan.items()})
    for bits in (4, 8):
        names = [n.name for n in proto.graph.node if n.op_type == "MatMul"
                 and plan[matmul_group(n)].bits == bits and plan[matmul_group(n)].kernel == "nbits"]
        if names:
            proto = nbits_pass(proto, opts, bits, names)
    for n in proto.graph.node:  # accuracy level per group: an attribute of each MatMulNBits node
        for a in n.attribute if n.op_type == "MatMulNBits" else ():
            if a.name == "accuracy_level":
                a.i = plan[matmul_group(n)].accuracy_level
    return proto


def nbits_pass(proto, opts: QuantOptions, bits: int, names: list):
    """MatMulNBits on the MatMuls named ``names`` (ORT's quantizer; it keeps the node names, adding _Q<bits>)."""
    import logging

    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                      MatMulNBitsQuantizer)
    except ImportError as e:  # onnxruntime's quantizer imports onnx_ir
        raise QuantizeError(f"quantization needs onnxruntime's quantizer and onnx_ir ({e}); "
                            "pip install 'specrt[export]'") from None
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line per node
    config = DefaultWeightOnlyQuantConfig(block_size=opts.block_size, is_symmetric=opts.symmetric,
                                          accuracy_level=ACCURACY_LEVEL, bits=bits)
    others = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name not in set(names)]
    quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=opts.block_size, is_symmetric=opts.symmetric,
                                     accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=others, algo_config=config)
    quantizer.process()
    return quantizer.model.model
