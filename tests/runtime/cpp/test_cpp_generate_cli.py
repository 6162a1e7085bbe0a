"""`specrt generate --runtime cpp`: libspecrt's loop behind the CLI prints what the Python runtime prints."""
import json

import pytest
from click.testing import CliRunner

from specrt.tools import libspecrt
from specrt.tools.cli import cli

PROMPT = "hello world"


@pytest.fixture(scope="module")
def cpp_lib(cpp_build):
    return str(libspecrt.library_path(cpp_build))


def generate(engine, *args, cpp_lib=None):
    runtime = ["--runtime", "cpp", "--cpp-lib", cpp_lib] if cpp_lib else []
    return CliRunner().invoke(cli, ["generate", str(engine), "--prompt", PROMPT, *runtime, *args])


def as_json(res) -> dict:
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "suffix"])
def test_cpp_greedy_text_equals_python(llama_engine, cpp_lib, method):
    args = ["--max-new-tokens", "24", "--method", method, "--gamma", "3", "--json"]
    py, cpp = as_json(generate(llama_engine, *args)), as_json(generate(llama_engine, *args, cpp_lib=cpp_lib))
    assert (cpp["token_ids"], cpp["text"], cpp["finish_reason"]) == (py["token_ids"], py["text"], py["finish_reason"])
    assert cpp["stats"]["runtime"] == "cpp" and cpp["stats"]["method"] == method
    assert cpp["stats"]["target_passes"] == py["stats"]["target_passes"]


def test_cpp_stop_string_cuts_text_like_python(llama_engine, cpp_lib):
    full = as_json(generate(llama_engine, "--max-new-tokens", "24", "--method", "ngram", "--json"))
    stop = full["text"][6:9]  # a string the output is known to contain
    args = ["--max-new-tokens", "24", "--method", "ngram", "--stop", stop, "--json"]
    py, cpp = as_json(generate(llama_engine, *args)), as_json(generate(llama_engine, *args, cpp_lib=cpp_lib))
    assert cpp["text"] == py["text"] == full["text"][: full["text"].find(stop)]
    assert cpp["finish_reason"] == py["finish_reason"] == "stop"


def test_cpp_streams_text_then_summary(llama_engine, cpp_lib):
    res = generate(llama_engine, "--max-new-tokens", "12", "--method", "ngram", cpp_lib=cpp_lib)
    want = as_json(generate(llama_engine, "--max-new-tokens", "12", "--method", "ngram", "--json"))["text"]
    assert res.exit_code == 0, res.output
    assert res.output.startswith(want) and "[ngram C++] 12 tokens" in res.output and "tokens/pass" in res.output


def test_cpp_seeded_sampling_repeats(llama_engine, cpp_lib):
    """At a fixed γ (an adaptive γ follows measured times, so each round's random draws can differ)."""
    args = ["--max-new-tokens", "16", "--temperature", "0.9", "--top-p", "0.9", "--seed", "7", "--gamma", "2", "--json"]
    a, b = (as_json(generate(llama_engine, *args, cpp_lib=cpp_lib)) for _ in range(2))
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 16


@pytest.mark.parametrize("args,message", [
    (["--method", "medusa"], "method 'medusa' is not in the C++ runtime"),
    (["--backend", "torch"], "--backend torch needs --runtime python"),
    (["--acceptance", "typical"], "--acceptance typical needs --runtime python"),
    (["--providers", "cpu"], "--providers needs --runtime python"),
    (["--temperature", "-1"], "temperature must be"),
    (["--gamma", "9"], "gamma must be in 0..4"),
])
def test_cpp_bad_arguments(llama_engine, cpp_lib, args, message):
    res = generate(llama_engine, *args, cpp_lib=cpp_lib)
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output


def test_cpp_library_missing(llama_engine, tmp_path):
    res = generate(llama_engine, cpp_lib=str(tmp_path / "libspecrt.so"))
    assert res.exit_code != 0 and "python -m specrt.tools.libspecrt build" in res.output
    assert "Traceback" not in res.output


def test_python_api_text_and_ids(llama_engine, cpp_lib):
    """CppTextEngine.generate takes text or ids like Runtime.generate; the streamed deltas add up to the text."""
    import specrt
    from specrt.tools.cpp_generate import CppTextEngine

    rt, cpp = specrt.load(llama_engine), CppTextEngine(llama_engine, library=cpp_lib)
    want = rt.generate(PROMPT, max_new_tokens=20, method="suffix", gamma=2)
    deltas = []
    out = cpp.generate(PROMPT, deltas.append, max_new_tokens=20, method="suffix", gamma=2)
    assert (out.token_ids, out.text, "".join(deltas)) == (want.token_ids, want.text, want.text)
    by_ids = cpp.generate(rt.encode(PROMPT), max_new_tokens=20, method="suffix", gamma=2)
    assert by_ids.token_ids == want.token_ids
    with pytest.raises(specrt.PromptTooLongError, match="at most 63"):  # the Python runtime's check and message
        cpp.generate([1] * 64)
    cpp.close()
