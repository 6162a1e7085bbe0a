"""The prefill graph of a MatMulNBits graph: the same weights on ONNX Runtime's integer GEMM.

``MatMulNBits`` at accuracy level 4 (the int4 and int8 schemes, export/quantize.py) unpacks its weights
on every call and runs VNNI dot products: compute-bound, it does not get faster per token as calls grow.
A prefill chunk of 128 tokens through SmolLM2-135M int4 runs at ~55 GMAC/s on 2 cores of an AVX-512 Xeon;
the integer kernel (``MatMulIntegerToFloat``, MLAS's packed u8s8 GEMM with AMX / VNNI: see
export/quantize_integer.py) runs the same shapes at ~490 GMAC/s (one MatMul [128, 576] x [576, 1536]:
2.0 ms against 0.23 ms; the whole chunk: 351 ms against 110 ms). A prompt's prefill was 28% of a
1-client request's time on the int4 engine (docs/bench/serving-vs-llama.md).

So the export writes, beside the padded decode graph (export/decode_pad.py), ``<role>_prefill.onnx``:
that graph with every MatMulNBits node replaced by the integer kernel on ITS OWN weights, dequantized
(the int4 grid times its block scales, exactly) and requantized per output column to int8 (127 steps
per column where int4 has 15 per block of 32: the requantization moves a weight by at most half a step
of its column's largest value / 127). Activations are quantized per row (int8) instead of per block of
32 along K. The lm_head (already on the integer kernel in int4), the embedding, norms and rotary caches
are the decode graph's own tensors, read from the same weights file; only the new int8 weights go to
``<role>_prefill.onnx.data``.

What that means for the model: the prompt's K/V (and the first token's logits) come from this graph,
every generated token's from the decode graph. Both decoding and every speculative method prefill the
same way, so speculation stays exact with respect to that model, and greedy speculative output equals
greedy plain output; the runtime's prefix cache reuses only prompt entries (``Runner.prefill_graph``),
so a warm prompt equals a cold one. The graph is checked at export (``check_prefill``): its logits over
a prompt against the decode graph's, KL at most ``MAX_KL``.

Example::

    write_prefill_graph(Path("engine/target_decode.onnx"))   # -> "target_prefill.onnx"
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import ExportError
from .tensor_store import TensorStore, compact, drop_unread

MAX_KL = 0.2  # check_prefill: a prefill graph further from its decode graph than this is a wrong rewrite (the
# int4 model is 0.19-0.24 from fp32 on real text; requantizing it to the integer kernel: 0.03-0.04)


def dequantize_nbits(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                     bits: int, block_size: int) -> np.ndarray:
    """The float32 weight [K, N] a MatMulNBits node multiplies by: w[k, n] = (q - zero) * scale of its block.

    ``packed``: uint8 [N, blocks, block_size * bits / 8] (4 bits: the low nibble holds the even element);
    ``scales``: float32 [N * blocks]; ``zero_points``: None (2 ** (bits - 1)), uint8 packed like ``packed``
    along the blocks, or float32 [N * blocks]. A 4-bit example, one column, one block of 2::

        >>> dequantize_nbits(np.array([[[0x9F]]], np.uint8), np.array([0.5], np.float32), None, 2, 1, 4, 2)
        array([[3.5],
               [0.5]], dtype=float32)
    """
    blocks = -(-k // block_size)
    raw = packed.reshape(n, blocks, -1)
    if bits == 4:
        q = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, blocks, -1)  # low nibble first
    elif bits == 8:
        q = raw
    else:
        raise ExportError(f"MatMulNBits with {bits} bits: the prefill graph handles 4 and 8")
    q = q[:, :, :block_size].astype(np.float32)
    if zero_points is None:
        zero = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    elif zero_points.dtype == np.uint8:
        z = zero_points.reshape(n, -1)
        z = np.stack([z & 0x0F, z >> 4], axis=-1).reshape(n, -1) if bits == 4 else z
        zero = z[:, :blocks].astype(np.float32)
    else:
        zero = zero_points.reshape(n, blocks).astype(np.float32)
    w = (q - zero[:, :, None]) * scales.reshape(n, blocks)[:, :, None].astype(np.float32)  # [N, blocks, block]
    return np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)


def integer_prefill(proto, store) -> int:
    """Rewrite ``proto`` (loaded without its external data) in place: every MatMulNBits becomes a MatMul by its
    dequantized weight, then the integer kernel; returns how many. ``store`` (export/tensor_store.py) reads
    the graph's weights and takes the new ones, one tensor at a time."""
    from onnx import helper

    from .quantize_integer import integer_matmuls

    g = proto.graph
    inits = {i.name: i for i in g.initializer}
    read = lambda name: store.array(inits[name])  # noqa: E731
    nodes, dense, unused = [], set(), set()
    for node in g.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        ins = list(node.input) + [""] * 6
        if ins[4] or ins[5]:
            raise ExportError(f"{node.name}: MatMulNBits with g_idx or bias: the prefill graph does not rewrite it")
        w = dequantize_nbits(read(ins[1]), read(ins[2]), read(ins[3]) if ins[3] else None,
                             a["K"], a["N"], a["bits"], a["block_size"])
        name = f"{ins[1]}/dequantized"
        g.initializer.append(store.tensor(name, w))
        nodes.append(helper.make_node("MatMul", [ins[0], name], list(node.output), name=node.name))
        dense.add(name)
        unused.update(x for x in ins[1:4] if x)
    del g.node[:]
    g.node.extend(nodes)
    drop_unread(proto, unused)
    return integer_matmuls(proto, lambda node: node.input[1] in dense, store) if dense else 0


def last_position_logits(proto) -> None:
    """Rewrite ``proto`` (after ``integer_prefill``) in place so that its lm_head reads the last position only:
    ``logits`` [B, 1, V] (a prompt's first token needs no other; the chunk's lm_head work and its [Q, V] copy
    go). The lm_head is the integer kernel's ``Mul(mm, <x>/iq.scale) -> logits``; its input ``x`` becomes
    ``Slice(x, -1:, axis 1)``, with a zero point of its own shape."""
    from onnx import helper, numpy_helper

    g = proto.graph
    head = next((n for n in g.node if "logits" in n.output), None)
    if head is None or head.op_type != "Mul" or not head.input[1].endswith("/iq.scale"):
        raise ExportError("the prefill graph's lm_head is not on the integer kernel: cannot cut it to the last position")
    x = head.input[1].removesuffix("/iq.scale")
    last, zero = f"{x}/last", f"{x}/last.zero_point"
    g.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), f"prefill/{k}")
                         for k, v in (("start", -1), ("end", 2 ** 62), ("axis", 1)))
    nodes = []
    for node in g.node:
        if node.output[0] == f"{x}/iq.abs":  # the first reader of x in the lm_head's quantization
            nodes.append(helper.make_node("Slice", [x, "prefill/start", "prefill/end", "prefill/axis"], [last], name=last))
            node.input[0] = last
        elif node.output[0] == f"{x}/iq.u8":
            shape = f"{x}/last.scale_shape"
            nodes.append(helper.make_node("Shape", [f"{x}/iq.scale"], [shape], name=shape))
            nodes.append(helper.make_node("ConstantOfShape", [shape], [zero], name=zero,
                                          value=numpy_helper.from_array(np.array([128], np.uint8))))
            node.input[0], node.input[2] = last, zero
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)


def prefill_name(decode_file: str) -> str:
    """``target_decode.onnx`` -> ``target_prefill.onnx``."""
    return Path(decode_file).stem.removesuffix("_decode") + "_prefill.onnx"


def write_prefill_graph(decode_path: Path) -> str | None:
    """Write the prefill graph of the padded decode graph at ``decode_path`` beside it; returns its file name,
    or None where the graph has no MatMulNBits (fp32, w8a8: its prefill is already what this would make)."""
    import onnx

    proto = onnx.load(str(decode_path), load_external_data=False)  # initializers stay references into <name>.data
    if not any(n.op_type == "MatMulNBits" for n in proto.graph.node):
        return None
    out = decode_path.with_name(prefill_name(decode_path.name))
    data = out.with_name(out.name + ".data")
    data.unlink(missing_ok=True)
    store = TensorStore(decode_path.parent, data)  # the new tensors only: the others point into the decode graph's file
    integer_prefill(proto, store)
    last_position_logits(proto)
    compact(proto, store)  # drops the dequantized fp32 weights the integer rewrite replaced
    onnx.save(proto, str(out))
    return out.name


def check_prefill(decode_path: Path, prefill_path: Path, ids: list) -> dict:
    """Prompt ``ids`` (real text: export/parity.py's calibration text) in one call of the decode graph, and its
    prefixes of 8, 16, ... tokens through the prefill graph: {"kl_mean", "top1", "rel"} of the prefill
    graph's last logits against the decode graph's at the same positions
    (``parity.logit_metrics``). ExportError beyond ``MAX_KL``: a wrong rewrite, not requantization noise (SmolLM2-135M int4: KL 0.03, top-1 100%; random token ids would give 0.3, as
    their activations are nothing like text's)."""
    from ..engines.ort import OrtEngine
    from .fused_call import FusedCall
    from .parity import logit_metrics

    ends = np.unique(np.r_[np.arange(8, len(ids), 8), len(ids)])  # prompts ids[:n]: the prefill graph gives their last logits
    ref = FusedCall(OrtEngine(decode_path), len(ids) + 1).run(ids, 0)["logits"][0][ends - 1]  # + 1: padding entry
    prefill = FusedCall(OrtEngine(prefill_path), len(ids) + 1)
    got = np.stack([prefill.run(ids[:n], 0, logit_rows=1)["logits"][0, -1].copy() for n in ends])
    m = logit_metrics(got, ref)
    if not m["kl_mean"] <= MAX_KL:
        raise ExportError(f"{prefill_path.name}: its logits differ from {decode_path.name}'s: kl_mean "
                          f"{m['kl_mean']:.3g} > {MAX_KL} (the integer rewrite is wrong for this graph; "
                          "export with --no-prefill-graph)")
    return {"kl_mean": m["kl_mean"], "top1": m["top1"], "rel": m["rel"]}
