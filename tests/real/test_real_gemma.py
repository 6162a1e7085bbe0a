"""Gemma 3 270M exported at --max-len 2048 (past its 512-token sliding window): greedy equals HF past token 512.

Five of every six Gemma 3 layers attend to the last 512 positions only, the others to everything. The
prompt is Gemma's BOS and whole HumanEval prompts, concatenated until it holds more than ``PAST`` + 48
tokens, so every one of the 48 generated tokens sits well past position 512, where a layer that ignored its
window (or applied one it does not have) would change the logits. Plain and n-gram decoding (whose verify
passes attend across the window's edge too), each decided by the RULE of near_tie.py: every token the
engine emits is HF's greedy choice given the same prefix (one HF forward over prompt + output), HF's
runner-up accepted only where HF's top-2 margin is below 1e-2.
"""
import pytest

from near_tie import assert_greedy_choices, hf_logits

pytestmark = pytest.mark.real

PAST = 512  # the sliding window
NEW_TOKENS = 48
MAX_FLIPS = 2


@pytest.fixture(scope="module")
def gemma3_rt(gemma3_engine):
    import specrt

    return specrt.load(gemma3_engine)


@pytest.fixture(scope="module")
def long_prompt(gemma3_rt, gemma3_hf, human_eval) -> list[int]:
    """BOS + HumanEval prompts, whole ones, until longer than PAST + NEW_TOKENS tokens."""
    ids = [gemma3_hf.config.bos_token_id]
    for problem in human_eval.values():
        ids += gemma3_rt.encode(problem["prompt"])
        if len(ids) > PAST + NEW_TOKENS:
            return ids
    raise AssertionError("HumanEval is shorter than the window")


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_greedy_equals_hf_past_the_window(gemma3_rt, gemma3_hf, long_prompt, method):
    assert gemma3_rt.manifest.max_len == 2048
    out = gemma3_rt.generate(long_prompt, max_new_tokens=NEW_TOKENS, method=method).token_ids
    assert len(out) == NEW_TOKENS or out[-1] in gemma3_rt.eos_ids, out
    assert assert_greedy_choices(out, hf_logits(gemma3_hf, long_prompt, out), f"gemma3 {method}") <= MAX_FLIPS
