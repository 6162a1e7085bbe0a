"""Verification of a proposed chain against the target: modified rejection sampling.

Terms (as in vLLM's rejection sampler):
    accepted token   a proposed token x_i the target keeps. Accepted tokens are a prefix of
                     the proposal: the first rejection ends the round.
    recovered token  the token emitted at the first rejected position i, sampled from the
                     residual norm(max(0, p_i - q_i)); it replaces x_i.
    bonus token      when all k proposals are accepted, one more token sampled from p_k, the
                     target's distribution after the last proposal (the verify pass computed it).
A round therefore always emits n_accepted + 1 tokens.

Exactness: x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); then
P(emit z) = min(q(z), p(z)) + max(0, p(z) - q(z)) = p(z) (see the reference text's proof).
Deterministic proposals (n-gram, top-1 heads) have q = a point mass on x_i: the rule then
accepts with probability p(x_i) and recovers from p with x_i removed, which is the same as
"sample y ~ p; accept if y == x_i, else emit y". Greedy decoding accepts while x_i is the
target's argmax and emits the argmax at the first mismatch; it is kept on its own path.
"""
from __future__ import annotations

import numpy as np

from .sampling import sample


def verify_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """draft_tokens: int [k]; target_logits: [k + 1, V]. Returns (n_accepted, next_token)."""
    best = target_logits.argmax(-1)  # [k + 1] target's argmax at each position
    k = len(draft_tokens)
    mismatch = np.flatnonzero(best[:k] != np.asarray(draft_tokens))  # [m] rejected positions
    n = int(mismatch[0]) if mismatch.size else k
    return n, int(best[n])


def verify_sampled(draft_tokens: np.ndarray, draft_probs: np.ndarray | None, target_probs: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """Modified rejection sampling over a chain.

    draft_tokens: int [k]; draft_probs: q [k, V], or None for deterministic proposals (point
    masses); target_probs: p [k + 1, V] from the same ``probs()``. Returns (n_accepted, next_token).
    """
    x = np.asarray(draft_tokens, dtype=np.int64)  # [k]
    k = len(x)
    rows = np.arange(k)
    p_x = target_probs[rows, x]  # [k] p_i(x_i)
    q_x = draft_probs[rows, x] if draft_probs is not None else np.ones(k)  # [k] q_i(x_i)
    u = rng.random(k)  # [k]
    accept = u * q_x < p_x  # [k] u < p/q without dividing by q
    rejected = np.flatnonzero(~accept)
    if not rejected.size:
        return k, int(sample(target_probs[k][None], rng)[0])  # bonus token
    n = int(rejected[0])
    residual = target_probs[n].copy()  # [V]
    if draft_probs is not None:
        residual = np.maximum(residual - draft_probs[n], 0.0)
    else:
        residual[x[n]] = 0.0
    if residual.sum() <= 1e-12:  # p == q up to rounding: rejection had ~0 probability
        residual = target_probs[n]
    return n, int(sample(residual[None], rng)[0])  # recovered token
