"""Proposers: cheap guesses of the next tokens, for the target to verify in one pass."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .model import CachedModel
from .ngram import NGramIndex
from .sampling import SamplingParams, probs, sample


@dataclass
class Proposal:
    tokens: np.ndarray  # int64 [k] proposed tokens, k <= gamma (may be 0)
    q: np.ndarray | None  # float64 [k, V] proposer distributions; None = deterministic (point masses)


class DraftModelProposer:
    """A smaller model run autoregressively with its own KV cache.

    Its cache holds a prefix of the sequence; ``propose`` first feeds every token it has not
    seen (after a round these are the accepted tail, the recovered or bonus token, and the last
    proposal when all were accepted: the draft never ran on those), as one chain call.
    q comes from the same ``probs()`` the target's p does.
    """

    name = "draft"

    def __init__(self, model: CachedModel):
        self.model = model
        self.seen: list[int] = []  # tokens in the draft's cache, in order
        self.step_seconds = None  # EWMA seconds of one draft step (feed 1 token + sample)
        self.passes = 0

    def reset(self, prompt) -> None:
        self.model.reset()
        self.seen = []

    def _sync(self, seq: list[int]) -> list[int]:
        """Roll the cache back to the longest common prefix with ``seq``; returns unseen tokens."""
        n = 0
        limit = min(len(self.seen), len(seq))
        while n < limit and self.seen[n] == seq[n]:
            n += 1
        if n == len(seq):  # the draft must run on at least the last token to get its logits
            n -= 1
        self.model.rollback(n)
        del self.seen[n:]
        return seq[n:]

    def _feed(self, ids: list[int]) -> np.ndarray:
        logits = self.model.forward(ids)[-1]
        self.seen.extend(ids)
        self.passes += 1
        return logits

    def propose(self, seq: list[int], gamma: int, params: SamplingParams, rng: np.random.Generator) -> Proposal:
        if gamma == 0:
            return Proposal(np.zeros(0, np.int64), None)
        t0 = time.perf_counter()
        logits = self._feed(self._sync(seq))  # [V]
        tokens, qs = [], []
        for i in range(gamma):
            if params.greedy:
                tok = int(np.argmax(logits))
            else:
                q = probs(logits[None], params)[0]  # [V]
                tok = int(sample(q[None], rng)[0])
                qs.append(q)
            tokens.append(tok)
            if i < gamma - 1:
                logits = self._feed([tok])
        dt = (time.perf_counter() - t0) / gamma
        self.step_seconds = dt if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * dt
        return Proposal(np.array(tokens, np.int64), np.stack(qs) if qs else None)


class NGramProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the current suffix.

    Deterministic (q is a point mass); zero model cost.
    """

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.index = NGramIndex(max_n, min_n)
        self.step_seconds = 0.0
        self.passes = 0

    def reset(self, prompt) -> None:
        self.index = NGramIndex(self.max_n, self.min_n)

    def propose(self, seq: list[int], gamma: int, params: SamplingParams, rng: np.random.Generator) -> Proposal:
        self.index.extend(seq[len(self.index.tokens):])
        tokens = self.index.propose(gamma) if gamma > 0 else []
        return Proposal(np.array(tokens, np.int64), None)
