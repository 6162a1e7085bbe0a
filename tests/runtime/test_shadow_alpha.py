"""Shadow proposals (runtime/core.py ``_shadows``): while the policy keeps a lookup method (n-gram, suffix) at
γ = 0, the core asks its proposer for one token each step and scores it against the emitted token, so α stays
measured without probe steps. Checked: no probe, no extra position, the output unchanged, and the score's
expectation is what verifying the token would accept (p(x), the target's probability of the guess)."""
import numpy as np
import pytest

import specrt
from specrt.runtime.batch_policy import PolicyConfig, SpeculationPolicy
from specrt.runtime.core import CoreConfig
from specrt.runtime.sampling import SamplingParams

from reference import requests_for, run_all


def costly_verification(gamma_max: int = 4) -> SpeculationPolicy:
    """A lookup method's policy (no probes) whose engine costs make every γ > 0 lose: n positions cost n seconds."""
    policy = SpeculationPolicy(PolicyConfig(gamma_max=gamma_max, draft_cost=False, probe=False))
    for n in range(1, 81):
        policy.record_target(1, n, float(n))
    return policy


def test_a_policy_without_probes_never_probes():
    policy = costly_verification()
    assert {(d.gamma, d.reason) for d in (policy.decide([0.9] * 4) for _ in range(200))} == {(0, "policy")}
    probing = SpeculationPolicy(PolicyConfig(gamma_max=4, draft_cost=False, probe_every=8))
    probing.target_cost, probing.realized = policy.target_cost, policy.realized
    assert "probe" in {probing.decide([0.9] * 4).reason for _ in range(20)}


@pytest.fixture(scope="module")
def rt(llama_fused_engine):
    return specrt.load(llama_fused_engine)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_lookup_methods_are_lookup_policies_without_probes(rt, method):
    core = rt.new_core(CoreConfig(max_batch=2, method=method, calibrate=False))
    assert core.proposers[method].shadow and not core.policies[method].config.probe


def shadow_core(rt, method: str, batch: int):
    """A core whose ``method`` never speculates, recording per step the target's logits and the shadows scored."""
    core = rt.new_core(CoreConfig(max_batch=batch, method=method, calibrate=False))
    core.policies[method] = costly_verification(rt.gamma_max)
    seen, forward, score = [], core.target.forward, core._score_shadows

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("record", True):  # a step's pass (prefill passes record=False)
            seen.append([out.logits.copy()])  # a one-call pass returns its bound outputs: kept, they are copied
        return out

    def recording_score(rows, shadows, news):
        seen[-1] += [[None if p is None else int(p.tokens[0]) for p in shadows], [new[0] for new in news]]
        score(rows, shadows, news)

    core.target.forward, core._score_shadows = recording_forward, recording_score
    return core, seen


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_plain_steps_score_the_proposer_s_guess_and_emit_plain_tokens(rt, method):
    core, seen = shadow_core(rt, method, batch=3)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9, 7, 8, 9, 7, 8, 9], [2, 3] * 10]
    done = run_all(core, requests_for((p, SamplingParams(max_new_tokens=24)) for p in prompts))
    assert all(logits.shape[1] == 1 for logits, *_ in seen)  # every step plain: no probe, no padded position
    shadows = [x for step in seen for x in step[1] if x is not None]
    assert shadows  # the lookups found continuations, and they were scored
    hits = sum(x == t for step in seen for x, t in zip(step[1], step[2]) if x is not None)
    assert core.served.alpha != pytest.approx(0.6), f"the estimate did not move off its prior ({hits}/{len(shadows)} hits)"
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"][0] == rt.generate(prompt, max_new_tokens=24, method="none").token_ids
        assert done[f"r{i}"][3]["proposed"] == 0  # shadows are not proposals: the stats count none


def test_a_shadow_hit_happens_with_the_probability_verification_would_accept_it(rt):
    """Sampled at temperature 1: a guess x is emitted with probability p(x) = softmax(logits)[x], the acceptance
    probability of the point-mass proposal x; hits over many steps match the sum of p(x) within 4 sigma."""
    core, seen = shadow_core(rt, "ngram", batch=4)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 2, [7, 8, 9] * 5, [2, 3] * 8, [5, 6, 7, 8] * 4] * 6
    params = [SamplingParams(max_new_tokens=96, temperature=1.0, seed=i) for i in range(len(prompts))]
    run_all(core, requests_for(zip(prompts, params)))
    p_sum = hits = var = 0.0
    for logits, shadows, emitted in seen:
        z = logits[:, 0].astype(np.float64)
        probs = np.exp(z - z.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        for b, (x, t) in enumerate(zip(shadows, emitted)):
            if x is not None:
                p_sum, hits, var = p_sum + probs[b, x], hits + (x == t), var + probs[b, x] * (1 - probs[b, x])
    assert var > 20  # enough guesses with a real chance, for the test to mean something
    assert abs(hits - p_sum) < 4 * np.sqrt(var), (hits, p_sum, var)


def test_a_large_batch_scores_a_few_rows_a_step_in_turns(rt):
    """More rows than SHADOW_ROWS: each plain step scores at most SHADOW_ROWS shadows, and over the steps every row
    gets its turn (its α stays measured); the tokens are still plain greedy's."""
    from specrt.runtime.core import SHADOW_ROWS

    core, seen = shadow_core(rt, "ngram", batch=SHADOW_ROWS + 3)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9] * 3, [2, 3] * 5, [5, 6, 7, 8] * 2, [1, 2] * 4, [4, 4, 5] * 3,
               [9, 8, 7, 9, 8, 7]]
    done = run_all(core, requests_for((p, SamplingParams(max_new_tokens=20)) for p in prompts))
    asked = [sum(x is not None for x in step[1]) for step in seen]
    assert max(asked) <= SHADOW_ROWS and sum(asked) > 0
    rows_scored = {b for step in seen for b, x in enumerate(step[1]) if x is not None}
    assert len(rows_scored) > SHADOW_ROWS  # not always the same rows
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"][0] == rt.generate(prompt, max_new_tokens=20, method="none").token_ids
