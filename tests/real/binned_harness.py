"""The chi-square exactness harness (tests/stat_harness.py) on a real vocabulary: paths binned, the tail in one bin.

stat_harness enumerates every (t1, t2, t3) path of 3 generated tokens, V^2 target passes: fine for V = 16,
impossible for SmolLM2's 49,152. Here the paths are grouped into bins whose probabilities are still EXACT:

    level 1: the K most probable first tokens a; every other first token is bin (OTHER,)
    level 2: after each kept a, the K most probable b; every other b is bin (a, OTHER)
    level 3: after each kept (a, b), the K most probable c; every other c is bin (a, b, OTHER)

P(OTHER,) = 1 - sum of the kept p1(a); P(a, OTHER) = p1(a) (1 - sum of the kept p2(b | a)); and so on: every
bin's probability is a sum of path probabilities computed without dropping any path, from 1 + K + K^2
target passes. An EOS ends its path (bin (a,) or (a, b) with a or b the EOS), as it ends the generation.
The emitted paths are counted per bin and compared by ``stat_harness.chi2_p`` (bins expecting < 5 merged),
twice: the (t1, t2) bins and the (t1, t2, t3) bins; a check fails below ``P_MIN`` (1e-4), the harness's
false-failure rate.

The reference distribution is the engine's own graph run from scratch on each path (plain decoding,
``reference.fresh_runner``), processed by ``reference.reference_probs`` (float64): what the speculative
output must follow exactly. (The graph's equality to the PyTorch model is the greedy tests' and the
export's job.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reference import fresh_runner, reference_probs
from specrt.runtime.core import CoreConfig, SequenceRequest
from specrt.runtime.sampling import SamplingParams
from stat_harness import P_MIN, chi2_p

OTHER = -1
KEEP = 4  # K: kept tokens per node (1 + K + K^2 target passes for the reference)
__all__ = ["P_MIN", "PathBins", "path_bins", "sample_paths", "binned_p_values"]


@dataclass
class PathBins:
    """The bins of 3-token paths after one prompt and their exact probabilities."""

    probs: dict = field(default_factory=dict)  # bin (a,), (a, b), (a, b, c) with OTHER for a tail -> probability
    kept: dict = field(default_factory=dict)  # path prefix () / (a,) / (a, b) -> the kept next tokens

    def bin_of(self, path) -> tuple:
        prefix = ()
        for token in path:
            if token not in self.kept.get(prefix, ()):
                return (*prefix, OTHER)
            prefix = (*prefix, token)
            if prefix not in self.kept and len(prefix) < 3:  # an EOS: the path ends here
                return prefix
        return prefix


def path_bins(rt, prompt: list[int], sampling: dict, keep: int = KEEP) -> PathBins:
    """The bins of ``rt``'s 3-token paths after ``prompt`` under ``sampling`` (temperature, top_k, top_p, min_p)."""
    runner = fresh_runner(rt.target, rt.manifest.max_len)
    ref = {"temperature": 1.0, **sampling}

    def dist(seq):
        runner.release(0)
        return reference_probs(runner.prefill(0, seq)[0][None], **ref)[0]

    bins = PathBins()

    def expand(prefix: tuple, mass: float):
        p = dist(prompt + list(prefix))
        top = [int(t) for t in np.argsort(-p, kind="stable")[:keep] if p[t] > 0]
        bins.kept[prefix] = top
        bins.probs[(*prefix, OTHER)] = mass * max(0.0, 1.0 - float(p[top].sum()))
        for t in top:
            path = (*prefix, t)
            if len(path) == 3 or t in rt.eos_ids:
                bins.probs[path] = mass * float(p[t])
            else:
                expand(path, mass * float(p[t]))

    expand((), 1.0)
    assert abs(sum(bins.probs.values()) - 1) < 1e-6, sum(bins.probs.values())
    return bins


def sample_paths(rt, prompt: list[int], trials: int, method: str, gamma: int, group: int = 8,
                 **sampling) -> tuple[list[list[int]], dict]:
    """The 3-token outputs of seeds 0..trials-1 (fewer tokens where an EOS ended one), and the summed
    proposed / accepted counts. One decode core of ``group`` slots; each group of seeds shares ONE prefill
    of the prompt (``DecodeCore.add_group``, the n choices of a request), every sequence its own generator."""
    core = rt.new_core(CoreConfig(max_batch=group, method=method, gamma=gamma, calibrate=False))
    outputs, totals = {}, {"proposed": 0, "accepted": 0}

    def take(update):
        if update.finish_reason:
            outputs[int(update.request_id)] = update.token_ids
            for k in totals:
                totals[k] += update.stats.get(k, 0)

    for start in range(0, trials, group):
        seeds = range(start, min(start + group, trials))
        for update in core.add_group([SequenceRequest(str(s), prompt, SamplingParams(max_new_tokens=3, seed=s,
                                                                                     **sampling)) for s in seeds]):
            take(update)
        while core.rows:
            for update in core.step()[0]:
                take(update)
    return [outputs[s] for s in range(trials)], totals


def binned_p_values(bins: PathBins, paths: list[list[int]]) -> dict:
    """Chi-square p-values of the emitted ``paths`` against ``bins``: over the (t1, t2) bins and the full bins."""
    names = sorted(bins.probs)
    index = {b: i for i, b in enumerate(names)}
    counts = np.zeros(len(names))
    for path in paths:
        counts[index[bins.bin_of(path)]] += 1
    probs = np.array([bins.probs[b] for b in names])
    pair = [b[:2] for b in names]  # (a, OTHER) / (a, b) / (OTHER,) / (EOS,): the (t1, t2) bin of each
    pairs = sorted(set(pair))
    fold = np.zeros((len(pairs), len(names)))
    for i, b in enumerate(pair):
        fold[pairs.index(b), i] = 1
    return {"t1t2": chi2_p(fold @ counts, fold @ probs), "t1t2t3": chi2_p(counts, probs)}
