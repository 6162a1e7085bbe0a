"""Bad input to the C++ runtime: every broken engine dir the Python loader refuses gives an error
code and the SAME message (never a crash); bad arguments give "argument" errors."""
import json
import shutil

import pytest

import specrt
from specrt.engines import EngineError
from specrt.tools.libspecrt import CppEngine, CppError


def edit(key_path, value=None, drop=False):
    def fn(engine):
        m = json.loads((engine / "manifest.json").read_text())
        d = m
        for k in key_path[:-1]:
            d = d[k] if not isinstance(d, list) else d[int(k)]
        if drop:
            d.pop(key_path[-1])
        else:
            d[key_path[-1]] = value
        (engine / "manifest.json").write_text(json.dumps(m))
    return fn


def write(name, data):
    return lambda engine: (engine / name).write_bytes(data)


def remove(name):
    return lambda engine: (engine / name).unlink()


# case -> (how to break a copy of the engine dir, how much of the message must match: None = all of it)
CASES = {
    "missing_manifest": (remove("manifest.json"), None),
    "corrupt_manifest": (write("manifest.json", b"{ not json"), "is not valid JSON: "),  # the parser's detail differs
    "not_a_manifest": (write("manifest.json", b'{"format": "x"}'), None),
    "unknown_schema_version": (edit(["schema_version"], 99), None),
    "string_schema_version": (edit(["schema_version"], "2"), None),
    "missing_models": (edit(["models"], drop=True), None),
    "unknown_role": (edit(["models", "critic"], {}), None),
    "missing_field": (edit(["models", "target", "num_layers"], drop=True), None),
    "missing_vocab_hash": (edit(["models", "draft", "vocab_sha256"], drop=True), None),
    "missing_graph_file": (remove("draft.onnx"), None),
    "bad_dtype": (edit(["models", "target", "dtype"], "fp64"), None),
    "bad_kv_layout": (edit(["models", "target", "kv_layout"], "paged"), None),
    "contract_mismatch": (edit(["models", "target", "num_layers"], 7), None),
    "missing_tokenizer": (remove("tokenizer/tokenizer.json"), None),
    "draft_vocab_size": (edit(["models", "draft", "vocab_size"], 99), None),
    "draft_tokenizer": (edit(["models", "draft", "vocab_sha256"], "0" * 64), None),
    "missing_max_len": (edit(["max_len"], drop=True), None),
    "missing_eos": (edit(["tokenizer", "eos_token_ids"], drop=True), None),
    "defaults_gamma": (edit(["defaults", "gamma"], 9), None),
    "corrupt_graph": (write("target.onnx", b"garbage"), "cannot load target.onnx: "),  # ORT's Python and C messages differ
    "graph_of_another_model": (lambda e: shutil.copy(e / "draft.onnx", e / "target.onnx"), None),
    "aux_layers_out_of_range": (edit(["models", "target", "aux_hidden_layers"], [1, 9]), None),
    "aux_layers_not_a_list": (edit(["models", "target", "aux_hidden_layers"], "2"), None),
    "input_shape": (edit(["models", "target", "inputs", "3", "shape"], ["past", "batch", 3, 8]), None),
    "medusa_without_hidden": (edit(["medusa"], {"file": "target.onnx", "num_heads": 2, "hidden_size": 32,
                                                 "vocab_size": 32, "dtype": "fp32", "tree": {"nodes": 3, "depth": 1},
                                                 "inputs": [], "outputs": []}), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_message_as_the_python_loader(lib, llama_engine, tmp_path, case):
    engine = tmp_path / "engine"
    shutil.copytree(llama_engine, engine)
    breaker, prefix = CASES[case]
    breaker(engine)
    with pytest.raises(EngineError) as py:
        specrt.load(engine)
    with pytest.raises(CppError) as cpp:
        CppEngine(lib, engine)
    assert cpp.value.kind == "engine"
    want, got = str(py.value), str(cpp.value)
    if prefix is None:
        assert got == want
    else:
        assert got[: got.index(prefix) + len(prefix)] == want[: want.index(prefix) + len(prefix)]


def test_not_a_directory(lib, tmp_path):
    with pytest.raises(EngineError) as py:
        specrt.load(tmp_path / "nope")
    with pytest.raises(CppError, match="does not exist") as cpp:
        CppEngine(lib, tmp_path / "nope")
    assert str(cpp.value) == str(py.value)


BAD_ARGUMENTS = [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_k=-2), "top_k must be an integer >= 0 (0 = off), got -2"),
    (dict(min_p=1.0), "min_p must be in [0, 1), got 1.0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(method="beam"), "unknown method 'beam'"),
    (dict(method="medusa"), "method 'medusa' is not in the C++ runtime (it runs none, draft, ngram, suffix)"),
    (dict(gamma=9), "gamma must be in 0..4"),
    (dict(prompt=[]), "prompt length 0 outside 1..63"),
    (dict(prompt=[1] * 64), "prompt length 64 outside 1..63"),
    (dict(prompt=[1, 99]), "token id 99 outside the vocabulary 0..31"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ARGUMENTS, ids=lambda x: str(x)[:40])
def test_bad_arguments_are_argument_errors(lib, llama_engine, kwargs, message):
    cpp = CppEngine(lib, llama_engine)
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", [3, 1, 4])
    with pytest.raises(CppError) as err:
        cpp.generate(prompt, **kwargs)
    assert err.value.kind == "argument" and str(err.value).startswith(message), str(err.value)
    assert cpp.generate([3, 1, 4], max_new_tokens=4).token_ids  # the engine still works afterwards


def test_draft_method_without_a_draft(lib, build_engine):
    engine = build_engine("cpp_no_draft", dict(arch="llama", seed=0))
    cpp = CppEngine(lib, engine)
    assert cpp.default_method == "ngram"
    with pytest.raises(CppError, match="method 'draft' needs an engine dir exported with --draft"):
        cpp.generate([3, 1, 4], method="draft")


def test_a_missing_onnxruntime_is_a_runtime_error(cpp_build, llama_engine):
    """Run in a fresh process: ONNX Runtime is loaded once per process."""
    import subprocess
    import sys

    code = ("from specrt.tools.libspecrt import *\n"
            f"lib = load_library(library_path({str(cpp_build)!r}))\n"
            "try:\n"
            f"    CppEngine(lib, {str(llama_engine)!r}, ort_library='/nonexistent/libonnxruntime.so.1')\n"
            "except CppError as e:\n"
            "    print(e.kind, e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.startswith("runtime cannot load ONNX Runtime from /nonexistent/libonnxruntime.so.1"), res.stderr
