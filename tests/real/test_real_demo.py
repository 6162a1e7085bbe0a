"""`specrt demo` on the real model: SmolLM2-135M-Instruct found through its package (here: its wheel in
$SPECRT_MODEL_PACKAGES), exported once into $SPECRT_CACHE (w8a8, keyed by the GGUF file's sha256), a chat
answer, then plain / n-gram / suffix on the chat and a code edit, greedy output identical to plain's."""
import pytest
from click.testing import CliRunner

from specrt.tools.cli import cli

pytestmark = pytest.mark.real


def test_demo_answers_a_chat_and_compares_the_methods(model_wheels):
    r = CliRunner().invoke(cli, ["demo", "--max-new-tokens", "24"])
    assert r.exit_code == 0, r.output
    assert "SmolLM2-135M-Instruct (w8a8), chat" in r.output and "assistant:" in r.output
    assert "toy pair" not in r.output
    for prompt in ("chat     ", "code edit"):
        for method in ("none", "ngram", "suffix"):
            assert f"│ {prompt} │ {method}" in r.output
    assert "every method's tokens are identical to plain decoding's" in r.output
