"""int8 MatMuls on ONNX Runtime's integer GEMM: per-channel weights, per-row activations.

``MatMulNBits`` at accuracy level 4 (export/quantize.py's nbits kernel) unpacks its weights on every call
and is compute-bound on this kind of CPU: each position a verify pass adds costs ~0.2 T(1)
(docs/bench/verify-curve.md). ``MatMulIntegerToFloat`` runs MLAS's packed u8s8 GEMM (AVX2 / AVX-512
VNNI / AMX, whichever the CPU has) on weights packed once at load: a verify pass of Q positions reads
them once, so T(5)/T(1) stays near 1.1. Each ``MatMul(x, W)`` of a fused graph with a constant W [K, N]
becomes

    s = max(max(|x|) over K, 1e-30) / 127         per row of x [B, Q, K]: [B, Q, 1]   (Abs, ReduceMax, Max, Mul)
    xq = QuantizeLinear(x, s, 128, block_size=K)  uint8, round half to even           (one op)
    y = MatMulIntegerToFloat(xq, Wq, 1, ws, 128) * s                                  (two ops)

with Wq = round(W / ws) int8 and ws = max(|W|) / 127 per output column. Everything a row's result
depends on is that row's own (the integer product is exact, the scales are per row), so a row gives bit
for bit the same result in a call of 1 or of Q rows; ONNX Runtime's ``DynamicQuantizeMatMul`` instead
takes one activation scale per call, which would tie a verify pass's rows (and a batch's sequences)
together. MatMuls reading the same input share its quantization (gate and up). Blocked QuantizeLinear is
ONNX opset 21: the graph's default-domain opset is raised to 21, which is why only fused graphs (whose
ops mean the same at 17 and 21) are rewritten.

Example::

    proto = onnx.load("target.onnx")
    integer_matmuls(proto, include=lambda node: True)   # in place; returns the number rewritten
"""
from __future__ import annotations

import numpy as np

ZERO_POINT = 128  # activations are stored as uint8 with this offset: MLAS's fast path is u8 x s8
OPSET = 21  # QuantizeLinear with block_size


class IntegerKernelError(ValueError):
    pass


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Wq int8 [K, N], ws float32 [N]): symmetric per output column, |Wq| <= 127.

    >>> q, s = quantize_weight(np.array([[1.0, -2.0], [0.5, 4.0]], np.float32))
    >>> q.tolist(), s.round(4).tolist()
    ([[127, -64], [64, 127]], [0.0079, 0.0315])
    """
    scale = np.maximum(np.abs(w).max(axis=0), 1e-30).astype(np.float32) / np.float32(127)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


class _Rewrite:
    """The nodes of the rewritten graph, and the per-row quantization of each activation done so far."""

    def __init__(self, outputs: set):
        self.nodes, self.quantized, self.zero_point = [], {}, None
        i = 0
        while f"iq{i or ''}/zero_point" in outputs:  # an earlier rewrite's (the int4 lm_head's): names of our own
            i += 1
        self.tag = f"iq{i or ''}"

    def op(self, kind: str, inputs: list, out: str, **attrs) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(kind, inputs, [out], name=out, **attrs))
        return out

    def quantize(self, x: str, k: int) -> tuple[str, str]:
        """(xq uint8 [B, Q, K], s float32 [B, Q, 1]) of activation ``x``, made once per activation."""
        from onnx import numpy_helper

        if x not in self.quantized:
            amax = self.op("ReduceMax", [self.op("Abs", [x], f"{x}/iq.abs"), "iq/last_axis"], f"{x}/iq.amax", keepdims=1)
            s = self.op("Mul", [self.op("Max", [amax, "iq/tiny"], f"{x}/iq.amax1"), "iq/inv127"], f"{x}/iq.scale")
            if self.zero_point is None:  # [B, Q, 1] of 128: every activation of a call has this shape
                shape = self.op("Shape", [s], f"{self.tag}/scale_shape")
                self.zero_point = self.op("ConstantOfShape", [shape], f"{self.tag}/zero_point",
                                          value=numpy_helper.from_array(np.array([ZERO_POINT], np.uint8)))
            xq = self.op("QuantizeLinear", [x, s, self.zero_point], f"{x}/iq.u8", axis=-1, block_size=k)
            self.quantized[x] = (xq, s)
        return self.quantized[x]


def integer_matmuls(proto, include, store=None) -> int:
    """Rewrite, in the fused graph ``proto`` (an ``onnx.ModelProto``), every ``MatMul`` with a constant fp32
    weight for which ``include(node)`` is true as above; returns the number rewritten. ``store``: where the
    weights are read and written, one at a time (export/tensor_store.py; default: in the proto)."""
    from onnx import TensorProto, helper, numpy_helper

    from .tensor_store import TensorStore

    store = store or TensorStore()
    g = proto.graph
    if not any(n.op_type == "GroupQueryAttention" for n in g.node):
        raise IntegerKernelError("the integer kernel rewrites fused graphs only (kv_layout in_place; "
                                 "--graph traced keeps MatMulNBits)")
    inits = {i.name: i for i in g.initializer}
    consts = {"iq/inv127": np.float32(1 / 127), "iq/tiny": np.float32(1e-30), "iq/one": np.float32(1),
              "iq/zp": np.uint8(ZERO_POINT), "iq/last_axis": np.array([-1], np.int64)}
    g.initializer.extend(numpy_helper.from_array(np.array(v), k) for k, v in consts.items() if k not in inits)
    rw, count = _Rewrite({o for n in g.node for o in n.output}), 0
    for node in list(g.node):
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or w.data_type != TensorProto.FLOAT or len(w.dims) != 2 or not include(node):
            rw.nodes.append(node)
            continue
        wq, ws = quantize_weight(store.array(w))
        g.initializer.remove(w)
        g.initializer.extend([store.tensor(w.name + "/iq.w", wq), store.tensor(w.name + "/iq.ws", ws)])
        xq, s = rw.quantize(node.input[0], int(w.dims[0]))
        base = node.name or node.output[0]
        y = rw.op("MatMulIntegerToFloat", [xq, w.name + "/iq.w", "iq/one", w.name + "/iq.ws", "iq/zp"],
                  f"{base}/iq.mm", domain="com.microsoft")
        rw.nodes.append(helper.make_node("Mul", [y, s], [node.output[0]], name=f"{base}/iq.rowscale"))
        count += 1
    del g.node[:]
    g.node.extend(rw.nodes)
    if count:
        for opset in proto.opset_import:
            if opset.domain in ("", "ai.onnx"):
                opset.version = max(opset.version, OPSET)
        proto.ir_version = max(proto.ir_version, 10)
    return count
