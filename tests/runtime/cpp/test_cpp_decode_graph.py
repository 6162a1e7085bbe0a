"""libspecrt on a quantized engine with the target's padded graph (``decode_file``, export/decode_pad.py): it runs
every call through it (prompts through the prefill graph, ``prefill_file``, as the Python runtime does), so its greedy speculation equals plain greedy and the Python runtime, token for token,
up to a full cache; an engine dir without the field still runs (the fused graph)."""
import json
import shutil

import pytest

import specrt
from specrt.tools.libspecrt import CppEngine

TARGET = dict(arch="llama", hidden=64, scale=20.0)  # head_dim 16: the fused graph (as test_decode_graph.py)
MAX_LEN = 48


@pytest.fixture(scope="module")
def engine(build_engine):
    return build_engine("decode_pad_int4", TARGET, max_len=MAX_LEN, quantize="int4")


def prompts():
    base = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    return {"five": base[:5], "repeats": base + base[:6], "fills_cache": (base * 10)[: MAX_LEN - 12]}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_cpp_greedy_speculation_equals_plain_and_python(lib, engine, method):
    rt, cpp = specrt.load(engine), CppEngine(lib, engine)
    assert rt.target.spec.decode_file == "target_decode.onnx"
    assert rt.target.spec.prefill_file == "target_prefill.onnx"  # prompts on the integer kernel, in both runtimes
    for name, prompt in prompts().items():
        plain = cpp.generate(prompt, max_new_tokens=40, method="none")
        out = cpp.generate(prompt, max_new_tokens=40, method=method, gamma=3)
        py = rt.generate(prompt, max_new_tokens=40, method="none")
        assert out.token_ids == plain.token_ids == py.token_ids, name
        if name == "fills_cache":  # the last call's padding row wrote the cache's spare entry
            assert len(prompt) + len(out.token_ids) == MAX_LEN and out.finish_reason == "length"


def test_cpp_without_the_decode_field_runs_the_fused_graph(lib, engine, tmp_path):
    copy = shutil.copytree(engine, tmp_path / "engine")
    manifest = json.loads((copy / "manifest.json").read_text())
    for key in ("decode_file", "decode_parity"):
        del manifest["models"]["target"][key]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "target_decode.onnx").unlink()
    out = CppEngine(lib, copy).generate([3, 1, 4, 1, 5], max_new_tokens=20, method="none")
    assert len(out.token_ids) == 20


@pytest.mark.parametrize("attention", ["specrt", "ort"])
def test_cpp_attention_on_the_kernel_or_ort_equals_python(lib, engine, attention):
    """libspecrt compiles specrt's attention kernel in (custom_ops/attention.cpp, the same flags): on it the fused
    graph's decode steps equal its verify passes' rows, so no padded graph is needed, and the tokens are the Python
    runtime's on the same kernel; "ort" keeps ONNX Runtime's attention and the padded graph."""
    cpp, rt = CppEngine(lib, engine, attention=attention), specrt.load(engine, attention=attention)
    assert cpp.attention == attention
    for name, prompt in prompts().items():
        plain = cpp.generate(prompt, max_new_tokens=40, method="none")
        out = cpp.generate(prompt, max_new_tokens=40, method="ngram", gamma=3)
        assert out.token_ids == plain.token_ids == rt.generate(prompt, max_new_tokens=40, method="none").token_ids, name


def test_cpp_attention_auto_and_bad_values(lib, engine, llama_engine, monkeypatch):
    from specrt.custom_ops import vector_code
    from specrt.tools.libspecrt import CppError

    assert CppEngine(lib, engine).attention == ("specrt" if vector_code() else "ort")  # auto: a -march=native build
    monkeypatch.setenv("SPECRT_ATTENTION", "ort")
    assert CppEngine(lib, engine).attention == "ort"
    assert CppEngine(lib, llama_engine, attention="specrt").attention == "ort"  # a traced graph: no such nodes
    with pytest.raises(CppError, match="attention must be one of auto, ort, specrt, got 'fast'"):
        CppEngine(lib, engine, attention="fast")
