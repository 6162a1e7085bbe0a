"""Penalties (exact with speculation), logprobs of emitted tokens, and n sequences sharing one prefill."""
import numpy as np
import pytest

import specrt
from reference import fresh_logits, reference_penalize
from specrt.export.hf_checkpoint import load_hf
from specrt.runtime.core import CoreConfig, DecodeCore, SequenceRequest
from specrt.runtime.proposers import Proposal
from specrt.runtime.sampling import SamplingError, SamplingParams, log_probs, penalize, probs
from specrt.trees import compile_tree
from stat_harness import P_MIN, exact_joint, exactness, p_values, run_trials

V = 16
TARGET = dict(arch="llama", vocab_size=V, seed=0, scale=10.0, eos_token_id=None)
WEAK_DRAFT = dict(arch="llama", vocab_size=V, seed=1, hidden=16, layers=1, scale=10.0, eos_token_id=None)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PENALTIES = [dict(presence_penalty=0.8), dict(frequency_penalty=0.6), dict(repetition_penalty=1.5),
             dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=0.7)]


@pytest.fixture(scope="module")
def engine(build_engine):
    return build_engine("exact_weak", TARGET, WEAK_DRAFT, gamma=3, max_len=32)  # (shared with test_exactness)


# ---- penalize ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pen", PENALTIES, ids=str)
def test_penalize_matches_reference_with_prefixes(pen):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(4, 50)).astype(np.float32)
    seq, prompt_len = [1, 2, 2, 7, 3, 3, 3, 9], 4  # output: 3, 3, 3, 9
    prefixes = [[], [5], [5, 3], [5, 3, 11]]
    got = penalize(logits, SamplingParams(**pen), seq, prompt_len, prefixes)
    want = np.stack([reference_penalize(x, seq + p, prompt_len, **pen) for x, p in zip(logits, prefixes)])
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_no_penalty_is_the_logits_themselves():
    logits = np.zeros((2, 5), np.float32)
    assert penalize(logits, SamplingParams(temperature=1.0), [1, 2], 1) is logits


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(logprobs=21), dict(logprobs=-1), dict(logprobs=True)], ids=str)
def test_bad_values_refused(bad):
    with pytest.raises(SamplingError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_prefixes_of_a_chain_and_a_tree():
    chain = Proposal(np.array([7, 8, 9]))
    assert [p.tolist() for p in chain.prefixes()] == [[], [7], [7, 8], [7, 8, 9]]
    tree = compile_tree([(0,), (1,), (0, 0)])  # nodes: root, a, b, a->c
    got = Proposal(np.array([5, 6, 7]), tree=tree).prefixes()
    paths = {tuple(p.tolist()) for p in got}
    assert paths == {(), (5,), (6,), (5, 7)}


# ---- penalties through the core --------------------------------------------------------------------
def penalized_greedy(graph, prompt, n, pen):
    """Reference loop: plain greedy decoding with the penalties, every step from scratch."""
    seq = list(prompt)
    for _ in range(n):
        x = reference_penalize(fresh_logits(graph, seq, 32), seq, len(prompt), **pen)
        seq.append(int(np.argmax(x)))
    return seq[len(prompt):]


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
@pytest.mark.parametrize("pen", PENALTIES[:3] + [dict(repetition_penalty=3.0, frequency_penalty=1.0)], ids=str)
def test_penalized_greedy_equals_reference_loop(engine, method, pen):
    rt = specrt.load(engine)
    prompt = PROMPT + PROMPT[:4]  # repeats, so n-gram lookups propose
    want = penalized_greedy(rt.target, prompt, 12, pen)
    got = rt.generate(prompt, max_new_tokens=12, method=method, gamma=None if method == "none" else 3, **pen)
    assert got.token_ids == want


@pytest.mark.parametrize("pen", [dict(presence_penalty=1.0, frequency_penalty=0.5),
                                 dict(repetition_penalty=1.8, temperature=0.8, top_p=0.9)], ids=str)
def test_penalized_draft_sampling_is_exact(engine, pen):
    pv, totals = exactness(specrt.load(engine), engine.parent / "target", PROMPT, V, {"temperature": 1.0, **pen},
                           method="draft", gamma=2)
    assert min(pv.values()) > P_MIN, pv
    assert totals["accepted"] > 0


def test_a_wrong_penalty_rule_fails_the_harness(engine):
    """The harness sees the difference: decoding without the penalties does not fit their distribution."""
    rt = specrt.load(engine)
    counts, _ = run_trials(rt, PROMPT, 2500, V, method="draft", gamma=2, temperature=1.0)
    pv = p_values(counts, exact_joint(load_hf(engine.parent / "target"), PROMPT,
                                      dict(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5), V))
    assert min(pv.values()) < P_MIN, pv


# ---- logprobs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=6, seed=3),
                                      dict(temperature=1.0, frequency_penalty=0.7, seed=4)], ids=str)
def test_logprobs_are_the_targets_at_each_emitted_token(engine, method, sampling):
    rt = specrt.load(engine)
    prompt = PROMPT + PROMPT[:4]
    out = rt.generate(prompt, max_new_tokens=10, method=method, gamma=None if method == "none" else 3, logprobs=3,
                      **sampling)
    assert len(out.logprobs) == len(out.token_ids) == 10
    params = SamplingParams(**{k: v for k, v in sampling.items() if k != "seed"})
    seq = list(prompt)
    for tok, (lp, top) in zip(out.token_ids, out.logprobs):
        x = penalize(fresh_logits(rt.target, seq, 32)[None], params, seq, len(prompt))
        want = log_probs(x, params)[0]
        assert lp == pytest.approx(want[tok], abs=1e-4)
        assert len(top) == 3 and [i for i, _ in top] == list(np.argsort(-want, kind="stable")[:3])
        if not params.greedy:
            assert np.exp(lp) == pytest.approx(probs(x, params)[0, tok], abs=1e-4)
        seq.append(tok)
    if method != "none":
        assert out.stats["proposed"] > 0


def test_logprobs_off_by_default(engine):
    out = specrt.load(engine).generate(PROMPT, max_new_tokens=3)
    assert out.logprobs is None


# ---- n sequences of one prompt ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_group_shares_one_prefill_and_each_equals_batch1(engine, method):
    rt = specrt.load(engine)
    params = [SamplingParams(temperature=1.0, top_k=8, seed=10 + i, max_new_tokens=8 + i) for i in range(3)]
    core = rt.new_core(CoreConfig(max_batch=4, method=method, gamma=None if method == "none" else 2,
                                     calibrate=False))
    calls = core.target.calls
    first = core.add_group([SequenceRequest(f"c{i}", PROMPT, p) for i, p in enumerate(params)])
    assert core.target.calls - calls == core.target.prefill_calls(len(PROMPT))  # one prefill for three
    assert len(first) == 3 and len(core.rows) == 3
    tokens = {u.request_id: [e.token_id for e in u.events] for u in first}
    while core.rows:
        for u in core.step()[0]:
            tokens[u.request_id] += [e.token_id for e in u.events if e.token_id is not None]
    for i, p in enumerate(params):
        ref = rt.generate(PROMPT, max_new_tokens=p.max_new_tokens, temperature=1.0, top_k=8, seed=p.seed,
                          method=method, gamma=None if method == "none" else 2)
        assert tokens[f"c{i}"] == ref.token_ids, i
    assert len({tuple(t) for t in tokens.values()}) == 3  # independent samples


@pytest.mark.parametrize("heads", ["medusa_engine", "eagle_engine"])
def test_tree_methods_penalized_greedy_and_logprobs(request, heads):
    """A tree node's row is penalised with its own path: greedy == the reference loop, logprobs the target's."""
    engine_dir = request.getfixturevalue(heads)
    rt = specrt.load(engine_dir)
    method, max_len = heads.split("_")[0], rt.manifest.max_len
    prompt, pen = [5, 3, 9, 1, 5, 3, 9], dict(presence_penalty=0.3, repetition_penalty=1.2)
    out = rt.generate(prompt, max_new_tokens=10, method=method, gamma=1, logprobs=2, **pen)
    seq, params = list(prompt), SamplingParams(**pen)
    for tok, (lp, top) in zip(out.token_ids, out.logprobs):
        x = penalize(fresh_logits(rt.target, seq, max_len)[None], params, seq, len(prompt))
        assert tok == int(np.argmax(x)) and lp == pytest.approx(log_probs(x, params)[0, tok], abs=1e-4)
        seq.append(tok)
    assert out.stats["proposed"] > 0
