"""The batched twin of a fused graph: the same model, inputs, outputs and in-place cache, for calls of
several rows with several new tokens each (a batch's verify pass), in ONE graph call.

ONNX Runtime's CPU ``GroupQueryAttention`` (GQA) takes Q > 1 new tokens after a past only at batch 1
(ORT 1.32: "batch_size must be 1 when sequence_length > 1 and past context is given"; with
Q == total_sequence_length it reads the call as a first prompt and ignores the past). So the twin replaces
every GQA node of the fused graph (export/fused_graph.py) by standard ops over the same cache planes:

    q, k, v = Split(qkv);  q, k = RotaryEmbedding(q | k, position_ids, the graph's cos/sin caches)
    present_* = TensorScatter(past_*, k | v [B, Hkv, Q, D], write_indices L_b)   the Q new entries of row b at
                [L_b, L_b + Q), in place (past and present are one bound buffer, as for GQA)
    K, V = Slice(present_*, entries [0, T))                                      [B, Hkv, T, D], T = max L_b + Q
    scores = FusedMatMul(q [B, Hkv, G·Q, D], K, transB, alpha = scale)  -> [B, Hkv, G, Q, T]
    masked scores := MASK_MIN (Where, not Add: a stale entry's score cannot leak, whatever its value)
    Softmax -> MatMul(V) -> [B, Q, H·D], the GQA node's output

Everything else (weights, quantized MatMuls, norms, the window masks) is the fused graph's own; the runtime
binds the twin exactly as the fused graph (contract.py, ``in_place``) and calls it for R > 1 rows with
Q > 1 (runtime/in_place.py). Unlike GQA, a row's attention reads the entries [L_b + Q, T) of a shorter row
(masked, weight exactly 0): they must be finite, as every cache entry is (zeros or K/V a graph wrote).

``write_twin`` puts the fused graph's weights in one external data file (``<graph>.onnx.data``) that both
graphs read, so a second session costs no second copy on disk (ORT memory-maps external weights).
``check_twin`` runs it against the fused graph row by row before the engine dir is written.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..contract import MASK_MIN, in_place_mask
from .errors import ExportError

TWIN_OPSET = 24  # TensorScatter (ONNX opset 24; ONNX Runtime >= 1.23)
# fp32 graphs: the twin sums attention in another order (|Δ| / spread 2.4e-5 on SmolLM2-135M); quantized
# graphs round their int8 activations differently after any such change (KL mean 4e-3 to 8e-3 on SmolLM2
# int8/int4, the size of the fused graph's own chain-vs-steps difference): gross-error bounds
BOUNDS = {"rel": 1e-3, "kl_mean": 0.05}  # rel: fp32 graphs; kl_mean: quantized graphs (also the padded decode
# graph's, export/decode_pad.py: a graph written beside the fused one is held to the same gross-error bounds)


def twin_name(graph_file: str) -> str:
    """``target.onnx`` -> ``target_batched.onnx``."""
    return Path(graph_file).stem + "_batched.onnx"


def batched_twin(proto):
    """A copy of the fused graph ``proto`` (an ``onnx.ModelProto``) with every GroupQueryAttention node
    replaced by the ops of the module docstring; the graph's inputs, outputs and weights are unchanged.

    Example: ``batched_twin(onnx.load("target.onnx", load_external_data=False))`` of SmolLM2-135M's fused
    graph: its 30 GQA nodes become 30 x 23 nodes (and a few per call), its initializers stay references
    into target.onnx.data."""
    import onnx
    from onnx import helper

    twin = onnx.ModelProto()
    twin.CopyFrom(proto)
    g = twin.graph
    kv_shape = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    b = _Builder()
    first = None  # where the first attention starts: the per-call values go just before it
    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            b.nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("local_window_size", -1) not in (-1, 0) or attrs.get("softcap", 0.0):
            raise ExportError(f"{node.name}: the batched twin has no local_window_size / softcap")
        first = len(b.nodes) if first is None else first
        _attention(b, node, attrs, kv_shape[node.input[3]][3])
    if first is None:
        raise ExportError("not a fused graph: no GroupQueryAttention node")
    del g.node[:]
    g.node.extend(b.nodes[:first] + b.prelude + b.nodes[first:])
    for opset in twin.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, TWIN_OPSET)
    twin.ir_version = max(twin.ir_version, helper.find_min_ir_version_for([helper.make_opsetid("", TWIN_OPSET)]))
    return twin


class _Builder:
    """Nodes under construction: ``prelude`` (once per graph, first) and ``nodes`` (the graph's, in order)."""

    def __init__(self):
        self.prelude, self.nodes, self.masks, self.calls, self.consts = [], [], {}, {}, set()

    def node(self, op: str, inputs: list, out: str, ms: bool = False, first: bool = False, **attrs) -> str:
        from onnx import helper

        (self.prelude if first else self.nodes).append(
            helper.make_node(op, inputs, [out], name=out, domain="com.microsoft" if ms else "", **attrs))
        return out

    def const(self, name: str, value) -> str:
        """A Constant node ``name`` of ``value`` in the prelude (made once per name)."""
        from onnx import numpy_helper

        if name in self.consts:
            return name
        self.consts.add(name)
        return self.node("Constant", [], name, first=True, value=numpy_helper.from_array(np.asarray(value), name))


def _call_values(b: _Builder, qkv: str, seqlens_k: str, total: str) -> dict:
    """Per-call values of the attentions fed ``seqlens_k`` and ``total`` (made once per pair, from the node's own
    inputs, so a rewrite around the GQA nodes carries over): the rows' write indices L_b = seqlens_k + 1 - Q
    [B] (int64), T as Slice ends [1], and the axes constants."""
    key = (seqlens_k, total)
    if key not in b.calls:
        p = f"tw.{len(b.calls)}"
        one, two = b.const("tw.one", np.array([1], np.int64)), b.const("tw.two", np.array([2], np.int64))
        q = b.node("Slice", [b.node("Shape", [qkv], f"{p}.qkv_shape", first=True), one, two], f"{p}.q", first=True)
        seqlens = b.node("Cast", [seqlens_k], f"{p}.seqlens", first=True, to=7)
        write = b.node("Sub", [b.node("Add", [seqlens, one], f"{p}.total_b", first=True), q], f"{p}.write", first=True)
        ends = b.node("Reshape", [b.node("Cast", [total], f"{p}.total0", first=True, to=7), one], f"{p}.total",
                      first=True)
        b.calls[key] = {"write": write, "total": ends, "zero": b.const("tw.zero", np.array([0], np.int64)),
                        "axis1": one, "axis2": two}
    return b.calls[key]


def _mask_values(b: _Builder, mask: str, hkv: int, groups: int, shared: dict) -> dict:
    """Per distinct mask [B, 1, Q, T] (made once): ``hides`` bool [B, 1, 1, Q, T], where it hides a key, and the
    shapes ``five`` [B, Hkv, G, Q, T] and ``four`` [B, Hkv, G·Q, T] of the attention scores."""
    if mask not in b.masks:
        hides = b.node("Less", [mask, b.const("tw.half_min", np.array(MASK_MIN / 2, np.float32))], mask + ".tw_hides",
                       first=True)
        shape = b.node("Shape", [mask], mask + ".tw_shape", first=True)
        batch = b.node("Slice", [shape, shared["zero"], shared["axis1"]], mask + ".tw_b", first=True)
        q_t = b.node("Slice", [shape, shared["axis2"], b.const("tw.four", np.array([4], np.int64))], mask + ".tw_qt",
                     first=True)
        t = b.node("Slice", [shape, b.const("tw.three", np.array([3], np.int64)), "tw.four"], mask + ".tw_t",
                   first=True)
        heads = b.const("tw.hkv_g", np.array([hkv, groups], np.int64))
        b.masks[mask] = {
            "hides": b.node("Unsqueeze", [hides, shared["axis1"]], mask + ".tw_hides5", first=True),
            "five": b.node("Concat", [batch, heads, q_t], mask + ".tw_shape5", first=True, axis=0),
            "four": b.node("Concat", [batch, b.const("tw.hkv_rest", np.array([hkv, -1], np.int64)), t],
                           mask + ".tw_shape4", first=True, axis=0)}
    return b.masks[mask]


def _attention(b: _Builder, node, attrs: dict, head_dim: int) -> None:
    """The ops replacing one GQA node (its inputs: packed qkv, -, -, past_key, past_value, seqlens_k,
    total_sequence_length, cos_cache, sin_cache, position_ids, attention bias)."""
    qkv, _, _, past_k, past_v, seqlens_k, total, cos, sin, positions, mask = node.input
    shared = _call_values(b, qkv, seqlens_k, total)
    out, present_k, present_v = node.output
    h, hkv, d = attrs["num_heads"], attrs["kv_num_heads"], head_dim
    p = node.name + ".tw"
    c = lambda name, v: b.const(f"{p}.{name}", np.array(v, np.int64))  # noqa: E731
    q, k, v = (f"{p}.{x}" for x in "qkv")
    b.nodes.append(_split(qkv, [q, k, v], c("split", [h * d, hkv * d, hkv * d]), p))
    q = b.node("RotaryEmbedding", [q, positions, cos, sin], f"{p}.q_rot", ms=True, num_heads=h, interleaved=0)
    k = b.node("RotaryEmbedding", [k, positions, cos, sin], f"{p}.k_rot", ms=True, num_heads=hkv, interleaved=0)
    heads_kv = c("bqhd_kv", [0, 0, hkv, d])
    planes = {}
    for name, x, past, present in (("k", k, past_k, present_k), ("v", v, past_v, present_v)):
        new = b.node("Transpose", [b.node("Reshape", [x, heads_kv], f"{p}.{name}4")], f"{p}.{name}_new",
                     perm=[0, 2, 1, 3])  # [B, Hkv, Q, D]
        b.node("TensorScatter", [past, new, shared["write"]], present)  # in place: present is past's buffer
        planes[name] = b.node("Slice", [present, shared["zero"], shared["total"], shared["axis2"]], f"{p}.{name}_T")
    q4 = b.node("Transpose", [b.node("Reshape", [q, c("bqhd", [0, 0, h, d])], f"{p}.q4")], f"{p}.q_bhqd",
                perm=[0, 2, 1, 3])  # [B, H, Q, D]: query head j reads K/V head j // G
    grouped = b.node("Reshape", [q4, c("grouped", [0, hkv, -1, d])], f"{p}.q_grouped")  # [B, Hkv, G·Q, D]
    scores = b.node("FusedMatMul", [grouped, planes["k"]], f"{p}.scores", ms=True, transB=1,
                    alpha=float(attrs.get("scale") or d ** -0.5))  # [B, Hkv, G·Q, T]
    m = _mask_values(b, mask, hkv, h // hkv, shared)
    scores = b.node("Reshape", [scores, m["five"]], f"{p}.scores5")  # [B, Hkv, G, Q, T]
    masked = b.node("Where", [m["hides"], b.const("tw.min", np.array(MASK_MIN, np.float32)), scores], f"{p}.masked")
    probs = b.node("Reshape", [b.node("Softmax", [masked], f"{p}.probs5", axis=-1), m["four"]], f"{p}.probs")
    ctx = b.node("MatMul", [probs, planes["v"]], f"{p}.ctx")  # [B, Hkv, G·Q, D]
    ctx = b.node("Transpose", [b.node("Reshape", [ctx, c("bhqd", [0, h, -1, d])], f"{p}.ctx4")], f"{p}.ctx_bqhd",
                 perm=[0, 2, 1, 3])  # [B, Q, H, D]
    b.node("Reshape", [ctx, c("bqx", [0, 0, h * d])], out)


def _split(x: str, outs: list, sizes: str, name: str):
    from onnx import helper

    return helper.make_node("Split", [x, sizes], outs, name=name + ".split", axis=2)


# ---- writing and checking the twin -------------------------------------------------------------------
def write_twin(path: Path) -> str:
    """Write the batched twin of the fused graph at ``path`` beside it (``twin_name``) and move the fused
    graph's weights into one external data file, ``<name>.data``, that both graphs read. Returns the twin's
    file name."""
    import onnx

    from .tensor_store import TensorStore, externalize

    proto = onnx.load(str(path), load_external_data=False)
    externalize(proto, TensorStore(path.parent, path.with_name(path.name + ".data")))  # one tensor at a time
    onnx.save(proto, str(path))  # proto's tensors now point into the data file, which the twin shares
    twin = path.with_name(twin_name(path.name))
    onnx.save(batched_twin(proto), str(twin))
    return twin.name


def check_twin(fused_path: Path, twin_path: Path, max_len: int, quantized: bool, seed: int = 0) -> dict:
    """Run the twin on one call of 3 rows of different lengths (a chain, a tree, a 2-token chain padded to
    Q = 4; the stale cache filled with 1e4, which no result may read) and the fused graph on each row alone
    from the same cache; returns {"rel", "kl_mean"} (logits and new K/V: max |Δ| / spread; KL(fused || twin)
    mean over the rows' tokens). ExportError beyond ``BOUNDS``: rel for fp32 graphs, kl_mean for quantized."""
    from ..engines.ort import OrtEngine
    from .parity import logit_metrics, rel_diff  # (torch: an export's)

    fused = OrtEngine(fused_path)
    q = 4
    lengths = np.clip([5, 1, 8], 1, max_len - q)
    max_len = min(max_len, int(lengths.max()) + q + 4)  # the cache buffers' length: what the rows use, and stale room
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)  # a root, 2 children, a grandchild
    blocks = [None, tree, np.tril(np.ones((2, 2), bool))]
    depths = [np.arange(q), np.array([0, 1, 1, 2]), np.arange(q)]
    sizes = [q, q, 2]  # each row's real tokens
    rng = np.random.default_rng(seed)
    vocab = fused.session.get_outputs()[0].shape[-1]
    cache = _cache(fused, max_len, len(lengths))
    for r, n in enumerate(lengths):  # each row's past, written by the fused graph
        _call(fused, [c[r : r + 1] for c in cache], rng.integers(0, vocab, (1, n)), [0], [None], [np.arange(n)])
    ids = rng.integers(0, vocab, (len(lengths), q))
    ref = [_call(fused, [c[r : r + 1].copy() for c in cache], ids[r : r + 1], lengths[r : r + 1], blocks[r : r + 1],
                 depths[r : r + 1]) for r in range(len(lengths))]  # (logits [1, Q, V], planes) per row
    del fused  # one session at a time: each holds the weights
    logits, planes = _call(OrtEngine(twin_path), cache, ids, lengths, blocks, depths)
    want = np.concatenate([ref[r][0][0, :n] for r, n in enumerate(sizes)])  # [tokens, V] every row's real tokens
    got = np.concatenate([logits[r, :n] for r, n in enumerate(sizes)])
    logit = logit_metrics(got, want)
    rel = max([logit["rel"]] + [rel_diff(b[r, :, length : length + n], a[0, :, length : length + n])
                                for r, (n, length) in enumerate(zip(sizes, lengths)) for a, b in zip(ref[r][1], planes)])
    figures = {"rel": rel, "kl_mean": logit["kl_mean"]}
    check_bounds(figures, quantized, f"the batched twin {twin_path.name} differs from {fused_path.name}",
                 "one batched call vs the rows one by one")
    return figures


def check_bounds(figures: dict, quantized: bool, what: str, how: str) -> None:
    """ExportError (``what``: key figure > bound (``how``)) where a graph written beside the fused one exceeds
    ``BOUNDS``: ``kl_mean`` for quantized graphs, ``rel`` for fp32 ones."""
    key = "kl_mean" if quantized else "rel"
    if not figures[key] <= BOUNDS[key]:
        raise ExportError(f"{what}: {key} {figures[key]:.3g} > {BOUNDS[key]} ({how})")


def _cache(engine, max_len: int, rows: int) -> list:
    """The in-place cache planes [rows, Hkv, max_len, D] of a fused graph, in input order, filled with 1e4."""
    shapes = [i.shape for i in engine.session.get_inputs() if i.name.startswith("past_")]
    return [np.full((rows, s[1], max_len, s[3]), 1e4, np.float32) for s in shapes]


def _call(engine, planes: list, ids, lengths, blocks, depths):
    """One in-place call of ``ids`` [R, Q] after rows of ``lengths``; returns (logits [R, Q, V], the planes)."""
    from ..engines.ort import Binding

    b = Binding(engine)
    names = [i.name for i in engine.session.get_inputs() if i.name.startswith("past_")]
    for name, plane in zip(names, planes):
        b.cache(name, name.replace("past_", "present_"), plane)
    lengths = np.asarray(lengths, np.int64)
    q = ids.shape[1]
    positions = np.stack([length + np.resize(d, q) for length, d in zip(lengths, depths)])  # [R, Q]
    b.inputs(input_ids=np.asarray(ids, np.int64), position_ids=np.minimum(positions, planes[0].shape[2] - 1),
             attention_mask=in_place_mask(lengths, q, blocks), seqlens_k=(lengths + q - 1).astype(np.int32),
             total_sequence_length=np.array(lengths.max() + q, np.int32))
    for out in engine.session.get_outputs():
        if not out.name.startswith("present_"):
            b.output(out.name, (len(lengths), q, out.shape[-1]))
    return b.run()["logits"], planes

