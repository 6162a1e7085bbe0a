"""specrt's int8 matmul (custom_ops/matmul_int8.cpp, ai.specrt::MatMulInt8) against what it replaces: QuantizeLinear per
row -> com.microsoft::MatMulIntegerToFloat -> Mul by the row's scale, as specrt exports an int8 lm_head (and every
w8a8 layer). The same bits on both of its paths (AMX and VNNI), a row's output independent of the call's other rows,
and which nodes ``fuse_int8_matmuls`` folds; the same for ai.specrt::DynamicMatMulInt8, which also takes in the ops
computing the row's scale and its quantized bytes (``fuse_row_quantize``, a prefill graph's pattern)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from specrt.custom_ops import fuse_int8_matmuls, fuse_row_quantize
from test_matmul_kernel import kernel_library, session  # the kernels' library or a skip; a session of 2 threads


@pytest.fixture(scope="module")
def library():
    return kernel_library("int8")


def int8_model(k: int, n: int, seed: int = 0, per_row: bool = True, mul_by=None, y_out: bool = False,
               tiny: bool = False, zq: int = 128, zq_shape: bool = True):
    """x [rows, K] -> amax per row / 127 = s -> QuantizeLinear(x, s, 128) -> MatMulIntegerToFloat(q, B, 1, b_scale, 128)
    -> Mul(y, s), as export/quantize.py writes it; ``per_row=False``: one scale for the tensor; ``mul_by``: the Mul's
    other input instead of s; ``y_out``: the matmul's output a graph output too; ``tiny``: amax = Max(amax, 1e-30)
    first (export/prefill_graph.py's pattern); ``zq``: QuantizeLinear's zero point, a ConstantOfShape of s's shape
    (``zq_shape=False``: of x's shape with a last dimension of 1, so that s feeds nothing else)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-127, 128, size=(k, n), dtype=np.int8)
    ws = (rng.random(n, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    nodes = [helper.make_node("Abs", ["x"], ["abs"]),
             helper.make_node("ReduceMax", ["abs", "axes"] if per_row else ["abs"], ["amax0" if tiny else "amax"],
                              keepdims=1),
             *([helper.make_node("Max", ["amax0", "tiny"], ["amax"])] if tiny else []),
             helper.make_node("Mul", ["amax", "inv127"], ["s"]),
             *([helper.make_node("Shape", ["s"], ["s_shape"]),
                helper.make_node("ConstantOfShape", ["s_shape"], ["zq"],
                                 value=numpy_helper.from_array(np.array([zq], np.uint8)))] if zq_shape else
               [helper.make_node("Shape", ["x"], ["x_rows"], end=-1),
                helper.make_node("Concat", ["x_rows", "one_dim"], ["s_shape"], axis=0),
                helper.make_node("ConstantOfShape", ["s_shape"], ["zq"],
                                 value=numpy_helper.from_array(np.array([zq], np.uint8)))]),
             helper.make_node("QuantizeLinear", ["x", "s", "zq"], ["q"],
                              **({"axis": -1, "block_size": k} if per_row else {})),
             helper.make_node("MatMulIntegerToFloat", ["q", "w", "one", "ws", "zp"], ["y"], domain="com.microsoft"),
             helper.make_node("Mul", ["y", mul_by or "s"], ["out"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(ws, "ws"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"), numpy_helper.from_array(np.array(128, np.uint8), "zp"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(1 / 127, np.float32), "inv127"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array(1e-30, np.float32), "tiny"),
             numpy_helper.from_array(np.array([1], np.int64), "one_dim")]
    outputs = [helper.make_tensor_value_info("out", TP.FLOAT, None)]
    if y_out:
        outputs.append(helper.make_tensor_value_info("y", TP.FLOAT, None))
    graph = helper.make_graph(nodes, "int8", [helper.make_tensor_value_info("x", TP.FLOAT, ["rows", k])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vnni"])
@pytest.mark.parametrize("k,n", [(64, 16), (96, 48), (576, 192)])  # K not a multiple of 64: padded with zeros
def test_it_computes_what_onnx_runtime_computes_bit_for_bit(library, monkeypatch, amx, k, n):
    if not amx:
        monkeypatch.setenv("SPECRT_NO_AMX", "1")  # read when the session packs the weights
    ort_, ours = int8_model(k, n), int8_model(k, n)
    assert fuse_int8_matmuls(ours) == 1
    assert [node.op_type for node in ours.graph.node][-1] == "MatMulInt8"  # where the matmul stood; the Mul gone
    ort_, ours = session(ort_), session(ours, library)
    x = np.random.default_rng(1).standard_normal((40, k)).astype(np.float32)
    x[3] = 0.0  # a row of zeros: scale 0
    for rows in (1, 2, 5, 8, 16, 17, 40):
        want, got = ort_.run(None, {"x": x[:rows]})[0], ours.run(None, {"x": x[:rows]})[0]
        assert np.array_equal(got, want), rows
        # a decode step (1 row) equals the same row of a verify pass
        assert np.array_equal(ours.run(None, {"x": x[rows - 1:rows]})[0][0], got[rows - 1]), rows


def test_only_what_it_computes_is_folded():
    assert fuse_int8_matmuls(int8_model(64, 32)) == 1
    assert fuse_int8_matmuls(int8_model(64, 24)) == 0  # N not a multiple of 16
    assert fuse_int8_matmuls(int8_model(64, 32, per_row=False)) == 0  # one scale for the whole tensor
    assert fuse_int8_matmuls(int8_model(64, 32, mul_by="half")) == 0  # a Mul by something else
    assert fuse_int8_matmuls(int8_model(64, 32, y_out=True)) == 0  # the matmul's output read elsewhere
    model = int8_model(64, 32)
    model.graph.node[6].input.append("b_zero_point")  # a weight zero point: not computed
    assert fuse_int8_matmuls(model) == 0
    model = int8_model(64, 32)
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w"))
    model.graph.input.append(helper.make_tensor_value_info("w", TP.INT8, [64, 32]))  # weights fed at run time
    assert fuse_int8_matmuls(model) == 0


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vnni"])
@pytest.mark.parametrize("k,n", [(64, 16), (96, 48), (576, 192)])
def test_the_row_quantization_folded_in_gives_the_same_bits(library, monkeypatch, amx, k, n):
    """DynamicMatMulInt8 quantizes each row itself (max |x|, Max with tiny, times 1/127; x / s rounded half to even,
    + 128, saturated): the same bytes and scale as ONNX Runtime's five ops, so the same output bits."""
    if not amx:
        monkeypatch.setenv("SPECRT_NO_AMX", "1")
    ort_, ours = int8_model(k, n, tiny=True, zq_shape=False), int8_model(k, n, tiny=True, zq_shape=False)
    assert fuse_int8_matmuls(ours) == 1 and fuse_row_quantize(ours) == 1
    assert [node.op_type for node in ours.graph.node] == ["Shape", "Concat", "ConstantOfShape", "DynamicMatMulInt8"]
    ort_, ours = session(ort_), session(ours, library)
    x = np.random.default_rng(2).standard_normal((40, k)).astype(np.float32) * np.float32(3.0)
    x[3] = 0.0  # a row of zeros: scale tiny / 127
    x[5, :7] = [1e6, -1e6, 0.5, -0.5, 2.5, 1e-8, -3.5]  # one huge entry a row: the others round to the zero point
    for rows in (1, 2, 5, 8, 16, 17, 40):
        want, got = ort_.run(None, {"x": x[:rows]})[0], ours.run(None, {"x": x[:rows]})[0]
        assert np.array_equal(got, want), rows
        assert np.array_equal(ours.run(None, {"x": x[rows - 1:rows]})[0][0], got[rows - 1]), rows


def test_only_the_row_quantization_it_computes_is_folded():
    def folded(model) -> int:
        fuse_int8_matmuls(model)
        return fuse_row_quantize(model)

    assert folded(int8_model(64, 32, tiny=True)) == 1
    assert folded(int8_model(64, 32)) == 0  # no Max with tiny (an int8 lm_head: left as it is)
    assert folded(int8_model(64, 32, tiny=True, zq=0)) == 0  # QuantizeLinear's zero point not the matmul's
    model = int8_model(64, 32, tiny=True)
    tiny = next(t for t in model.graph.initializer if t.name == "tiny")
    tiny.CopyFrom(numpy_helper.from_array(np.array(1e-30, np.float64), "tiny"))  # not the fp32 the kernel reads
    assert folded(model) == 0
    model = int8_model(64, 32, tiny=True, y_out=True)  # the matmul's output read elsewhere: not even a MatMulInt8
    assert folded(model) == 0
    model = int8_model(64, 32, tiny=True)  # the scale read elsewhere (here: the zero point's Shape): kept, computed
    assert folded(model) == 1  # again inside; QuantizeLinear goes
    ops = [node.op_type for node in model.graph.node]
    assert "QuantizeLinear" not in ops and {"Abs", "ReduceMax", "Max", "Mul"} <= set(ops)
