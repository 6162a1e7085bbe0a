"""The prefill graph of a MatMulNBits target (export/prefill_graph.py, manifest ``prefill_file``): its weights are
the decode graph's, dequantized exactly; prompts run through it (logits of the last position only); speculation
stays exact (greedy = plain) and the prefix cache reuses only prompt entries, so a warm multi-turn prompt equals
a cold one; fp32 and w8a8 engines get none, nor does ``--no-prefill-graph``."""
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import specrt
from specrt.export.onnx_export import ExportConfig, export_engine
from specrt.export.prefill_graph import dequantize_nbits
from reference import run_all
from specrt.runtime.core import CoreConfig, SequenceRequest
from specrt.runtime.sampling import SamplingParams
from tiny import make_model

TARGET = dict(arch="llama", hidden=64, scale=20.0)  # head_dim 16: the fused graph
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


@pytest.fixture(scope="module")
def engine(build_engine):
    return build_engine("prefill_int4", TARGET, max_len=64, quantize="int4")


@pytest.mark.parametrize("bits,zero_points", [(4, False), (4, True), (8, False)])
def test_dequantized_weights_are_what_matmulnbits_multiplies_by(bits, zero_points):
    import onnxruntime as ort

    rng = np.random.default_rng(bits)
    k, n, block = 80, 6, 32  # K not a multiple of the block: the last block is padded
    blocks = -(-k // block)
    packed = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = rng.random(n * blocks, dtype=np.float32)
    zp = rng.integers(0, 256, (n, -(-blocks * bits // 8)), dtype=np.uint8).reshape(-1) if zero_points else None
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")]
    inits += [numpy_helper.from_array(zp, "Z")] if zero_points else []
    node = helper.make_node("MatMulNBits", ["A", "B", "S"] + (["Z"] if zero_points else []), ["Y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, k)).astype(np.float32)
    w = dequantize_nbits(packed, scales, zp, k, n, bits, block)
    assert w.shape == (k, n)
    np.testing.assert_allclose(x @ w, session.run(None, {"A": x})[0], rtol=1e-5, atol=1e-4)


def test_the_export_writes_the_prefill_graph_on_the_integer_kernel(engine):
    entry = json.loads((engine / "manifest.json").read_text())["models"]["target"]
    assert entry["prefill_file"] == "target_prefill.onnx"
    assert entry["prefill_parity"]["kl_mean"] < 0.2
    proto = onnx.load(str(engine / "target_prefill.onnx"), load_external_data=False)
    ops = {n.op_type for n in proto.graph.node}
    assert "MatMulNBits" not in ops and "MatMulIntegerToFloat" in ops
    shared = {i.name for i in proto.graph.initializer
              if any(e.key == "location" and e.value == "target.onnx.data" for e in i.external_data)}
    assert shared, "the embedding, norms and lm_head are read from the decode graph's weights file"


def test_prompts_run_through_the_prefill_graph(engine):
    rt = specrt.load(engine)
    runner = rt.runner("target", 2)[0]
    assert runner.prefill_graph is not None
    logits, _ = runner.prefill(0, PROMPT)  # [V] of the last position
    decode = runner.forward([1], [PROMPT]).logits[0, -1]  # the decode graph over the same prompt
    assert runner.lengths[0] == len(PROMPT)
    assert logits.argmax() == decode.argmax() and np.abs(logits - decode).max() < 0.25 * decode.std()
    assert not np.array_equal(logits, decode)  # another kernel: close, not the same bits


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_equals_plain_greedy(engine, method):
    rt = specrt.load(engine)
    prompt = PROMPT + PROMPT[:8]
    plain = rt.generate(prompt, max_new_tokens=30, method="none").token_ids
    assert rt.generate(prompt, max_new_tokens=30, method=method, gamma=3).token_ids == plain


def test_a_warm_multi_turn_prompt_equals_a_cold_one(engine):
    """The second turn's prompt holds the first answer: its entries came from decode steps, so the prefix
    cache reuses the first prompt only and prefills the answer again, as a cold run does."""
    rt = specrt.load(engine)
    warm = rt.new_core(CoreConfig(max_batch=2, method="none", calibrate=False))
    warm.prefix.min_hit = 4  # the tiny engine's prompts are short

    def run(core, rid, prompt):
        return run_all(core, [SequenceRequest(rid, list(prompt), SamplingParams(max_new_tokens=12))])[rid][0]

    turn = PROMPT + run(warm, "a", PROMPT) + [4, 2]
    assert run(warm, "b", turn) == run(rt.new_core(CoreConfig(max_batch=1, method="none", calibrate=False,
                                                              prefix_cache=False)), "c", turn)
    assert warm.prefix.hit_tokens == len(PROMPT)  # the answer's entries were not kept


@pytest.mark.parametrize("quantize,flag", [(None, True), ("w8a8", True), ("int4", False)])
def test_no_prefill_graph_where_it_would_change_nothing_or_is_turned_off(tmp_path, quantize, flag):
    target = make_model(tmp_path / "target", **TARGET)
    out = export_engine(target, tmp_path / "engine", log=lambda *_: None,
                        cfg=ExportConfig(max_len=32, prefill_chunk=16, quantize=quantize, prefill_graph=flag))
    entry = json.loads((out / "manifest.json").read_text())["models"]["target"]
    assert "prefill_file" not in entry and not (out / "target_prefill.onnx").exists()
    assert specrt.load(out).runner("target", 1)[0].prefill_graph is None
