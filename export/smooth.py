"""Activation smoothing (SmoothQuant) for the integer kernel: per-channel factors folded into fp32 weights.

export/quantize_integer.py rounds each activation row to int8 with ONE scale, so a channel with outliers
(RMSNorm outputs, the SwiGLU product) costs every other channel its precision: on SmolLM2-135M the
mean KL from the fp32 model is 0.035 and top-1 0.93. Before quantizing, each such input x of MatMuls
x @ W gets a factor per channel k, s_k = max|x_k|^a / max|W_k|^(1-a) (a = ``ALPHA``; max|x_k| over the
calibration text, max|W_k| over row k of every MatMul reading x), divided out of the op that produces x
and multiplied into W's rows: the fp32 model computes the same function (up to rounding) and both
operands of the int8 product have flatter ranges (SmolLM2-135M: KL 0.010, top-1 0.97;
docs/bench/verify-curve.md). Producers that can absorb 1/s exactly, in a fused graph
(export/fused_graph.py):

- (Skip)SimplifiedLayerNormalization: its weight (gamma), when the normed output feeds only these MatMuls;
- Mul(silu(gate), up): the up MatMul's weight columns (in a fused graph, the second half of the packed gate|up);
- GroupQueryAttention: the v columns (and bias) of the packed qkv MatMul, one factor per (kv head, channel)
  shared by the query heads of the group.

Any other input is left as it is.

Example::

    smooth_inputs(proto, lambda node: True, calibration_ids, max_len=2048)   # in place; returns inputs smoothed
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import numpy as np

from .tensor_store import TensorStore

ALPHA = 0.5  # migration strength: 0.3 / 0.5 / 0.7 give KL 0.024 / 0.010 / 0.012 on SmolLM2-135M
LIMIT = 1e4  # factors are clipped to [1 / LIMIT, LIMIT]


class _Graph:
    """Name lookups over a ModelProto."""

    def __init__(self, proto, store: TensorStore):
        from onnx import numpy_helper

        self.proto, self.np, self.store = proto, numpy_helper, store
        self.inits = {i.name: i for i in proto.graph.initializer}
        self.producer = {o: n for n in proto.graph.node for o in n.output}
        self.consumers = {}
        for n in proto.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in proto.graph.output}

    def array(self, name: str) -> np.ndarray:
        return self.store.array(self.inits[name]).astype(np.float32)

    def set(self, name: str, a: np.ndarray) -> None:
        self.inits[name].CopyFrom(self.store.tensor(name, a.astype(np.float32)))


def smooth_inputs(proto, include, calibration_ids, max_len: int, alpha: float = ALPHA,
                  store: TensorStore | None = None, activation_max: dict | None = None) -> int:
    """Smooth, in ``proto``, the inputs of the MatMuls (constant fp32 weight, ``include(node)``) whose producer
    can absorb the factors; returns how many inputs were smoothed. ``activation_max``: max |x| per channel by
    input name, measured elsewhere (the export's: ``recording_activation_max``; a name it lacks is not
    smoothed); without it, measured here by running ``proto`` on ``calibration_ids`` in ONNX Runtime.
    ``store``: where the weights are read and written (export/tensor_store.py)."""
    g = _Graph(proto, store or TensorStore())
    groups = {}  # input -> the MatMuls reading it
    for n in proto.graph.node:
        if n.op_type == "MatMul" and n.input[1] in g.inits and include(n):
            groups.setdefault(n.input[0], []).append(n)
    plans = {x: fold for x, users in groups.items() if (fold := _fold_plan(g, x, users)) is not None}
    if not plans:
        return 0
    widths = {x: int(g.inits[users[0].input[1]].dims[0]) for x, users in groups.items() if x in plans}
    stats = (activation_max if activation_max is not None else
             _activation_max(proto, list(plans), widths, calibration_ids, max_len))
    plans = {x: fold for x, fold in plans.items() if x in stats}
    for x, fold in plans.items():
        rows = np.concatenate([g.array(m.input[1]) for m in groups[x]], axis=1)  # [K, sum N]
        s = np.clip(np.maximum(stats[x], 1e-5) ** alpha / np.maximum(np.abs(rows).max(1), 1e-5) ** (1 - alpha),
                    1 / LIMIT, LIMIT)
        s = fold(s)  # the producer divides x by s (per channel); it may tie channels together
        for m in groups[x]:
            g.set(m.input[1], g.array(m.input[1]) * s[:, None])
    return len(plans)


def _fold_plan(g: _Graph, x: str, users: list):
    """A function s -> s' that divides the producer of ``x`` by s' (s adjusted to what it can absorb), or None."""
    node = g.producer.get(x)
    if node is None or x in g.outputs or len(g.consumers.get(x, [])) != len(users):
        return None
    if node.op_type in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization") and node.output[0] == x:
        gamma = node.input[1 if node.op_type == "SimplifiedLayerNormalization" else 2]
        return _divide(g, gamma, axis=0) if gamma in g.inits else None
    if node.op_type == "Mul":  # silu(gate) * up: up's columns of its MatMul (the packed gate|up one: its 2nd half)
        ups = [fold for i in node.input if len(g.consumers.get(i, [])) == 1 and (fold := _columns_fold(g, i))]
        return ups[-1] if ups else None
    if node.op_type == "GroupQueryAttention" and node.output[0] == x:
        return _attention_fold(g, node)
    return None


def _columns_fold(g: _Graph, x: str):
    """s -> s dividing the weight columns (and bias) that compute ``x``: a MatMul's output [+ Add bias], or one
    half of one split in two along the last axis (fused graphs' packed gate|up); None for anything else."""
    node, half = g.producer.get(x), None
    if node is not None and node.op_type == "Split" and len(node.output) == 2 and halves(g, node) \
            and any(a.name == "axis" and a.i == -1 for a in node.attribute):
        half, x = list(node.output).index(x), node.input[0]  # 0: the first half of the columns, 1: the second
    node, bias = _weight_matmul(g, x)
    if node is None:
        return None
    width = g.inits[node.input[1]].dims[1]
    part = slice(None) if half is None else slice(half * width // 2, (half + 1) * width // 2)

    def fold(s):
        for name in (node.input[1], bias):
            if name is not None:
                a = g.array(name)
                a[..., part] /= s[None] if a.ndim == 2 else s
                g.set(name, a)
        return s

    return fold


def _weight_matmul(g: _Graph, x: str):
    """(the MatMul by a weight initializer that computes ``x``, its bias initializer's name or None) for
    ``x`` = MatMul(·, W) [+ bias]; (None, None) for anything else."""
    node, bias = g.producer.get(x), None
    if node is not None and node.op_type == "Add":
        bias = next((i for i in node.input if i in g.inits), None)
        node = next((g.producer.get(i) for i in node.input if i not in g.inits), None)
    if node is None or node.op_type != "MatMul" or node.input[1] not in g.inits:
        return None, None
    return node, bias


def halves(g: _Graph, split) -> bool:
    """Whether a Split node cuts its input in two equal parts (no sizes given, or two equal constant ones)."""
    if len(split.input) < 2 or not split.input[1]:
        return True
    return split.input[1] in g.inits and len(set(g.np.to_array(g.inits[split.input[1]]).tolist())) == 1


def _divide(g: _Graph, name: str, axis: int):
    """s -> s, dividing initializer ``name`` by s along ``axis`` (gamma [K]: 0; a weight's columns [K, N]: 1)."""
    def fold(s):
        g.set(name, g.array(name) / (s if axis == 0 else s[None]))
        return s

    return fold


def _attention_fold(g: _Graph, node):
    """Fold into the v part of the packed qkv projection feeding this attention (MatMul [+ Add bias])."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    qkv, bias = _weight_matmul(g, node.input[0])
    if qkv is None:
        return None
    width = g.inits[qkv.input[1]].dims[1]
    head_dim = width // (heads + 2 * kv_heads)
    v = slice((heads + kv_heads) * head_dim, width)

    def fold(s):
        per_kv = s.reshape(kv_heads, heads // kv_heads, head_dim).max(axis=1)  # [Hkv, D]: one factor per v channel
        w = g.array(qkv.input[1])
        w[:, v] /= per_kv.reshape(-1)[None]
        g.set(qkv.input[1], w)
        if bias is not None:
            b = g.array(bias)
            b[v] /= per_kv.reshape(-1)
            g.set(bias, b)
        return np.repeat(per_kv[:, None], heads // kv_heads, axis=1).reshape(-1)

    return fold


def _activation_max(proto, names: list, widths: dict, ids, max_len: int) -> dict:
    """name -> max |x| per channel [K] over one prefill of ``ids`` through the fp32 graph."""
    import onnx

    from ..engines.ort import OrtEngine
    from .fused_call import FusedCall

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(probe, str(path), save_as_external_data=True, location="probe.onnx.data")
        call = FusedCall(OrtEngine(path), max_len)
        call.widths.update(widths)
        out = call.run(np.asarray(ids, np.int64)[:max_len], past=0, outputs=names)
        return {n: np.abs(out[n][0]).max(axis=0) for n in names}


@contextlib.contextmanager
def recording_activation_max(modules: dict):
    """Within the block, each forward through the nn.Linears of ``modules`` (name -> module) records the max |x|
    per channel [K] of its input into the dict this yields (name -> [K]): the export takes the statistics on the
    torch model's calibration forward it runs anyway (a lazily read model: no second read of its layers)."""
    stats = {}

    def hook(name):
        def record(module, args):
            stats[name] = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(0).numpy()
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
