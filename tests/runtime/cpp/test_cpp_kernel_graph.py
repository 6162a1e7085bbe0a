"""The graph libspecrt's kernels run equals the Python runtime's, node for node: attention and int4 matmuls moved
to specrt's domain, each SwiGLU and RMS norm folded into its matmul where both rules allow, and (on a CPU with AMX) each
int8 matmul with per-row activations and its row-scale Mul made one MatMulInt8 (runtime/cpp/src/kernel_attention.cpp
against custom_ops/__init__.py). Two runtimes that rewrote a graph differently would round differently and could
pick different tokens."""
from __future__ import annotations

import os
import subprocess

import onnx
import pytest
from onnx import helper

from specrt.custom_ops import (fuse_int8_matmuls, fuse_norms, fuse_swiglu, int8_code, use_specrt_attention,
                               use_specrt_matmul)

INT4_TARGET = dict(arch="llama", seed=0, scale=30.0, hidden=64)  # the fused graph, int4 MLPs of 256 columns


def python_rewrite(model):
    use_specrt_attention(model)
    use_specrt_matmul(model)
    fuse_swiglu(model)
    fuse_norms(model)
    if int8_code():
        fuse_int8_matmuls(model)
    return model


def cpp_rewrite(cpp_build, path, out):
    env = {**os.environ, "SPECRT_TEST_KERNEL_MODEL": str(path), "SPECRT_TEST_KERNEL_OUT": str(out)}
    run = subprocess.run([str(cpp_build / "specrt_unit_tests")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return onnx.load(str(out), load_external_data=False)


def nodes(model) -> list:
    return [(n.op_type, n.domain, list(n.input), list(n.output),
             sorted((a.name, str(helper.get_attribute_value(a))) for a in n.attribute)) for n in model.graph.node]


@pytest.mark.parametrize("variant", ["as exported", "a gate read elsewhere", "a norm read elsewhere"])
def test_cpp_folds_the_same_nodes_as_python(cpp_build, build_engine, tmp_path, variant):
    engine = build_engine("kernel_graph_int4", INT4_TARGET, max_len=32, quantize="int4")
    model = onnx.load(str(engine / "target.onnx"), load_external_data=False)
    if variant == "a gate read elsewhere":  # layer 0's gate also a graph output: that layer keeps its four ops
        gate = next(n for n in model.graph.node if n.op_type == "Split").output[0]
        model.graph.output.append(helper.make_tensor_value_info(gate, onnx.TensorProto.FLOAT, None))
    if variant == "a norm read elsewhere":  # layer 1's first norm also a graph output: it stays a node
        norm = [n for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"][1].output[0]
        model.graph.output.append(helper.make_tensor_value_info(norm, onnx.TensorProto.FLOAT, None))
    sizes = next(n for n in model.graph.node if n.op_type == "Split").input[1]  # every layer's split reads it
    path = tmp_path / "in.onnx"
    onnx.save(model, str(path))
    want = python_rewrite(onnx.load(str(path), load_external_data=False))
    got = cpp_rewrite(cpp_build, path, tmp_path / "out.onnx")
    def folded(attribute):
        return sum(any(a.name == attribute for a in n.attribute) for n in want.graph.node)

    assert folded("swiglu") == (1 if variant == "a gate read elsewhere" else 2)  # the tiny target's two layers
    assert any(t.name == sizes for t in want.graph.initializer) == (variant == "a gate read elsewhere")  # while read
    assert folded("norm_epsilon") == (3 if variant == "a norm read elsewhere" else 4)  # two a layer
    assert sum(n.op_type == "MatMulInt8" for n in want.graph.node) == int8_code()  # the int8 lm_head
    assert nodes(got) == nodes(want)
    assert sorted(t.name for t in got.graph.initializer) == sorted(t.name for t in want.graph.initializer)


@pytest.mark.parametrize("variant", ["as exported", "a row scale read elsewhere"])
def test_cpp_folds_the_same_int8_matmuls_as_python(cpp_build, build_engine, tmp_path, variant):
    """w8a8: every layer's matmuls and the lm_head are int8 with per-row activations."""
    if not int8_code():
        pytest.skip("the int8 matmul takes a graph's int8 matmuls on a CPU with AMX (custom_ops.int8_code)")
    engine = build_engine("kernel_graph_w8a8", INT4_TARGET, max_len=32, quantize="w8a8")
    model = onnx.load(str(engine / "target.onnx"), load_external_data=False)
    int8 = sum(n.op_type == "MatMulIntegerToFloat" for n in model.graph.node)
    if variant == "a row scale read elsewhere":  # the first matmul's output also a graph output: it stays
        first = next(n for n in model.graph.node if n.op_type == "MatMulIntegerToFloat").output[0]
        model.graph.output.append(helper.make_tensor_value_info(first, onnx.TensorProto.FLOAT, None))
    path = tmp_path / "in.onnx"
    onnx.save(model, str(path))
    want = python_rewrite(onnx.load(str(path), load_external_data=False))
    got = cpp_rewrite(cpp_build, path, tmp_path / "out.onnx")
    assert sum(n.op_type == "MatMulInt8" for n in want.graph.node) == int8 - (variant != "as exported")
    assert nodes(got) == nodes(want)
