"""Statistical exactness harness: do emitted tokens follow the target's distribution?

Runs many seeded generations of 3 tokens and compares the empirical distribution of the
2nd token and of the 3rd token (the ones speculation produces: the 1st comes from the
prefill) and of the (1st, 2nd) pair with the exact distributions computed directly from the
target in PyTorch with the float64 reference sampling filter. Chi-square goodness of fit,
bins with expected count < 5 merged; a test fails below P_MIN, so the false-failure rate
of one check is 1e-4 (and the seeds are fixed, so a run is deterministic).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats as sps

from reference import fix_costs, reference_penalize, reference_probs, run_all
from specrt.export.hf_checkpoint import load_hf
from specrt.runtime.core import CoreConfig, DecodeCore, SequenceRequest
from specrt.runtime.sampling import SamplingParams

P_MIN = 1e-4


def exact_joint(model, prompt: list[int], sampling: dict, vocab: int) -> np.ndarray:
    """P[t1, t2, t3] of the target under ``sampling`` (no EOS: the test models have none); penalties in
    ``sampling`` are applied with each sequence's history (``reference_penalize``).

    model: the torch target, or a function seqs [N, S] -> next-token logits [N, V] (e.g. ``graph_logits``:
    the exported graph itself, the reference of a quantized target).
    """
    ref = {"temperature": 1.0, **{k: v for k, v in sampling.items() if k in ("temperature", "top_k", "top_p", "min_p")}}

    def dist(seqs):
        if isinstance(model, torch.nn.Module):
            with torch.no_grad():
                logits = model(torch.tensor(seqs)).logits[:, -1].double().numpy()
        else:
            logits = np.asarray(model(seqs), dtype=np.float64)
        penalties = {k: v for k, v in sampling.items() if k.endswith("_penalty")}
        if penalties:
            logits = np.stack([reference_penalize(x, s, len(prompt), **penalties) for x, s in zip(logits, seqs)])
        return reference_probs(logits, **ref)

    p1 = dist([prompt])[0]  # [V]
    p2 = dist([prompt + [a] for a in range(vocab)])  # [V, V]
    pairs = list(itertools.product(range(vocab), repeat=2))
    p3 = dist([prompt + [a, b] for a, b in pairs]).reshape(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def graph_logits(graph, max_len: int = 64):
    """seqs -> next-token logits [N, V] of a ``Runtime`` graph, each sequence from scratch (plain decoding)."""
    from reference import fresh_logits

    return lambda seqs: np.stack([fresh_logits(graph, list(s), max_len) for s in seqs])


def chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel().astype(float), probs.ravel()
    n = counts.sum()
    order = np.argsort(probs)
    exp, obs = probs[order] * n, counts[order]
    if obs[exp == 0].sum() > 0:
        return 0.0  # a token the target never emits
    # merge the smallest bins until every merged bin expects >= 5
    merged_e, merged_o, acc_e, acc_o = [], [], 0.0, 0.0
    for e, o in zip(exp, obs):
        acc_e += e
        acc_o += o
        if acc_e >= 5:
            merged_e.append(acc_e)
            merged_o.append(acc_o)
            acc_e = acc_o = 0.0
    if acc_e > 0:
        merged_e[-1] += acc_e
        merged_o[-1] += acc_o
    if len(merged_e) < 2:
        return 1.0
    return float(sps.chisquare(merged_o, merged_e).pvalue)


def run_trials(rt, prompt, trials: int, vocab: int, **gen) -> tuple[np.ndarray, dict]:
    """Counts [V, V, V] of emitted (t1, t2, t3) over seeds 0..trials-1, and summed proposed/accepted."""
    counts = np.zeros((vocab, vocab, vocab))
    totals = {"proposed": 0, "accepted": 0}
    for seed in range(trials):
        out = rt.generate(prompt, max_new_tokens=3, seed=seed, **gen)
        t = out.token_ids
        assert len(t) == 3, t
        counts[t[0], t[1], t[2]] += 1
        for k in totals:
            totals[k] += out.stats.get(k, 0)
    return counts, totals


def run_trials_batched(rt, prompt, trials: int, vocab: int, method: str, max_batch: int = 4, gamma=None,
                       curve=None, **sampling) -> tuple[np.ndarray, dict]:
    """``run_trials`` through ONE batched decode core: the trial rows share target passes with filler rows
    of a longer prompt (other lengths, other proposals, padding), every row with its own seed. ``curve``:
    seconds of a pass over n positions the policy prices steps with, instead of timing passes."""
    core = rt.new_core(CoreConfig(max_batch=max_batch, method=method, gamma=gamma, calibrate=curve is None))
    if curve is not None:
        fix_costs(core, curve)  # frozen: the real passes do not blend in
    requests = []
    for seed in range(trials):
        requests.append(SequenceRequest(f"t{seed}", prompt, SamplingParams(max_new_tokens=3, seed=seed, **sampling)))
        if seed % 3 == 0:
            requests.append(SequenceRequest(f"f{seed}", prompt + prompt[:5],
                                            SamplingParams(max_new_tokens=5, seed=10 ** 6 + seed, **sampling)))
    done = run_all(core, requests)
    counts = np.zeros((vocab, vocab, vocab))
    totals = {"proposed": 0, "accepted": 0}
    for seed in range(trials):
        t, _, _, stats = done[f"t{seed}"]
        assert len(t) == 3, t
        counts[t[0], t[1], t[2]] += 1
        for k in totals:
            totals[k] += stats.get(k, 0)
    return counts, totals


def exactness(rt, target_dir, prompt, vocab: int, sampling: dict, trials: int = 2500, **gen) -> tuple[dict, dict]:
    """(p-values, summed proposed/accepted) of ``run_trials`` against the torch target's exact joint
    under ``sampling`` (penalties included); ``gen``: method, gamma, ... for ``rt.generate``."""
    counts, totals = run_trials(rt, prompt, trials, vocab, **gen, **sampling)
    return p_values(counts, exact_joint(load_hf(target_dir), prompt, sampling, vocab)), totals


def p_values(counts: np.ndarray, joint: np.ndarray) -> dict:
    return {"t2": chi2_p(counts.sum((0, 2)), joint.sum((0, 2))),
            "t3": chi2_p(counts.sum((0, 1)), joint.sum((0, 1))),
            "t1t2": chi2_p(counts.sum(2), joint.sum(2))}
