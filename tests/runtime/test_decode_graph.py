"""The target's padded decode graph (export/decode_pad.py, manifest ``decode_file``) in the in-place runner:
on a quantized toy engine a decode step's logits equal the verify pass's row bit for bit, so greedy speculation
equals plain greedy token for token; without it (an engine dir from before it) the two differ."""
import dataclasses
import json
import shutil

import numpy as np
import pytest

import specrt
from specrt.engines import EngineError
from specrt.runtime import in_place
from specrt.runtime.in_place import InPlaceRunner

TARGET = dict(arch="llama", hidden=64, scale=20.0)  # head_dim 16: the fused graph
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
TOKENS = [2, 7, 1, 8, 2]  # a verify pass of 5


@pytest.fixture(scope="module", params=["int4", "w8a8"])
def engine(build_engine, request):
    return build_engine(f"decode_pad_{request.param}", TARGET, max_len=48, quantize=request.param)


def steps_and_pass(runner: InPlaceRunner) -> tuple[np.ndarray, np.ndarray]:
    """(logits of 5 decode steps [5, V], the verify pass of the same 5 tokens [5, V]), after the same prompt,
    each in a slot of its own."""
    runner.prefill(0, PROMPT)
    runner.prefill(1, PROMPT)
    steps = []
    for t in TOKENS:
        p = runner.forward([0], [[t]])
        runner.commit(p)
        steps.append(p.logits[0, 0])
    return np.stack(steps), runner.forward([1], [TOKENS]).logits[0]


def assert_lookups_equal_plain(rt) -> None:
    """n-gram and suffix decoding at γ max give plain greedy's tokens, on a prompt where lookups find proposals."""
    base = [3, 1, 4, 1, 5]
    cont = rt.generate(base, max_new_tokens=8, method="none").token_ids
    prompt = base + cont + base + cont[:1]
    plain = rt.generate(prompt, max_new_tokens=24, method="none").token_ids
    for method in ("ngram", "suffix"):
        out = rt.generate(prompt, max_new_tokens=24, method=method, gamma=rt.gamma_max)
        assert out.token_ids == plain and out.stats["proposed"] > 0


def test_the_export_writes_the_padded_graph_on_the_shared_weights_file(engine):
    entry = json.loads((engine / "manifest.json").read_text())["models"]["target"]
    assert entry["decode_file"] == "target_decode.onnx"
    assert entry["decode_parity"]["steps_vs_verify"] == 0.0 and entry["decode_parity"]["kl_mean"] < 0.05
    data = (engine / "target.onnx.data").stat().st_size
    assert (engine / "target_decode.onnx").stat().st_size < data / 4  # the weights stay in target.onnx.data


def test_a_decode_step_equals_the_verify_pass_row_bit_for_bit(engine):
    """Through the padded graph, or where ONNX Runtime's one-row matmul differs (AVX2, ARM) as calls of two rows."""
    rt = specrt.load(engine, attention="ort")  # ORT's attention (not $SPECRT_ATTENTION)
    runner = rt.runner("target", 2)[0]
    assert (runner.single is runner.engine) == (runner.decode_rows == 2)
    assert runner.data.shape[3] == rt.manifest.max_len + 1
    steps, verify = steps_and_pass(runner)
    assert np.array_equal(steps, verify)
    unpadded = InPlaceRunner.for_graph(rt.target.engine, dataclasses.replace(rt.target.spec, decode_file=None),
                                       rt.manifest.max_len, 2, decode_rows=1)
    assert unpadded.single is unpadded.engine
    steps, verify = steps_and_pass(unpadded)  # the fused graph's own Q = 1 path: not the verify pass's bits
    if rt.target.spec.quantize == "int4":  # (this toy w8a8 graph happens to round both paths alike)
        assert not np.array_equal(steps, verify), "ORT's GQA no longer has a Q = 1 path of its own: the pad is moot"


@pytest.mark.parametrize("attention", ["ort", "specrt"])
def test_where_a_one_row_matmul_differs_a_decode_step_runs_two_rows(engine, attention, monkeypatch, request):
    """Where ONNX Runtime's MatMulNBits computes a one-row call apart from calls of several (its AVX2 and ARM code,
    ``engines.ort.one_row_differs``), a one-token call runs as two rows through the fused graph, the token and a dummy
    copy: it equals the verify pass's row bit for bit, alone or as a slot between others' in a batch step, at the
    cache's last entry too; greedy speculation equals plain greedy. Forced here, whatever this CPU's kernel does."""
    monkeypatch.setattr(in_place, "one_row_differs", lambda engine: True)
    if attention == "specrt":
        attention = request.getfixturevalue("specrt_attention")  # skipped, saying why, where the kernel cannot build
    rt = specrt.load(engine, attention=attention, matmul="ort")
    runner = rt.runner("target", 3)[0]
    assert runner.decode_rows == 2 and runner.single is runner.engine
    steps, verify = steps_and_pass(runner)
    assert np.array_equal(steps, verify)
    runner = rt.runner("target", 3)[0]
    runner.prefill(0, PROMPT)
    runner.prefill(2, PROMPT)
    batch = runner.forward([0, 2], [[TOKENS[0]], [TOKENS[0]]])  # slots 0 and 2: two calls of one row each
    assert np.array_equal(batch.logits[0, 0], steps[0]) and np.array_equal(batch.logits[1, 0], steps[0])
    n = rt.manifest.max_len
    runner.prefill(1, [i % 31 + 1 for i in range(n - 2)])
    last = runner.forward([1], [[3]])  # the core's last step (max_len - 1 entries): its dummy writes the last entry
    runner.commit(last)
    assert runner.room(1) == 1 and np.isfinite(last.logits).all()
    assert_lookups_equal_plain(rt)


def test_a_full_cache_still_takes_a_decode_step(engine):
    """The padding row of a call ending at max_len writes the cache's spare entry."""
    rt = specrt.load(engine)
    runner = rt.runner("target", 1)[0]
    n = rt.manifest.max_len
    runner.prefill(0, [i % 31 + 1 for i in range(n - 1)])
    p = runner.forward([0], [[3]])
    runner.commit(p)
    assert runner.room(0) == 0 and np.isfinite(p.logits).all()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_equals_plain_greedy(engine, method):
    rt = specrt.load(engine)
    base = [3, 1, 4, 1, 5]
    cont = rt.generate(base, max_new_tokens=8, method="none").token_ids
    prompt = base + cont + base + cont[:1]  # n-gram lookups find proposals
    plain = rt.generate(prompt, max_new_tokens=24, method="none").token_ids
    out = rt.generate(prompt, max_new_tokens=24, method=method, gamma=rt.gamma_max)  # γ fixed: not up to timing
    assert out.token_ids == plain
    assert out.stats["proposed"] > 0


def test_a_manifest_naming_a_missing_or_misplaced_decode_graph_is_refused(engine, tmp_path):
    copy = shutil.copytree(engine, tmp_path / "engine")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "target_decode.onnx").unlink()
    with pytest.raises(EngineError, match="target graph file 'target_decode.onnx' is missing"):
        specrt.load(copy)
    manifest["models"]["target"]["kv_layout"] = "time_major"
    del manifest["models"]["target"]["batched_file"]  # (refused likewise)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(engine / "target_decode.onnx", copy / "target_decode.onnx")
    with pytest.raises(EngineError, match="decode_file is for kv_layout in_place graphs only"):
        specrt.load(copy)


@pytest.mark.parametrize("matmul", ["ort", "specrt"])
def test_on_specrt_attention_the_fused_graph_needs_no_pad(engine, specrt_attention, matmul):
    """specrt's kernel computes a row the same whatever else its call holds: decode steps run the fused graph
    (no padded graph opened) and still equal the verify pass's rows bit for bit; greedy speculation equals
    plain greedy. So do specrt's int4 matmul (custom_ops/matmul_nbits.cpp) where the CPU runs it, and its int8 matmul
    (matmul_int8.cpp: the w8a8 graph's matmuls, the int4 graph's lm_head) where the CPU has AMX too."""
    from specrt.custom_ops import int8_code, matmul_code

    if matmul == "specrt" and not matmul_code():
        pytest.skip("specrt's int4 matmul needs x86-64 with AVX2 and FMA (custom_ops.matmul_isa)")
    rt = specrt.load(engine, attention=specrt_attention, matmul=matmul)
    runner = rt.runner("target", 2)[0]
    assert runner.single is runner.engine and rt.target.engine.session.specrt_attention > 0
    int4 = rt.target.spec.quantize == "int4"
    assert (rt.target.engine.session.specrt_matmuls > 0) == (matmul == "specrt" and (int4 or int8_code()))
    steps, verify = steps_and_pass(runner)
    assert np.array_equal(steps, verify)
    assert_lookups_equal_plain(rt)
