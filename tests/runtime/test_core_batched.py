"""Batched generation through the decode core (runtime/core.py) and the batch-aware policy (runtime/batch_policy.py)."""
import numpy as np
import pytest

import specrt
from specrt.runtime.core import CoreConfig, DecodeCore, SequenceRequest
from specrt.runtime.batch_policy import PolicyConfig, SpeculationPolicy, choose_gamma, speculation_max_batch
from specrt.runtime.pass_cost import LatencyCurve, PassCost, monotone
from specrt.runtime.sampling import SamplingError, SamplingParams
from reference import fresh_logits, requests_for, run_all

# mixed lengths: 1 token, shorter and longer than the prefill chunk (16), one that hits the cache cap
PROMPTS = [[5], [3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(1, 21)),
           [2, 3] * 20, [9, 9, 8, 7, 6, 5, 4], [11, 12, 13, 11, 12, 13, 11]]
MAX_NEW = [12, 30, 7, 25, 40, 1, 18]


@pytest.fixture(scope="module", params=["traced", "fused"])
def rt(request, llama_engine, llama_fused_engine):
    """The same tests on a traced graph (HostRunner) and a fused one (InPlaceRunner)."""
    return specrt.load(llama_engine if request.param == "traced" else llama_fused_engine)


@pytest.mark.parametrize("method,gamma", [("none", None), ("draft", 4), ("draft", None), ("ngram", 3),
                                          ("ngram", None)])
def test_greedy_rows_equal_runtime(rt, method, gamma):
    gen = rt.new_core(CoreConfig(max_batch=3, method=method, gamma=gamma))
    stops = [(), (), ("e",), (), (), (), ()]  # a stop string ...
    stop_ids = [(), (), (), (), (), (), (4,)]  # ... and a stop id on some rows
    params = [SamplingParams(max_new_tokens=m, stop=s, stop_token_ids=i) for m, s, i in zip(MAX_NEW, stops, stop_ids)]
    done = run_all(gen, requests_for(zip(PROMPTS, params)))
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        ref = rt.generate(prompt, max_new_tokens=p.max_new_tokens, method="none", stop=p.stop,
                          stop_token_ids=p.stop_token_ids)
        ids, text, finish, stats = done[f"r{i}"]
        assert ids == ref.token_ids, (i, method, gamma)
        assert text == ref.text and finish == ref.finish_reason
        assert stats["new_tokens"] == len(ids) and stats["method"] == method
    assert not gen.rows and gen.free_slots == 3 and not gen.target.lengths.any()


@pytest.mark.parametrize("method,gamma", [("none", None), ("draft", 3), ("ngram", 2)])
def test_seeded_sampled_rows_equal_runtime_at_fixed_gamma(rt, method, gamma):
    """Per row: the same random stream, draft q and rejection rule as batch 1, whatever the batch."""
    gen = rt.new_core(CoreConfig(max_batch=4, method=method, gamma=gamma))
    params = [SamplingParams(temperature=1.0, top_k=8 if i % 2 else 0, seed=100 + i, max_new_tokens=m)
              for i, m in enumerate(MAX_NEW)]
    done = run_all(gen, requests_for(zip(PROMPTS, params)))
    rejected = 0
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        ref = rt.generate(prompt, max_new_tokens=p.max_new_tokens, temperature=1.0, top_k=p.top_k, seed=p.seed,
                          method=method, gamma=gamma)
        assert done[f"r{i}"][0] == ref.token_ids, (i, method)
        rejected += done[f"r{i}"][3]["proposed"] - done[f"r{i}"][3]["accepted"]
    if method != "none":
        assert rejected > 0  # the rejection path ran


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # rotary and absolute (learned) positions
def test_each_row_of_a_mixed_batch_sees_exactly_its_own_sequence(rt, build_engine, arch):
    """After sampled rounds with rejections, one batched pass over rows of different lengths gives each row
    the logits of its own sequence computed from scratch: masks, positions and per-row rollback are right."""
    if arch == "gpt2":
        rt = specrt.load(build_engine("batch-gpt2", dict(arch="gpt2", seed=0, scale=30.0),
                                      dict(arch="gpt2", seed=1, hidden=16, layers=1, scale=30.0)))
    gen = rt.new_core(CoreConfig(max_batch=4, method="draft", gamma=4))
    for i, prompt in enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[4]]):
        gen.add(SequenceRequest(f"r{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_new_tokens=40)))
    for _ in range(4):
        gen.step()
    rows = gen.rows
    assert sum(r.counts.proposed - r.counts.accepted for r in rows) > 0  # rollbacks happened
    assert len({len(r.seq) for r in rows}) >= 2  # the rows have different lengths
    slots = [r.slot for r in rows]
    assert [gen.target.lengths[s] for s in slots] == [len(r.seq) - 1 for r in rows]
    logits = gen.target.forward(slots, [[r.seq[-1]] for r in rows], record=False).logits[:, 0]  # [B, V]
    for row, row_logits in zip(rows, logits):
        np.testing.assert_allclose(row_logits, fresh_logits(rt.target, row.seq, rt.manifest.max_len), atol=1e-4)


def test_remove_frees_slot_and_others_continue(rt):
    gen = rt.new_core(CoreConfig(max_batch=3, method="draft", gamma=2))
    out = {f"r{i}": [] for i in range(4)}

    def take(update):
        out[update.request_id] += [e.token_id for e in update.events if e.token_id is not None]

    for i in range(3):
        take(gen.add(SequenceRequest(f"r{i}", PROMPTS[i + 1], SamplingParams(max_new_tokens=20))))
    for _ in range(2):
        for u in gen.step()[0]:
            take(u)
    assert gen.remove("r1") and not gen.remove("r1")
    assert gen.free_slots == 1 and [r.slot for r in gen.rows] == [0, 1]
    assert gen.target.lengths[2] == 0 and gen.proposer.runner.lengths[2] == 0
    take(gen.add(SequenceRequest("r3", PROMPTS[0], SamplingParams(max_new_tokens=20))))
    while gen.rows:
        for u in gen.step()[0]:
            take(u)
    for rid, prompt in (("r0", PROMPTS[1]), ("r2", PROMPTS[3]), ("r3", PROMPTS[0])):
        assert out[rid] == rt.generate(prompt, max_new_tokens=20, method="none").token_ids, rid


def test_new_sequences_start_from_the_served_acceptance(rt):
    """A new sequence's α prior is the recent α over all sequences, not a fixed guess."""
    gen = rt.new_core(CoreConfig(max_batch=2, method="draft", gamma=4))
    gen.add(SequenceRequest("a", PROMPTS[1], SamplingParams(max_new_tokens=40)))
    for _ in range(5):
        gen.step()
    served = gen.served.alpha
    assert gen.rows[0].counts.proposed > gen.rows[0].counts.accepted and served != pytest.approx(0.6)
    gen.add(SequenceRequest("b", PROMPTS[2], SamplingParams(max_new_tokens=40)))
    assert gen.rows[1].alpha.alpha == pytest.approx(served)


def test_generator_rejects_bad_config(rt):
    with pytest.raises(SamplingError, match="unknown method"):
        rt.new_core(CoreConfig(method="medusa-ish"))
    with pytest.raises(SamplingError, match="needs an engine dir exported with --medusa"):
        rt.new_core(CoreConfig(method="medusa"))
    with pytest.raises(SamplingError, match="gamma"):
        rt.new_core(CoreConfig(method="draft", gamma=99))
    with pytest.raises(ValueError, match="max_batch"):
        rt.new_core(CoreConfig(max_batch=0))


def test_calibration_measures_the_batch_curve(rt):
    gen = rt.new_core(CoreConfig(max_batch=3, method="draft"))
    g = rt.gamma_max
    cost = gen.policy.target_cost  # plain passes of 1, 2, 3 rows; 1..g positions more at 1 row, g more a row at 2, 3
    assert set(cost.rows.points) == {1, 2, 3}
    assert {k: set(c.points) for k, c in cost.extra.items()} == {0: set(range(1, g + 1)), 1: {2 * g}, 2: {3 * g}}
    assert set(gen.policy.proposer_cost.rows.points) == {1, 2, 3} and not gen.policy.proposer_cost.extra
    assert not gen.target.lengths.any() and not gen.proposer.runner.lengths.any()
    gen.add(SequenceRequest("a", PROMPTS[1], SamplingParams(max_new_tokens=10)))
    _, report = gen.step()
    assert report.decision.reason in ("policy", "probe") and 0 <= report.gamma <= g


# ---- the policy, on synthetic measurements ------------------------------------------------------
def ridge(b: int, n: int) -> float:
    """A synthetic target: memory-bound (flat, 1 s) up to 32 positions, compute-bound (linear) beyond (b rows)."""
    return max(1.0, n / 32)


def no_draft(b: int) -> float:
    return 0.0


def test_policy_speculates_at_batch_1_and_stops_past_the_ridge():
    gammas = [choose_gamma([0.8] * b, 4, ridge, no_draft).gamma for b in (1, 4, 8, 16, 26, 27, 32, 64)]
    assert gammas[0] == 4  # all verification is free at batch 1
    assert gammas == sorted(gammas, reverse=True)  # never more speculation at a larger batch
    assert gammas[3] == 1  # B=16: γ=1 -> 28.8 tok/s beats γ=0 -> 16 and γ=4 -> 21.5
    assert gammas[4] == 1 and gammas[5] == 0  # B=26: 28.8 >= MIN_GAIN (1.1) x 26; B=27: 28.8 < 1.1 x 27
    assert speculation_max_batch(0.8, 64, 4, ridge, no_draft) == 26
    assert [choose_gamma([0.8] * b, 4, ridge, no_draft, min_gain=1.0).gamma for b in (28, 29)] == [1, 0]  # any gain
    assert speculation_max_batch(0.8, 64, 4, ridge, no_draft, min_gain=1.0) == 28


def test_policy_counts_draft_cost_and_acceptance():
    assert choose_gamma([0.1], 4, ridge, lambda b: 0.3).gamma == 0  # poor drafts at c = 0.3: a loss
    assert choose_gamma([0.8], 4, ridge, lambda b: 0.05).gamma == 4
    mixed = choose_gamma([0.95, 0.0, 0.0, 0.0], 4, ridge, no_draft)  # one good row pays for the batch
    assert mixed.gamma > 0 and mixed.predicted_speedup > 1
    d = choose_gamma([0.0] * 4, 4, ridge, no_draft)  # nothing accepted: speculation is pure overhead
    assert d.gamma == 0 and d.predicted_speedup == 1.0


def test_policy_cap_from_manifest_and_fixed_gamma():
    d = choose_gamma([0.9] * 3, 4, ridge, no_draft, speculation_max_batch=2)
    assert (d.gamma, d.reason) == (0, "cap")
    assert choose_gamma([0.9] * 2, 4, ridge, no_draft, speculation_max_batch=2).gamma == 4
    fixed = SpeculationPolicy(PolicyConfig(gamma_max=4, fixed_gamma=2))
    assert fixed.decide([0.0] * 8).gamma == 2 and fixed.last.reason == "fixed"


def test_policy_probes_while_off():
    policy = SpeculationPolicy(PolicyConfig(gamma_max=4, probe_every=3, draft_cost=False))
    assert policy.decide([0.5]).gamma == 0  # nothing measured yet: plain steps measure T first
    for n in (1, 2, 4, 5, 8, 10):
        policy.record_target(1, n, 1.0 * n)  # verification costs its full size: never worth it
    decisions = [policy.decide([0.5]) for _ in range(12)]
    assert [i for i, d in enumerate(decisions) if d.gamma] == [2, 8]  # the 3rd step at γ = 0, then the 6th (doubling)
    assert decisions[2].reason == "probe"
    assert policy.max_speculative_batch(0.5, 8) == 0


def test_latency_curve_interpolates_and_extrapolates():
    c = LatencyCurve(decay=0.5)
    with pytest.raises(ValueError):
        c.seconds(1)
    c.record(1, 1.0)
    assert c.seconds(10) == 1.0  # one point: flat
    c.record(4, 2.0)
    assert c.seconds(2) == pytest.approx(1 + 1 / 3) and c.seconds(0) == 1.0
    assert c.seconds(7) == pytest.approx(3.0)  # the last segment's slope
    c.record(4, 4.0)  # EWMA: 0.5 * 2 + 0.5 * 4
    assert c.points[4] == 3.0
    c.record(4, 100.0)  # a preempted call counts as at most 2x the estimate
    assert c.points[4] == 4.5


def test_latency_curve_caps_a_new_size_between_measured_ones():
    c = LatencyCurve()
    c.record(1, 1.0)
    c.record(9, 3.0)
    c.record(5, 10.0)  # a first call, say: at most 2x the interpolated 2.0
    assert c.points[5] == 4.0
    c.record(20, 30.0)  # beyond the largest measured size nothing bounds it (a ridge may start there)
    assert c.points[20] == 30.0


def test_runner_curve_leaves_out_each_shapes_first_call(rt):
    """A shape's first call also pays ONNX Runtime's setup of it; priced in, it made plain steps look dear."""
    runner, cost = rt.runner("target", 2)
    for _ in range(3):
        runner.forward([0, 1], [[5], [6]])
    runner.forward([0], [[5, 6, 7]])
    assert set(cost.rows.points) == {2} and not cost.extra  # (2, 1) twice after its first call; (1, 3) once: its first


def test_pass_cost_prices_rows_and_positions_apart():
    """A verify pass of one row over 4 positions is not a plain step of 4 rows: the positions beyond the rows' one
    are priced per bucket of batch sizes, by what they added to a plain pass of those rows."""
    c = PassCost()
    c.record(1, 1, 0.006)
    c.record(4, 4, 0.011)
    c.record(1, 4, 0.008)  # one row, 3 positions more: 2 ms
    assert c.seconds(4) == 0.011 and c.seconds(1, 4) == pytest.approx(0.008)
    assert c.seconds(4, 7) == pytest.approx(0.013)  # bucket 3-4 measured none: the nearest bucket's 3 positions
    c.record(16, 16, 0.030)
    c.record(16, 24, 0.0355)  # a packed pass: 8 positions beyond 16 rows' add 5.5 ms
    assert c.seconds(16, 20) == pytest.approx(0.030 + 0.00275)  # linear from 0 below the smallest measured count
    assert c.seconds(4, 7) == pytest.approx(0.011 + 0.0055 * 3 / 8)  # buckets 1 and 9-16 as near: the larger's
    assert c.known(16, 24) and not c.known(16, 20) and c.known(4, 4) and not c.known(2, 2)
    c.clear()
    assert not c


def test_latency_curve_is_non_decreasing_despite_noise():
    c = LatencyCurve()
    for n, t in ((1, 1.0), (2, 3.0), (4, 1.0), (8, 4.0)):  # n=2 was measured during a burst of other load
        c.record(n, t)
    assert [c.seconds(n) for n in (1, 2, 4, 8)] == [1.0, 2.0, 2.0, 4.0]  # pooled, not maxed
    assert monotone([3, 1, 2, 5, 4]) == [2, 2, 2, 4.5, 4.5]


def test_policy_turns_a_tree_off_when_the_batch_fills_the_hardware():
    """A tree method's one speculative choice is its whole tree: on while Σ E(α, depth) / (T(B·N) + D(B))
    beats B / T(B). Here T is flat up to 16 positions (the ridge) and linear beyond."""
    t = lambda b, n: 1.0 if n <= 16 else n / 16  # noqa: E731
    d = lambda b: 0.1  # noqa: E731  the proposer's work per step
    tree = (12, 3)  # nodes, depth: E(0.7, 3) = 2.53 tokens per row and pass
    assert choose_gamma([0.7], 4, t, d, tree=tree).gamma == 1  # 2.53 / 1.1 > 1 / 1
    assert choose_gamma([0.7] * 4, 4, t, d, tree=tree).gamma == 0  # 10.1 / 3.1 < 4 / 1
    assert choose_gamma([0.05], 4, t, d, tree=tree).gamma == 0  # a tree that is hardly ever accepted
    assert speculation_max_batch(0.7, 16, 4, t, d, tree=tree) == 2  # B=3: 7.6 / 2.35 = 1.08x plain, under MIN_GAIN
    assert speculation_max_batch(0.7, 16, 4, t, d, tree=tree, min_gain=1.0) == 3
