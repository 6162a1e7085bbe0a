"""SmolLM2-135M-Instruct: every speculative method's greedy output equals plain greedy decoding's.

Methods ngram and suffix against none (plain), 48 tokens after HumanEval and chat prompts, on the fp32 and
the int4 engine. Decided by the RULE of near_tie.py with plain decoding as the reference: every token a
method emits is the argmax of plain decoding's logits given the same prefix (the prompt prefilled, then
one-token decode steps along the method's output), plain's runner-up accepted only where plain's top-2 margin
is below 1e-2 (a verify pass of γ+1 tokens may round differently from a one-token step).

Method draft is not run here: no smaller model shares SmolLM2's tokenizer in the packages, so the draft
would be SmolLM2 itself: an extra export and ~γ+1 full-model passes per round, the slowest test for the least
coverage (an identical draft is accepted everywhere, rejections only at near-ties). Draft verification with
agreeing and disagreeing drafts is covered on tiny models (tests/runtime/, tests/runtime/cpp/).
"""
import pytest

from near_tie import assert_greedy_choices, plain_logits

pytestmark = pytest.mark.real

NEW_TOKENS = 48
MAX_FLIPS = 2


QUANTIZED_SHAPES_DIFFER = pytest.mark.xfail(strict=True, reason=(
    "int8/int4 engines: a verify pass (Q = k + 1) and a one-token decode step of the same graph differ by up "
    "to 0.7-0.8 in SmolLM2's logits (fp32: 4e-5): MatMulNBits at accuracy level 4 quantizes activations to "
    "int8, which amplifies attention's last-bit differences between the two shapes, so n-gram/suffix greedy "
    "output departs from plain greedy at margins of 0.06-0.1 (docs/real-models.md; accuracy level 1 closes "
    "the gap at 12x the decode cost). Strict: passing means the gap was closed."))


@pytest.mark.parametrize("kind", ["fp32", pytest.param("int4", marks=QUANTIZED_SHAPES_DIFFER)])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_method_greedy_equals_plain(smollm2_rt, code_prompts, chat_prompts, method, kind):
    rt = smollm2_rt(kind)
    flips = proposed = accepted = 0
    for name, text in {**code_prompts, **chat_prompts}.items():
        ids = rt.encode(text)
        out = rt.generate(ids, max_new_tokens=NEW_TOKENS, method=method)
        flips += assert_greedy_choices(out.token_ids, plain_logits(rt, ids, out.token_ids), f"{method} {name}")
        proposed, accepted = proposed + out.stats["proposed"], accepted + out.stats["accepted"]
    assert flips <= MAX_FLIPS
    assert 0 < accepted < proposed  # speculation ran, and proposals were both accepted and rejected
