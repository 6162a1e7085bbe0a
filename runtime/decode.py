"""The decode loops: plain autoregressive, and speculative (draft -> verify -> accept).

Both are generators that yield the list of tokens each target pass produced; the caller
(``Runtime.stream``) applies stop rules and simply stops iterating. Cache invariant of the
speculative loop: the target's cache holds every token of ``seq`` except the last one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .gamma import GammaController, expected_tokens
from .model import CachedModel
from .rejection import verify_greedy, verify_sampled
from .sampling import SamplingParams, next_token, probs


@dataclass
class DecodeStats:
    target_passes: int = 0  # target graph calls (prefill chunks included)
    proposed: int = 0  # tokens proposed
    accepted: int = 0  # proposed tokens the target kept
    rounds: int = 0  # speculative rounds (verify passes after the first token)
    rejections: int = 0  # rounds that ended in a rejection (n < k)
    proposal_lengths: list = field(default_factory=list)  # k proposed per round

    def record(self, k: int, n: int) -> None:
        self.rounds += 1
        self.proposed += k
        self.accepted += n
        self.rejections += int(n < k)
        self.proposal_lengths.append(k)

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability α̂ = accepted / (accepted + rejections): the MLE under the
        formula's i.i.d. assumption. accepted / proposed understates it: proposals after the first
        rejection of a round are never tested."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else 0.0

    def predicted_speedup(self, alpha: float, cost) -> float:
        """Σ E[tokens](α, k_r) / Σ (k_r c + T(k_r+1)/T(1)) over the rounds run: the formula, averaged."""
        if not self.proposal_lengths:
            return 1.0
        num = sum(expected_tokens(alpha, k) for k in self.proposal_lengths)
        den = sum(k * c + ratio for k in self.proposal_lengths for c, ratio in [cost(k)])
        return num / den


def decode_plain(target: CachedModel, prompt: list[int], params: SamplingParams, rng, stats: DecodeStats):
    logits = target.prefill(prompt)  # [V]
    stats.target_passes += target.prefill_calls(len(prompt))
    while True:
        tok = next_token(logits, params, rng)
        yield [tok]
        logits = target.forward([tok])[-1]
        stats.target_passes += 1


def speculative_decode(target: CachedModel, proposer, controller: GammaController, prompt: list[int],
                       params: SamplingParams, rng, stats: DecodeStats, budget, cost):
    """budget() -> tokens that may still be emitted; cost(γ) -> measured (c, T(γ+1)/T(1))."""
    seq = list(prompt)
    logits = target.prefill(seq)  # [V]
    stats.target_passes += target.prefill_calls(len(seq))
    seq.append(next_token(logits, params, rng))
    yield seq[-1:]
    while True:
        gamma = max(0, min(controller.choose(cost), budget() - 1))
        proposal = proposer.propose(seq, gamma, params, rng)  # tokens [k], q [k, V] | None
        logits = target.forward([seq[-1], *proposal.tokens.tolist()])  # [k+1, V]: ONE pass
        stats.target_passes += 1
        if params.greedy:
            n, nxt = verify_greedy(proposal.tokens, logits)
        else:
            n, nxt = verify_sampled(proposal.tokens, proposal.q, probs(logits, params), rng)
        target.rollback(len(seq) + n)  # keep seq[-1] and the n accepted tokens
        controller.update(len(proposal.tokens), n)
        stats.record(len(proposal.tokens), n)
        new = [*proposal.tokens[:n].tolist(), nxt]
        seq += new
        yield new


def calibrate(target: CachedModel, draft: CachedModel | None, gamma_max: int, token: int, reps: int = 3) -> None:
    """Time target calls of 1..gamma_max+1 tokens and draft steps on the current cache, then roll back.

    The first call of each shape is a warm-up and is not recorded.
    """
    for model, shapes in ((target, range(1, gamma_max + 2)), (draft, [1])):
        if model is None:
            continue
        start = model.length
        shapes = [q for q in shapes if q <= model.cache.room]
        for rep in range(reps + 1):
            if rep == 1:
                model.clear_latency()
            for q in shapes:
                model.forward(np.full(q, token))
                model.rollback(start)
