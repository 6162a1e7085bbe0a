"""Lookup proposals cut once their lengths are known (runtime/batch_policy.py ``chain_cut``, ``packed_cuts``,
``DecodeCore._cut``).

A padded pass verifies every row at its longest chain's length, so one row's long match can cost the whole batch
its padding: the core cuts point-mass chains to the length whose pass pays best, and runs a plain step
(reason "cut") where none does. A packed pass (a runner that ``packs``: specrt's attention kernel) charges each
row its own positions: each row's chain is cut on its own. Greedy output stays plain greedy's: a cut chain is a
shorter proposal.
"""
import numpy as np
import pytest

import specrt
from specrt.runtime.batch_policy import REASONS, PolicyConfig, SpeculationPolicy, chain_cut, choose_gamma, packed_cuts
from specrt.runtime.core import CoreConfig, SequenceRequest
from specrt.runtime.proposers import EMPTY, NoProposer, Proposal
from specrt.runtime.sampling import SamplingParams
from reference import FixedCost, fix_costs, requests_for, run_all
from stat_harness import P_MIN, exact_joint, p_values, run_trials_batched
from specrt.export.hf_checkpoint import load_hf


def linear(b: int, n: int) -> float:
    """A compute-bound target: 4 ms a pass + 1 ms a position (b rows, n positions)."""
    return 0.004 + 0.001 * n


def test_one_long_match_does_not_pay_for_the_batch_padding():
    assert chain_cut([8, 0, 0, 0], [0.9] * 4, linear) == 0
    assert chain_cut([8, 8, 8, 8], [0.9] * 4, linear) == 3  # every row gains: a shorter chain pays best
    assert chain_cut([8], [0.9], linear) == 7


def test_a_flat_curve_keeps_every_token_and_the_floor_holds():
    flat = lambda b, n: 0.01  # noqa: E731 - memory-bound: positions are free
    assert chain_cut([8, 0, 3, 0], [0.5] * 4, flat) == 8
    assert chain_cut([8, 0, 0, 0], [0.9] * 4, linear, floor=2) == 2  # a fixed-γ row's chain runs whole
    assert chain_cut([], [], linear) == 0 and chain_cut([0, 0], [0.9, 0.9], linear) == 0
    assert "cut" in REASONS


def test_packed_rows_pay_their_own_positions_best_tokens_first():
    per_position = lambda m: 0.008 + 0.001 * m  # noqa: E731 - 4 rows, m positions more
    assert packed_cuts([8, 0, 0, 0], [0.9] * 4, per_position)[0] == [4, 0, 0, 0]  # padding would have cut it to 0
    cuts, gain = packed_cuts([8, 8, 8, 8], [0.9, 0.9, 0.2, 0.2], per_position)
    assert cuts == [4, 4, 0, 0] and gain > 1.1  # rows whose guesses fail verify none
    assert packed_cuts([3, 8, 0, 0], [0.1, 0.9, 0.6, 0.6], per_position, fixed=[True, False, False, False])[0] == \
        [3, 6, 0, 0]  # a fixed row runs whole; the others priced after it (its positions in the base)
    assert packed_cuts([8, 8, 0, 0], [0.3] * 4, per_position) == ([0, 0, 0, 0], 1.0)  # below min_gain: none
    assert packed_cuts([], [], per_position) == ([], 1.0)


def test_packed_pricing_charges_positions_not_rows():
    # choose_gamma on a packing target: two rows' chains, where a padded pass would speculate on none (the 14
    # others' padding would not pay): a row costs 1 ms, a position beyond the rows' 0.3 ms
    alphas, curve = [0.95] * 2 + [0.1] * 14, lambda b, n: 0.001 * b + 0.0003 * (n - b)  # noqa: E731
    assert choose_gamma(alphas, 4, curve, lambda b: 0.0).gamma == 0
    decision = choose_gamma(alphas, 4, curve, lambda b: 0.0, packed=True)
    assert decision.gamma == 4 and decision.predicted_speedup > 1.1


class Lengths(NoProposer):
    """A lookup proposer that proposes ``lengths[request id]`` copies of token 7 (point masses), of ``kinds[request
    id]`` (None: no kind)."""

    name, shadow, max_nodes = "ngram", False, 4

    def __init__(self, lengths: dict, kinds: dict | None = None):
        self.lengths, self.kinds = lengths, kinds or {}

    def propose(self, rows, ks):
        return [Proposal(np.full(min(k, self.lengths[r.request.request_id]), 7, np.int64),
                         kind=self.kinds.get(r.request.request_id)) if k else EMPTY for r, k in zip(rows, ks)]


@pytest.fixture(scope="module")
def rt(llama_fused_engine):
    return specrt.load(llama_fused_engine)


def first_step(rt, lengths: dict, curve, packs: bool = False, kinds: dict | None = None, measured=()):
    """The first step of a batch of len(lengths) rows under synthetic target costs (``curve``: n positions -> seconds),
    on a target runner that packs rows or pads them; ``kinds``: the rows' proposals' kinds, ``measured``: (kind,
    proposed, accepted) outcomes the policy knows of."""
    core = rt.new_core(CoreConfig(max_batch=len(lengths), method="ngram", calibrate=False),
                       proposer=Lengths(lengths, kinds))
    assert core.target.packs, "the fused test engine runs specrt's attention kernel"
    core.target.packs = core.policy.config.packed = packs
    for i, rid in enumerate(lengths):
        core.add(SequenceRequest(rid, [3, 1, 4, 1, 5][: i + 1], SamplingParams(max_new_tokens=8)))
    fix_costs(core, curve)
    for outcome in measured:
        core.policy.kinds.update(*outcome)
    return core.step()[1]


@pytest.mark.parametrize("packs", [False, True])
def test_the_core_cuts_padding_that_does_not_pay(rt, packs):
    knee = lambda n: 0.010 + 0.00075 * max(0, n - 4)  # noqa: E731 - the policy speculates (γ 1-2 at α 0.6) ...
    report = first_step(rt, {"a": 4, "b": 0, "c": 0, "d": 0}, knee, packs)  # ... and one row's proposal does not pay
    assert report.positions == 4 and report.decision.reason == "cut" and report.proposed == 0
    report = first_step(rt, {"a": 4, "b": 4, "c": 4, "d": 4}, lambda n: 0.01, packs)  # flat: nothing to cut
    assert report.positions == 4 * 5 and report.decision.reason == "policy"


def test_a_packing_target_runs_the_rows_whose_chains_pay_their_own_positions(rt):
    """Two rows' matches: padded, they pay for the two idle rows' padding too and are cut; packed, each row pays
    for its own positions: the two rows verify their first token (γ 1: at α 0.6 a second token no longer pays) in
    one call of 6 positions."""
    knee = lambda n: 0.010 + 0.00075 * max(0, n - 4)  # noqa: E731
    assert first_step(rt, {"a": 4, "b": 4, "c": 0, "d": 0}, knee, packs=False).decision.reason == "cut"
    report = first_step(rt, {"a": 4, "b": 4, "c": 0, "d": 0}, knee, packs=True)
    assert report.decision.reason == "policy" and report.proposed == 2 and report.positions == 4 + 2


def test_proposals_are_priced_by_what_their_kind_realized(rt):
    """The packed pass above, the same two rows' matches, now of two kinds: a kind whose guesses were all kept (a
    4-token match's) and one whose guesses never were (a 1-token match's). The rows' own α (0.6) verified one token
    of each; the kinds' say the first row's chain pays whole and the second's not at all."""
    knee = lambda n: 0.010 + 0.00075 * max(0, n - 4)  # noqa: E731
    measured = [(4, 4, 4)] * 20 + [(1, 4, 0)] * 20
    report = first_step(rt, {"a": 4, "b": 4, "c": 0, "d": 0}, knee, True, kinds={"a": 4, "b": 1}, measured=measured)
    assert report.decision.reason == "policy" and report.proposed == 4 and report.positions == 4 + 4
    report = first_step(rt, {"a": 4, "b": 4, "c": 0, "d": 0}, knee, True, kinds={"a": 1, "b": 1}, measured=measured)
    assert report.decision.reason == "cut" and report.proposed == 0  # asked (the best kind pays), then cut


def test_the_policy_asks_a_lookup_for_proposals_where_its_best_kind_pays():
    """Rows whose α mixes good and bad guesses: priced by α alone no step speculates; once a kind of guess is
    measured to pay, the policy asks for proposals (free for a lookup) and the cut prices each by its kind."""
    policy = SpeculationPolicy(PolicyConfig(gamma_max=4, draft_cost=False, probe=False, packed=True))
    policy.target_cost = FixedCost(lambda n: 0.016 + 0.0004 * max(0, n - 16))  # 16 rows: 1 ms a row, 0.4 a position
    assert policy.decide([0.3] * 16).gamma == 0
    for _ in range(20):
        policy.kinds.update(4, 4, 4)
        policy.kinds.update(1, 4, 0)
    assert policy.decide([0.3] * 16).gamma == 4


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_rows_under_a_steep_curve_equal_plain(rt, method):
    """A steep curve: the policy speculates on α and the core cuts most passes; every row is plain greedy."""
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [2, 3] * 6, [5], list(range(1, 12))]
    core = rt.new_core(CoreConfig(max_batch=4, method=method, calibrate=False))
    fix_costs(core, lambda n: 0.010 + 0.00075 * max(0, n - 4))
    cut, core_cut = [], core._cut

    def counted(rows, proposals, decisions):
        out = core_cut(rows, proposals, decisions)
        cut.append(sum(len(p.tokens) for p in out[0]) < sum(len(p.tokens) for p in proposals))
        return out

    core._cut = counted
    done = run_all(core, requests_for([(p, SamplingParams(max_new_tokens=20)) for p in prompts]))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"][0] == rt.generate(p, max_new_tokens=20, method="none").token_ids
    assert any(cut)  # the cut ran


V = 16
TARGET = dict(arch="llama", vocab_size=V, seed=0, scale=10.0, eos_token_id=None)
WEAK_DRAFT = dict(arch="llama", vocab_size=V, seed=1, hidden=16, layers=1, scale=10.0, eos_token_id=None)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_rows_with_cut_chains_follow_the_target(build_engine, monkeypatch, method):
    """Temperature 1 through one batched core under the policy and a steep curve, so passes cut their
    chains: the emitted tokens follow the target's joint distribution."""
    from specrt.runtime.core import DecodeCore

    cut, core_cut = [], DecodeCore._cut

    def counted(self, rows, proposals, decisions):
        out = core_cut(self, rows, proposals, decisions)
        cut.append(sum(len(p.tokens) for p in out[0]) < sum(len(p.tokens) for p in proposals))
        return out

    monkeypatch.setattr(DecodeCore, "_cut", counted)
    engine = build_engine("exact_weak", TARGET, WEAK_DRAFT, gamma=3, max_len=32)  # (shared with test_exactness)
    rt, base, sampling = specrt.load(engine), [3, 1, 4, 1, 5], dict(temperature=1.0)
    cont = rt.generate(base, max_new_tokens=8, method="none").token_ids
    prompt = base + cont + base + cont[:1]  # lookups find proposals (as in test_exactness)
    counts, totals = run_trials_batched(rt, prompt, 2500, V, method, curve=lambda n: 0.010 + 0.0002 * max(0, n - 4),
                                        **sampling)
    pv = p_values(counts, exact_joint(load_hf(engine.parent / "target"), prompt, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["proposed"] > 0 and sum(cut) > 0, (totals, sum(cut), len(cut))
