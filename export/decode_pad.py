"""One padding row in every attention call of a fused graph: decode steps computed as verify passes are.

ONNX Runtime's CPU GroupQueryAttention (GQA) takes one path for a call of one new token and another for
Q > 1; their results differ in the last bits (SmolLM2-135M fp32: 6e-8 at layer 0's attention, 5e-5 in
the logits). In an int8/int4 graph the next MatMul rounds its activations to int8, which turns some of
those last bits into whole quantization steps: a decode step and a verify pass of the same tokens then
differ by up to 0.8 in the logits (docs/real-models.md). Rows 0..Q-1 of any call with Q >= 2 agree bit
for bit (the MatMuls are row-independent: docs/bench/verify-curve.md, ``gap_q2``), so this rewrite
gives every GQA node one extra query row after the real ones: the Q real rows (Q = 1 included) always
take the Q >= 2 path, and a decode step equals the verify pass's row (measured |Δlogit| = 0 on
SmolLM2-135M fp32, int8, int4, w8a8). The MatMuls still see Q rows: the cost is one attention row.

    qkv' = Pad(qkv, one row of zeros)         position_ids' = Pad(position_ids, edge)
    mask' = Pad(mask, one row, one column)    seqlens_k' = seqlens_k + 1, total' = total + 1
    cos' = Pad(cos_cache, edge row), sin' too (GQA wants total' rows; the padding row's position is the last's)
    out = Slice(GQA(qkv', ...), rows [0, Q))

The padding row is causal-last (no real row attends to it) and writes its K/V one entry past the call's
new ones, which therefore must exist: the runtime needs one spare cache entry per slot (``max_len + 1``
entries). Not for batched calls: GQA refuses Q > 1 after a past at batch > 1, so a batch of decode steps
needs the unpadded graph (whose steps differ from verify passes as before).

The export writes the padded graph of the target's fused graph beside it (``write_decode_graph``:
``target_decode.onnx``, reading the same weights file as the fused graph and its batched twin; manifest
field ``decode_file``), after quantization, and checks it (``check_decode``); the runtime runs every
single-row call through it (runtime/in_place.py).

Example::

    proto = onnx.load("target.onnx")
    pad_attention(proto)   # in place; returns the number of GQA nodes padded

    write_decode_graph(Path("engine/target.onnx"))   # -> "target_decode.onnx" (after batched_graph.write_twin)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import ExportError

PROMPT = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7)  # check_decode's prompt and tokens (ids modulo the vocabulary)
TOKENS = (2, 7, 1, 8, 2)


def pad_attention(proto) -> int:
    """Rewrite every GroupQueryAttention node of ``proto`` as above; returns how many."""
    from onnx import helper, numpy_helper

    g = proto.graph
    consts = {"pad/q_row": np.array([0, 0, 0, 0, 1, 0], np.int64), "pad/pos_col": np.array([0, 0, 0, 1], np.int64),
              "pad/mask": np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64), "pad/one": np.array(1, np.int32),
              "pad/start": np.array([0], np.int64), "pad/end": np.array([-1], np.int64),
              "pad/axis": np.array([1], np.int64),
              "pad/cache_row": np.array([0, 0, 1, 0], np.int64)}
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    nodes, made, count = [], {}, 0

    def once(out: str, op: str, inputs: list, **attrs) -> str:
        """A node computing ``out``, made once and shared by every attention reading it."""
        if out not in made:
            nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
            made[out] = out
        return out

    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        ins = list(node.input) + [""] * (11 - len(node.input))
        if ins[1] or not ins[9]:
            raise ValueError(f"{node.name}: padding needs packed qkv and position_ids (a fused graph's GQA)")
        ins[0] = once(f"{ins[0]}/pad", "Pad", [ins[0], "pad/q_row"])
        ins[5] = once(f"{ins[5]}/pad", "Add", [ins[5], "pad/one"])
        ins[6] = once(f"{ins[6]}/pad", "Add", [ins[6], "pad/one"])
        ins[9] = once(f"{ins[9]}/pad", "Pad", [ins[9], "pad/pos_col"], mode="edge")
        for i in (7, 8):  # cos/sin caches [max_len, D/2]: a full cache's call has total' = max_len + 1
            if ins[i]:
                ins[i] = once(f"{ins[i]}/pad", "Pad", [ins[i], "pad/cache_row"], mode="edge")
        if ins[10]:
            ins[10] = once(f"{ins[10]}/pad", "Pad", [ins[10], "pad/mask"])
        padded = node.output[0] + "/pad"
        gqa = helper.make_node("GroupQueryAttention", ins, [padded, *node.output[1:]], name=node.name, domain=node.domain)
        gqa.attribute.extend(node.attribute)
        nodes.append(gqa)
        nodes.append(helper.make_node("Slice", [padded, "pad/start", "pad/end", "pad/axis"], [node.output[0]],
                                      name=node.output[0] + "/unpad"))
        count += 1
    del g.node[:]
    g.node.extend(nodes)
    return count


def decode_name(graph_file: str) -> str:
    """``target.onnx`` -> ``target_decode.onnx``."""
    return Path(graph_file).stem + "_decode.onnx"


def write_decode_graph(path: Path) -> str:
    """Write the padded copy of the fused graph at ``path`` beside it (``decode_name``), its weights read from
    the fused graph's external data file (``batched_graph.write_twin`` put them there: call it first). Returns
    the padded graph's file name."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)  # initializers stay references into <name>.data
    if not pad_attention(proto):
        raise ExportError(f"{path.name}: not a fused graph (no GroupQueryAttention node to pad)")
    out = path.with_name(decode_name(path.name))
    onnx.save(proto, str(out))
    return out.name


def check_decode(fused_path: Path, decode_path: Path, quantized: bool) -> dict:
    """After a short prompt, 5 decode steps as the runtime runs them here and the verify pass of the same 5 tokens
    through the padded graph, and that verify pass through the fused graph. A step runs through the padded graph, or
    where ONNX Runtime's MatMulNBits computes one row apart from several (``engines.ort.one_row_differs``: its AVX2
    and ARM code) as a call of two rows through the fused graph (the token and a dummy copy: runtime/in_place.py,
    "Decode rows"). Returns {"steps_vs_verify" (max |Δlogit| between those steps and the padded graph's verify
    pass: 0 where every kernel computes a row alike whatever the call's other rows), "decode_rows" (1 or 2, on
    this machine), "rel", "kl_mean" (the padded graph's verify pass against the fused graph's:
    ``parity.logit_metrics``)}. ExportError beyond the batched twin's ``BOUNDS`` (``rel`` for fp32 graphs,
    ``kl_mean`` for quantized ones): a wrong rewrite, not last-bit noise."""
    from ..engines.ort import OrtEngine, one_row_differs
    from .batched_graph import check_bounds
    from .fused_call import FusedCall
    from .parity import logit_metrics

    room = len(PROMPT) + len(TOKENS) + 1  # + 1: the padding row's (or the dummy row's) entry
    padded = FusedCall(OrtEngine(decode_path), room)
    vocab = padded.widths["logits"]
    prompt, tokens = [t % vocab for t in PROMPT], [t % vocab for t in TOKENS]
    p = len(prompt)
    fused = FusedCall(OrtEngine(fused_path), room)
    padded.run(prompt, 0)
    fused.run(prompt, 0)
    rows = 2 if one_row_differs(padded.engine) else 1
    stepper = padded if rows == 1 else fused  # its steps write entries p.. only: the verify pass rewrites them
    steps = np.stack([stepper.run([t] * rows, p + i)["logits"][0, 0].copy() for i, t in enumerate(tokens)])
    verify = padded.run(tokens, p)["logits"][0].copy()  # [5, V]
    ref = fused.run(tokens, p)["logits"][0]
    logit = logit_metrics(verify, ref)
    report = {"steps_vs_verify": float(np.abs(steps - verify).max()), "decode_rows": rows, "rel": logit["rel"],
              "kl_mean": logit["kl_mean"]}
    check_bounds(report, quantized, f"{decode_path.name}: its verify pass differs from {fused_path.name}'s",
                 "the padding rewrite is wrong for this graph")
    return report
