"""Constrained decoding stays exact under speculation: with a grammar (and logit_bias, min_tokens) every method's
output follows the CONSTRAINED target distribution (chi-square against an exact computation of the masked p,
whose allowed sets are written out by hand here, independent of llguidance), greedy output equals plain
constrained decoding token for token, and two deliberately wrong rules fail the same harness.

Cases cover each method once or twice across batch 1 / batched and T=1 / T=0.8 + top-p (the rules are
per row, so a method's batched case and its batch-1 case check the same code under other packing).
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specrt
from reference import fresh_logits, reference_probs, run_all
from specrt.export.hf_checkpoint import load_hf
from specrt.runtime import core as core_module
from specrt.runtime.constraints import ConstraintSpec
from specrt.runtime.core import CoreConfig, SequenceRequest
from specrt.runtime.proposers import draft as draft_module
from specrt.runtime.sampling import SamplingParams, probs, process_logits, sample
from stat_harness import P_MIN, p_values, run_trials

V = 16
TRIALS = 2000  # per exactness case (chi-square at P_MIN 1e-4; the wrong rules below fail it at this size too)
WRONG_TRIALS = {"unmasked_q": 2500, "late_mask": 1000}  # at these sizes: p < 1e-6 and p < 1e-40 (fixed seeds)
TARGET = dict(arch="llama", vocab_size=V, seed=0, scale=10.0, eos_token_id=None)
WEAK_DRAFT = dict(arch="llama", vocab_size=V, seed=1, hidden=16, layers=1, scale=10.0, eos_token_id=None)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
# pairs of one letter from a-d and one from e-h, in either order: ids 1-4 and 5-8 of the character tokenizer
SPEC = ConstraintSpec("regex", "([a-d][e-h]|[e-h][a-d])*")
LOW, HIGH = frozenset(range(1, 5)), frozenset(range(5, 9))


def allowed_after(out) -> frozenset:
    """What SPEC allows after the generated ids ``out`` (by hand: a pair's first letter, then the other half)."""
    if len(out) % 2 == 0:
        return LOW | HIGH
    return HIGH if out[-1] in LOW else LOW


def by_hand(x, out, allowed, bias=(), min_tokens=0, ends=()):
    """The constraint applied by hand to one row of logits x [V] (in place) after output ``out``: logit_bias,
    then the end ids forbidden before ``min_tokens``, then every token ``allowed(out)`` lacks."""
    for tok, b in bias:
        x[tok] += b
    if len(out) < min_tokens:
        x[list(ends)] = -np.inf
    x[[t for t in range(V) if t not in allowed(out)]] = -np.inf


def constrained_joint(model, prompt, sampling: dict, allowed=allowed_after, bias=(), min_tokens=0, ends=()):
    """P[t1, t2, t3] under the target's masked p: logits + bias, ``ends`` -inf before ``min_tokens`` tokens,
    tokens outside ``allowed(out)`` -inf, then the float64 reference filter (temperature, top-k/p)."""
    ref = {"temperature": 1.0, **{k: v for k, v in sampling.items() if k in ("temperature", "top_k", "top_p")}}

    def dist(seqs):
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1].double().numpy()
        for x, seq in zip(logits, seqs):
            by_hand(x, seq[len(prompt):], allowed, bias, min_tokens, ends)
        return reference_probs(logits, **ref)

    p1 = dist([prompt])[0]
    p2 = dist([prompt + [a] for a in range(V)])
    p3 = dist([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def run_batched(rt, prompt, method: str, gamma: int, grammar, trials: int = TRIALS, **sampling) -> np.ndarray:
    """Counts [V, V, V] of (t1, t2, t3) from constrained rows decoded 4 at a time with unconstrained filler rows
    of a longer prompt (other lengths, other proposals, padding) in the same target passes."""
    core = rt.new_core(CoreConfig(max_batch=4, method=method, gamma=gamma, calibrate=False))
    requests = []
    for seed in range(trials):
        requests.append(SequenceRequest(f"t{seed}", prompt, SamplingParams(max_new_tokens=3, seed=seed, **sampling),
                                        grammar=grammar))
        if seed % 3 == 0:
            requests.append(SequenceRequest(f"f{seed}", prompt + prompt[:5],
                                            SamplingParams(max_new_tokens=5, seed=10 ** 6 + seed, **sampling)))
    done = run_all(core, requests)
    counts = np.zeros((V, V, V))
    for seed in range(trials):
        t = done[f"t{seed}"][0]
        assert len(t) == 3, t
        counts[tuple(t)] += 1
    return counts


@pytest.fixture(scope="module")
def weak(build_engine):
    engine = build_engine("exact_weak", TARGET, WEAK_DRAFT, gamma=3, max_len=32)  # shared with test_exactness
    return SimpleNamespace(rt=specrt.load(engine), model=load_hf(engine.parent / "target"))


@pytest.fixture(scope="module")
def medusa(medusa_engine, medusa_trained):
    return SimpleNamespace(rt=specrt.load(medusa_engine), model=load_hf(medusa_trained["target"]))


@pytest.fixture(scope="module")
def eagle(eagle_engine, eagle_trained):
    return SimpleNamespace(rt=specrt.load(eagle_engine), model=load_hf(eagle_trained["target"]))


def repeating_prompt(rt):
    """A prompt that repeats the target's constrained greedy continuation, so n-gram and suffix lookups propose."""
    cont = rt.generate(PROMPT[:5], max_new_tokens=8, method="none", constraint=SPEC).token_ids
    return PROMPT[:5] + cont + PROMPT[:5] + cont[:1]


T1, T08 = dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)
METHODS = [("weak", "draft", 3), ("weak", "ngram", 3), ("weak", "suffix", 3), ("medusa", "medusa", 1),
           ("eagle", "eagle", 1)]  # (engine pair, method, γ)
CASES = [(pair, method, gamma, batched, sampling) for pair, method, gamma in METHODS
         for batched in (False, True) for sampling in (T1, T08)]  # every method: batch 1 and batched, T=1 and T=0.8 + top-p


@pytest.mark.parametrize("pair,method,gamma,batched,sampling", CASES, ids=str)
def test_constrained_sampling_is_exact(request, pair, method, gamma, batched, sampling):
    pair = request.getfixturevalue(pair)
    rt = pair.rt
    prompt = repeating_prompt(rt) if method in ("ngram", "suffix") else PROMPT
    if batched:
        counts = run_batched(rt, prompt, method, gamma, rt.grammar_compiler.compile(SPEC), **sampling)
    else:
        counts, _ = run_trials(rt, prompt, TRIALS, V, method=method, gamma=gamma,
                               constraint=rt.grammar_compiler.compile(SPEC), **sampling)
    pv = p_values(counts, constrained_joint(pair.model, prompt, sampling))
    assert min(pv.values()) > P_MIN, pv


def unmasked_q(logits, row, prefixes=None):
    """WRONG: the draft's q without the grammar's mask (the core then cuts its forbidden tokens)."""
    return process_logits(logits, SimpleNamespace(params=row.params, seq=row.seq, prompt_len=row.prompt_len,
                                                  end_ids=row.end_ids, matcher=None), prefixes)


def late_mask(self, row, p, logits):
    """WRONG (chains): the acceptance test against the unmasked target; the mask applied only to what is sampled
    after it (the recovered token from the masked residual, the bonus token from the masked p)."""
    raw, masked = probs(logits, row.params), probs(process_logits(logits, row, p.prefixes()), row.params)
    x, k = p.tokens, len(p.tokens)
    accept = row.rng.random(k) * p.q[np.arange(k), x] < raw[np.arange(k), x] if k else np.ones(0, bool)
    n = k if accept.all() else int(np.argmin(accept))
    residual = masked[n] if n == k else np.maximum(masked[n] - p.q[n], 0.0)
    return np.arange(n + 1), [*x[:n].tolist(), int(sample(residual[None], row.rng)[0])], None


@pytest.mark.parametrize("wrong", ["unmasked_q", "late_mask"])
def test_harness_fails_a_wrong_rule(weak, monkeypatch, wrong):
    """Both are natural mistakes: a draft sampling from its unmasked q (the core cuts the forbidden tokens it
    proposes, so the kept ones no longer follow the q they are tested with), and a grammar applied only after
    the acceptance test. (Verifying unconstrained and resampling a forbidden result from the masked p would be
    exact: p restricted to the allowed tokens is a multiple of the masked p.)"""
    if wrong == "unmasked_q":
        monkeypatch.setattr(draft_module, "process_logits", unmasked_q)
    else:
        monkeypatch.setattr(core_module.DecodeCore, "_verify", late_mask)
    counts, _ = run_trials(weak.rt, PROMPT, WRONG_TRIALS[wrong], V, method="draft", gamma=3,
                           constraint=weak.rt.grammar_compiler.compile(SPEC), temperature=1.0)
    pv = p_values(counts, constrained_joint(weak.model, PROMPT, {}))
    assert min(pv.values()) < P_MIN, pv


def test_logit_bias_and_min_tokens_sampling_is_exact(weak):
    """A stop id impossible for the first two tokens, then likely (bias +4); another token pushed down."""
    bias, stop = ((9, 4.0), (3, -2.0)), 9
    counts, _ = run_trials(weak.rt, PROMPT, TRIALS, V, method="draft", gamma=2, temperature=1.0,
                           logit_bias=dict(bias), min_tokens=2, stop_token_ids=(stop,))
    joint = constrained_joint(weak.model, PROMPT, {}, allowed=lambda out: range(V), bias=bias, min_tokens=2,
                              ends=(stop,))
    pv = p_values(counts, joint)
    assert min(pv.values()) > P_MIN, pv
    assert counts[stop].sum() == counts[:, stop].sum() == 0 and counts[:, :, stop].sum() > TRIALS / 10


# ---- greedy: every method equals plain constrained decoding token for token -----------------------------
def masked_greedy(graph, prompt, n, allowed=allowed_after, bias=(), min_tokens=0, ends=()):
    """Reference loop: every step from scratch, the constraint applied by hand, argmax."""
    seq = list(prompt)
    for _ in range(n):
        x = fresh_logits(graph, seq, 48).astype(np.float64)
        by_hand(x, seq[len(prompt):], allowed, bias, min_tokens, ends)
        seq.append(int(np.argmax(x)))
    return seq[len(prompt):]


@pytest.mark.parametrize("pair,methods", [("weak", ["none", "draft", "ngram", "suffix"]), ("medusa", ["medusa"]),
                                          ("eagle", ["eagle"])])
def test_constrained_greedy_equals_plain(request, pair, methods):
    rt = request.getfixturevalue(pair).rt
    for prompt in (PROMPT, repeating_prompt(rt)):
        want = masked_greedy(rt.target, prompt, 12)
        assert rt.generate(prompt, max_new_tokens=12, method="none", gamma=0, constraint=SPEC).token_ids == want
        for method in methods:
            out = rt.generate(prompt, max_new_tokens=12, method=method, constraint=SPEC,
                              gamma=None if method == "none" else (1 if method in ("medusa", "eagle") else 3))
            assert out.token_ids == want, method
            assert all(t in allowed_after(want[:i]) for i, t in enumerate(out.token_ids))


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_logit_bias_and_min_tokens_greedy_equals_plain(weak, method):
    bias, stop = ((9, 6.0), (4, -5.0)), 9
    want = masked_greedy(weak.rt.target, PROMPT, 10, allowed=lambda out: range(V), bias=bias, min_tokens=4,
                         ends=(stop,))
    want = want[: want.index(stop) + 1] if stop in want else want
    out = weak.rt.generate(PROMPT, max_new_tokens=10, method=method, gamma=None if method == "none" else 3,
                           logit_bias=dict(bias), min_tokens=4, stop_token_ids=(stop,))
    assert out.token_ids == want and len(want) >= 4
