"""The batch-aware policy's guard (runtime/batch_policy.py): predictions checked against realized whole-step
tokens/s, on synthetic step timings (no clock is read)."""
import pytest

from specrt.runtime.batch_policy import (PolicyConfig, RealizedRates, SpeculationPolicy, batch_bucket, chain_cut,
                                        choose_gamma)
from specrt.runtime.core import CoreConfig, SequenceRequest
from specrt.runtime.sampling import SamplingParams

import specrt
from reference import requests_for, run_all


def free_verification(probe_every: int = 8, guard: bool = True, seconds: float = 0.005) -> SpeculationPolicy:
    """A chain policy whose engine curve makes speculation look free (every call ``seconds``): the prediction
    always says γ = 4. At batch 4 a plain step's engine call alone gives 4 / seconds tokens/s (800)."""
    policy = SpeculationPolicy(PolicyConfig(gamma_max=4, probe_every=probe_every, draft_cost=False, guard=guard))
    for n in range(1, 81):
        policy.record_target(1, n, seconds)
    return policy


def run(policy: SpeculationPolicy, steps: int, batch: int, spec_rate: float, plain_rate: float) -> list:
    """``steps`` decisions at ``batch`` rows, each step recorded as realizing ``spec_rate`` / ``plain_rate``
    tokens/s (whole step) by its arm; returns the decisions."""
    out = []
    for _ in range(steps):
        d = policy.decide([0.9] * batch)
        rate = spec_rate if d.gamma > 0 else plain_rate
        tokens = 3 * batch if d.gamma > 0 else batch
        engine = policy.target_cost.seconds(batch, batch * (d.gamma + 1))  # the rest of the step is host time
        policy.record_step(batch, d.gamma > 0, tokens, tokens / rate, engine)
        out.append(d)
    return out


def test_a_method_that_realizes_less_than_plain_is_turned_off():
    policy = free_verification(probe_every=8)
    decisions = run(policy, 60, batch=4, spec_rate=200.0, plain_rate=400.0)
    assert [d.gamma > 0 for d in decisions[:3]] == [True] * 3  # first as predicted, measured ...
    assert [d.reason for d in decisions[3:6]] == ["guard"] * 3  # ... then plain steps to compare
    later = decisions[20:]
    speculative = sum(d.gamma > 0 for d in later)
    assert speculative <= 3 * len(later) / (8 + 3) + 3  # only the re-measurements: 3 steps per 8 guarded
    assert all(d.predicted_speedup < 1 for d in later if d.reason == "guard" and d.predicted_speedup != 1.0)


def test_it_comes_back_when_speculation_pays_again():
    policy = free_verification(probe_every=8)
    off = run(policy, 40, batch=4, spec_rate=200.0, plain_rate=400.0)
    assert [d.reason for d in off[-12:]].count("guard") >= 8  # off, but for its re-measurements
    back = run(policy, 60, batch=4, spec_rate=900.0, plain_rate=400.0)
    first_on = next(i for i, d in enumerate(back) if d.gamma > 0)
    assert first_on <= 4 * 8 + 1  # within one re-measurement interval (doubled while it kept losing)
    later = back[first_on + 3:]
    plain = sum(d.gamma == 0 for d in later)
    assert plain <= 3 * len(later) / (8 + 3) + 3  # speculating, with a plain re-measurement per 8 steps
    assert all(d.reason in ("policy", "guard") for d in later)


def test_speculation_that_keeps_losing_is_retried_less_often():
    policy = free_verification(probe_every=8)
    decisions = run(policy, 200, batch=4, spec_rate=200.0, plain_rate=400.0)
    retries = [i for i in range(1, 200) if decisions[i].gamma > 0 and decisions[i - 1].gamma == 0]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps[0] < gaps[-1] <= 4 * 8 + 3 + 1  # 8, 16, 32, 32, ... guarded steps between retries of 3 steps


def test_a_narrow_win_keeps_speculating_and_keeps_plain_measured():
    policy = free_verification(probe_every=8)
    decisions = run(policy, 50, batch=4, spec_rate=450.0, plain_rate=400.0)  # below the 800 of an engine call
    gammas = [d.gamma for d in decisions]
    assert gammas.count(4) >= 50 - 3 - 3 * 5  # plain only to measure it: 3 steps at start, 3 per 8
    assert 0 in gammas[20:]  # the plain arm is re-measured while speculation wins


def test_no_plain_step_is_spent_where_speculation_beats_an_engine_call():
    policy = free_verification(probe_every=8)
    decisions = run(policy, 50, batch=4, spec_rate=900.0, plain_rate=400.0)  # above 4 / T(4) = 800
    assert all(d.gamma == 4 and d.reason == "policy" for d in decisions)


def test_evidence_is_per_batch_size():
    policy = free_verification(probe_every=8)
    off = run(policy, 40, batch=4, spec_rate=200.0, plain_rate=400.0)
    assert [d.reason for d in off[-12:]].count("guard") >= 8
    assert [policy.decide([0.9] * 8).gamma for _ in range(3)] == [4] * 3  # nothing measured at batch 8: as predicted


def test_evidence_carries_over_between_batch_sizes_of_a_bucket():
    """A server's batch shrinks one row at a time as requests finish: what speculation realized at 12 rows
    decides at 11 and 9 too (bucket 9-16), rated at the asking size from tokens per row and engine time relative
    to a plain step's."""
    policy = free_verification(probe_every=8)
    run(policy, 7, batch=12, spec_rate=200.0, plain_rate=400.0)  # measured at 12 (3 + 3 steps): it loses
    assert [policy.decide([0.9] * b).reason for b in (11, 9, 16)] == ["guard"] * 3
    assert policy.decide([0.9] * 8).gamma == 4  # bucket 5-8: nothing measured, as predicted
    r = RealizedRates(min_steps=1)
    r.record(12, False, tokens=12, seconds=0.012, engine=0.012, reference=0.012)  # 1 token per row, no host time
    T = lambda n: 0.001 * n  # noqa: E731
    assert r.rate(9, False, T) == pytest.approx(9 / T(9)) and r.rate(12, False, T) == pytest.approx(12 / T(12))


def test_without_the_guard_the_prediction_alone_decides():
    policy = free_verification(guard=False)
    decisions = run(policy, 30, batch=4, spec_rate=200.0, plain_rate=400.0)
    assert all(d.gamma == 4 and d.reason == "policy" for d in decisions)


def test_realized_rates_take_the_engine_cost_from_the_curve_and_clip_spikes():
    r = RealizedRates(decay=0.5, spike=2.0, min_steps=2)
    r.record(4, True, 8, seconds=0.03, engine=0.02, reference=0.01)  # host: half the engine time; 2x a plain call
    assert r.rate(4, True, lambda n: 0.01) is None  # fewer than min_steps steps
    r.record(4, True, 8, seconds=0.02, engine=0.02, reference=0.01)  # no host time
    host = (0.5 * 0.01 + 0.0) / (0.5 * 0.02 + 0.02)
    assert r.rate(4, True, lambda n: 0.01) == pytest.approx(8 / (0.02 * (1 + host)))
    # the same steps under twice the load (a plain step now 0.02): half the rate; arms compare at one load
    assert r.rate(4, True, lambda n: 0.02) == pytest.approx(r.rate(4, True, lambda n: 0.01) / 2)
    # only T(B) is read: the curve's points at the sizes speculative steps reach (lagging ones) do not matter
    assert r.rate(4, True, lambda n: 0.01 if n == 4 else 1.0) == pytest.approx(r.rate(4, True, lambda n: 0.01))
    r.record(4, True, 8, seconds=10.0, engine=0.02, reference=0.01)  # a preempted step's host time: at most 2x
    assert r.arms[batch_bucket(4), True][2] == pytest.approx(0.5 * 0.5 * 0.01 + 2 * (0.5 * 0.01) / (0.5 + 1))
    assert r.rate(4, False, lambda n: 0.01) is None and r.rate(8, True, lambda n: 0.01) is None


def test_speculation_needs_min_gain_over_plain():
    """A gain under MIN_GAIN (here 1.05x measured, or predicted) runs plain: it is within the noise and does not
    pay for what the prediction leaves out (a batch whose rows advanced unevenly ends on steps of fewer rows)."""
    policy = free_verification(probe_every=8)
    decisions = run(policy, 60, batch=4, spec_rate=420.0, plain_rate=400.0)
    later = decisions[20:]
    assert sum(d.gamma > 0 for d in later) <= 3 * len(later) / (8 + 3) + 3  # only the re-measurements
    T = lambda b, n: 0.004 + 0.001 * n  # noqa: E731
    assert choose_gamma([0.58] * 4, 4, T, lambda b: 0.0, min_gain=1.0).gamma == 1  # 1.05x predicted ...
    assert choose_gamma([0.58] * 4, 4, T, lambda b: 0.0).gamma == 0  # ... is not enough
    assert chain_cut([1, 1, 1, 1], [0.58] * 4, T, min_gain=1.0) == 1 and chain_cut([1, 1, 1, 1], [0.58] * 4, T) == 0


@pytest.fixture(scope="module")
def rt(llama_fused_engine):
    return specrt.load(llama_fused_engine)


def test_the_core_feeds_each_step_to_its_policy_and_stays_exact(rt):
    """Every step reaches the method's policy (keyed by its rows' count, tokens as emitted); greedy rows still
    equal plain decoding whatever the guard decides."""
    core = rt.new_core(CoreConfig(max_batch=3, method="ngram"))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9, 7, 8, 9, 7, 8, 9], [2, 3] * 10]
    params = [SamplingParams(max_new_tokens=20) for _ in prompts]
    done = run_all(core, requests_for(zip(prompts, params)))
    arms = core.policies["ngram"].realized.arms
    assert arms and {b for b, _ in arms} <= {batch_bucket(b) for b in (1, 2, 3)}
    assert sum(arm[3] for arm in arms.values()) > 0
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"][0] == rt.generate(prompt, max_new_tokens=20, method="none").token_ids
