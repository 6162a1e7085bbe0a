"""SmolLM2-135M-Instruct, fp32 engine: greedy output equals HF ``generate(do_sample=False)``'s.

48 new tokens after each of a few HumanEval prompts and chat prompts (the user message through the engine
dir's chat template, runtime/serve/chat.py), both sides on the same token ids (the engine's tokenizer).
Decided by the RULE of near_tie.py: every token the engine emits is HF's greedy choice (argmax) given the same
prefix, from one HF forward over prompt + output, except where HF's top-2 logit margin is below 1e-2, where
HF's runner-up is accepted too; at most ``MAX_FLIPS`` such near-tie flips over all prompts.
"""
import pytest

from near_tie import assert_greedy_choices, hf_logits

pytestmark = pytest.mark.real

NEW_TOKENS = 48
MAX_FLIPS = 2  # near-ties where the engine took HF's runner-up (measured: none in 245 positions, 4 below 1e-2)


def test_greedy_equals_hf_generate(smollm2_rt, smollm2_hf, code_prompts, chat_prompts):
    rt = smollm2_rt("fp32")
    flips = 0
    for name, text in {**code_prompts, **chat_prompts}.items():
        ids = rt.encode(text)
        out = rt.generate(ids, max_new_tokens=NEW_TOKENS, method="none").token_ids
        assert len(out) == NEW_TOKENS or out[-1] in rt.eos_ids, (name, out)
        flips += assert_greedy_choices(out, hf_logits(smollm2_hf, ids, out), name)
    assert flips <= MAX_FLIPS
