"""Speculative decoding behaviour: greedy equality, stops, KV rollback, adaptive γ, metrics."""
import numpy as np
import pytest

import specrt
from specrt.runtime.batch_policy import PolicyConfig, SpeculationPolicy
from specrt.runtime.core import CoreConfig, DecodeCore, SequenceRequest
from specrt.runtime.gamma import AlphaEstimate, expected_tokens, predicted_speedup
from specrt.runtime.proposers import NoProposer, Proposal
from specrt.runtime.sampling import SamplingError, SamplingParams
from reference import fresh_logits

PROMPTS = [[5], [3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(1, 30))]


@pytest.fixture(scope="module")
def rt(llama_engine):
    return specrt.load(llama_engine)


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("gamma", [1, 2, 4, None])
@pytest.mark.parametrize("max_new", [1, 7, 23])
def test_greedy_equals_plain(rt, method, gamma, max_new):
    for prompt in PROMPTS:
        plain = rt.generate(prompt, max_new_tokens=max_new, method="none")
        spec = rt.generate(prompt, max_new_tokens=max_new, method=method, gamma=gamma)
        assert spec.token_ids == plain.token_ids, (prompt, method, gamma)
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason


def test_eos_mid_draft_stops_exactly(rt):
    """Make a frequent greedy token an extra stop id: it ends generation inside accepted runs."""
    for prompt in PROMPTS:
        plain = rt.generate(prompt, max_new_tokens=30, method="none")
        stop_id = max(set(plain.token_ids[1:]), key=plain.token_ids[1:].count)
        cut = plain.token_ids.index(stop_id) + 1
        for method in ("draft", "ngram"):
            out = rt.generate(prompt, max_new_tokens=30, method=method, gamma=4, stop_token_ids=[stop_id])
            assert out.token_ids == plain.token_ids[:cut] and out.finish_reason == "stop"


def test_stop_string_inside_accepted_run(rt):
    plain = rt.generate(PROMPTS[1], max_new_tokens=30, method="none")
    stop = plain.text[5:7]
    for method in ("none", "draft", "ngram"):
        out = rt.generate(PROMPTS[1], max_new_tokens=30, method=method, gamma=4, stop=[stop])
        assert out.text == plain.text[: plain.text.index(stop)] and out.finish_reason == "stop"
        assert stop not in out.text


def synthetic_costs(policy: SpeculationPolicy, c: float, ratio) -> SpeculationPolicy:
    """Set the policy's measured costs: T(γ+1)/T(1) = ratio(γ), one draft step = c target steps."""
    policy.target_cost.clear()
    policy.proposer_cost.clear()
    for g in range(policy.config.gamma_max + 1):
        policy.record_target(1, g + 1, ratio(g))
    policy.record_draft(1, 1, c)
    return policy


def batch1_core(rt, proposer=None, gamma=None, c=0.05, ratio=lambda g: 1.0 + 0.1 * g) -> DecodeCore:
    """A batch-1 decode core with synthetic costs (the timings of this machine play no part)."""
    core = rt.new_core(CoreConfig(max_batch=1, method="draft", gamma=gamma, calibrate=False, probe_every=8),
                      proposer=proposer)
    synthetic_costs(core.policy, c, ratio)
    core.policy.config.guard = False  # the prediction alone: no realized step times
    return core


def run_one(core: DecodeCore, prompt, params: SamplingParams, steps: int | None = None):
    """Add one sequence and step it to its end (or ``steps`` times); returns (tokens, stats or None)."""
    update, tokens = core.add(SequenceRequest("r", prompt, params)), []
    for n in range(10 ** 6 if steps is None else steps + 1):
        tokens += [e.token_id for e in update.events if e.token_id is not None]
        if update.finish_reason or n == steps:
            return tokens, update.stats
        update = core.step()[0][0]


def test_kv_rollback_matches_fresh_recompute(rt):
    """After rounds with rejections, the target's next logits equal a recomputation from scratch."""
    core = batch1_core(rt, gamma=4)
    run_one(core, PROMPTS[1], SamplingParams(temperature=1.0, seed=0, max_new_tokens=100), steps=6)
    row = core.rows[0]
    assert row.counts.proposed > row.counts.accepted  # there were rejections
    assert core.target.lengths[row.slot] == len(row.seq) - 1
    logits = core.target.forward([row.slot], [[row.seq[-1]]]).logits[0, -1]
    np.testing.assert_allclose(logits, fresh_logits(rt.target, row.seq, rt.manifest.max_len), atol=1e-4)
    core.remove("r")


class WrongProposer(NoProposer):
    """Always proposes a token the greedy target never picks next (target argmax + 1)."""

    name = "wrong"

    def __init__(self, target):
        self.target = target
        self.max_nodes = 4

    def propose(self, rows, ks):
        out = []
        for row, k in zip(rows, ks):
            best = int(np.argmax(fresh_logits(self.target, row.seq)))
            out.append(Proposal(np.full(k, (best + 1) % 32, dtype=np.int64)))
        return out


def test_controller_turns_speculation_off_when_it_never_pays(rt):
    core = batch1_core(rt, WrongProposer(rt.target))
    tokens, stats = run_one(core, PROMPTS[1], SamplingParams(max_new_tokens=41))
    history = stats["gamma_history"]
    assert stats["accepted"] == 0
    assert history[-1] == 0 or history[-1] == 1  # off, or a probe
    off = history[10:].count(0)
    assert off >= 0.8 * len(history[10:])  # mostly plain decoding ...
    assert stats["target_passes"] <= len(tokens) + 1  # ... so no more target passes than plain decoding


def test_policy_not_asked_on_steps_that_cannot_draft(rt):
    """A step where no row can draft (here each request's last token) is plain and leaves the policy
    alone, so its probes land on steps that can use them: 3-token requests take an asked step then
    a "room" step; with the policy off, asked steps still probe now and then (every 8th, the interval
    doubling while speculation stays off)."""
    core = batch1_core(rt, WrongProposer(rt.target))
    reasons, proposed = [], []
    for i in range(40):
        update = core.add(SequenceRequest(f"r{i}", PROMPTS[1], SamplingParams(max_new_tokens=3)))
        steps = []
        while not update.finish_reason:
            updates, report = core.step()
            steps.append(report.decision.reason)
            update = updates[0]
        reasons.append(steps)
        proposed.append(update.stats["proposed"])
    assert all(steps[-1] == "room" and "room" not in steps[:-1] for steps in reasons)
    later = [r[0] for r in reasons[16:]]  # the policy has turned speculation off by now
    assert later.count("policy") >= 16 and later.count("probe") >= 1
    assert sum(p > 0 for p in proposed[16:]) == later.count("probe")


def choices(policy: SpeculationPolicy, alpha: AlphaEstimate, accepted, rounds: int = 20) -> list[int]:
    """γ chosen over ``rounds`` rounds when accepted(γ) proposals are accepted each round."""
    history = []
    for _ in range(rounds):
        g = policy.decide([alpha.alpha]).gamma
        alpha.update(g, accepted(g))
        history.append(g)
    return history


def test_controller_grows_gamma_when_everything_is_accepted():
    policy = synthetic_costs(SpeculationPolicy(PolicyConfig(gamma_max=6)), 0.05, lambda g: 1 + 0.02 * g)
    assert choices(policy, AlphaEstimate(), lambda g: g)[-1] == 6


def test_controller_with_synthetic_costs():
    never = synthetic_costs(SpeculationPolicy(PolicyConfig(gamma_max=6, probe_every=8)), 0.3, lambda g: 1.0)
    history = []
    alpha = AlphaEstimate()
    for _ in range(20):
        g = never.decide([alpha.alpha]).gamma
        alpha.update(g or 1, 0)
        history.append(g)
    assert history[-5:].count(0) >= 4
    # α = 0.8, c = 0.05, free verification: the formula's best γ is large
    policy = synthetic_costs(SpeculationPolicy(PolicyConfig(gamma_max=8)), 0.05, lambda g: 1.0)
    assert policy.decide([AlphaEstimate(prior_alpha=0.8).alpha]).gamma >= 6


class OracleProposer(WrongProposer):
    """Proposes the greedy target's own continuation: always accepted."""

    def propose(self, rows, ks):
        out = []
        for row, k in zip(rows, ks):
            seq = list(row.seq)
            for _ in range(k):
                seq.append(int(np.argmax(fresh_logits(self.target, seq))))
            out.append(Proposal(np.array(seq[len(row.seq):], dtype=np.int64)))
        return out


def test_controller_reaches_gamma_max_when_draft_always_agrees(rt):
    core = batch1_core(rt, OracleProposer(rt.target), ratio=lambda g: 1 + 0.05 * g)
    run_one(core, PROMPTS[1], SamplingParams(max_new_tokens=1000), steps=10)
    counts = core.rows[0].counts
    assert counts.accepted == counts.proposed > 0
    assert counts.gamma_history[-1] == 4
    core.remove("r")


def test_formula_matches_reference_text():
    assert round(predicted_speedup(0.8, 4, 0.05), 2) == 2.80
    assert round(predicted_speedup(0.8, 4, 0.15), 2) == 2.10
    assert round(predicted_speedup(0.5, 4, 0.15), 2) == 1.21
    assert round(predicted_speedup(0.4, 4, 0.30), 2) == 0.75
    assert round(expected_tokens(0.5, 3), 2) == 1.88 and round(expected_tokens(0.5, 10), 2) == 2.00
    assert round(expected_tokens(0.7, 4), 2) == 2.77 and round(expected_tokens(0.9, 4), 2) == 4.10
    assert expected_tokens(1.0, 4) == 5


def test_stats_fields_and_no_division_by_zero(rt):
    out = rt.generate([5], max_new_tokens=1, method="draft")  # one token: zero rounds, zero proposals
    s = out.stats
    for key in ("proposed", "accepted", "acceptance_rate", "tokens_per_pass", "target_passes", "draft_passes",
                "c", "predicted_speedup", "gamma_history", "new_tokens", "seconds", "tokens_per_second"):
        assert key in s, key
    assert s["proposed"] == 0 and s["acceptance_rate"] == 0.0
    s = rt.generate(PROMPTS[1], max_new_tokens=20, method="draft", gamma=3).stats
    assert s["proposed"] > 0 and 0 <= s["acceptance_rate"] <= 1
    assert s["tokens_per_pass"] == pytest.approx((s["accepted"] + s["rounds"]) / s["rounds"])
    # α counts only tested proposals: at least the share accepted, and equal when no round rejected
    assert s["acceptance_rate"] <= s["alpha"] <= 1
    assert s["draft_passes"] >= s["rounds"]


def test_invalid_generate_arguments(rt):
    with pytest.raises(SamplingError, match="unknown method"):
        rt.generate([1], method="medusa-ish")
    with pytest.raises(SamplingError, match="gamma"):
        rt.generate([1], method="draft", gamma=99)
    with pytest.raises(SamplingError, match="temperature"):
        rt.generate([1], temperature=-1)
    with pytest.raises(SamplingError, match="top_p"):
        rt.generate([1], top_p=0)
    with pytest.raises(ValueError, match="max_len"):
        rt.generate(list(range(1, 31)) * 3)
    with pytest.raises(ValueError, match="vocabulary"):
        rt.generate([1, 999])
    with pytest.raises(ValueError, match="empty"):
        rt.generate("")


@pytest.mark.parametrize("method,gamma", [("none", None), ("draft", 3), ("ngram", 2)])
def test_seeded_generation_reproducible(rt, method, gamma):
    """A seed reproduces the output for a fixed method and γ (adaptive γ follows measured timings)."""
    kw = dict(max_new_tokens=15, temperature=1.0, method=method, gamma=gamma)
    a = rt.generate(PROMPTS[1], seed=3, **kw)
    b = rt.generate(PROMPTS[1], seed=3, **kw)
    others = [rt.generate(PROMPTS[1], seed=s, **kw).token_ids for s in (4, 5, 6)]
    assert a.token_ids == b.token_ids
    assert any(o != a.token_ids for o in others)


def test_stream_yields_same_as_generate(rt):
    gen = rt.stream(PROMPTS[1], max_new_tokens=12, method="draft")
    events = list(gen)
    out = rt.generate(PROMPTS[1], max_new_tokens=12, method="draft")
    assert [e.token_id for e in events if e.token_id is not None] == out.token_ids
    assert "".join(e.text for e in events) == out.text == gen.text


def test_an_interrupted_stream_fails_clearly_and_the_next_one_is_exact(rt):
    """A Runtime runs one sequence at a time: a second request ends the first stream with a clear error,
    never with tokens computed on the other request's cache."""
    first = iter(rt.stream(PROMPTS[1], max_new_tokens=20, method="draft", gamma=2))
    next(first)
    plain = rt.generate(PROMPTS[2], max_new_tokens=10, method="none")
    with pytest.raises(RuntimeError, match="interrupted"):
        list(first)
    assert rt.generate(PROMPTS[2], max_new_tokens=10, method="draft").token_ids == plain.token_ids


def test_acceptance_per_kind_of_guess():
    """gamma.KindAlphas: one estimate per kind, the row's α where a kind is None or not measured yet."""
    import doctest

    from specrt.runtime import gamma

    assert doctest.testmod(gamma).failed == 0
    kinds = gamma.KindAlphas()
    assert not kinds and kinds.best() == 0.0
    kinds.update(None, 3, 3)
    kinds.update(2, 0, 0)  # nothing proposed: no evidence
    assert not kinds
