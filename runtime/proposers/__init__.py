"""Proposers: cheap guesses of the next tokens, for the target to verify in ONE pass per round.

Every proposer serves a whole batch (one object for all rows, per-slot state inside, buffers
sized to ``max_batch``) behind the same small interface, which the decode core (runtime/core.py)
calls in this order for a sequence in cache slot ``row.slot``:

    start(row, hidden)        a new sequence: row.seq = prompt + first token; hidden [P, F] = the
                              target's features of the prompt positions (None unless needs_hidden):
                              its graph output named by the proposer's ``feature`` ("hidden" [P, H],
                              or EAGLE-3's "aux_hidden" [P, 3H])
    propose(rows, ks)         -> one ``Proposal`` per row, at most ks[b] tokens (chains) or a tree
                              (tree proposers: ks[b] > 0 means "a tree fits"); ks[b] == 0: empty
    observe(row, new, hidden) proposers with ``needs_hidden`` only, after the target pass:
                              ``new`` = the tokens the round emitted, hidden [n + 1, F] = the
                              target's features at the root and the accepted nodes (what the
                              next round starts from)
    move(src, dst) / release(slot)    a sequence changed slot / left

Rows carry ``slot``, ``seq`` (prompt + emitted tokens), ``params`` (``SamplingParams``) and
``rng`` (the row's generator: a proposer that samples draws from it, so a row's random
stream does not depend on the rest of the batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...trees import Tree


@dataclass
class Proposal:
    tokens: np.ndarray  # int64 [k]: a chain x_1..x_k, or a tree's nodes 1..k (node 0, the root, is the last emitted token)
    q: np.ndarray | None = None  # float [k, V] a chain's proposer distributions; None = deterministic (point masses)
    tree: Tree | None = None  # the candidate tree (tree.size == k + 1); None = a chain

    @property
    def positions(self) -> int:
        """Target positions this proposal needs: the root and its k tokens."""
        return len(self.tokens) + 1

    def prefixes(self) -> list[np.ndarray]:
        """Per target position, the proposal tokens its history adds to the sequence (penalties need
        them): a chain's position i follows x_1..x_i, a tree node follows its path from the root."""
        if self.tree is None:
            return [self.tokens[:i] for i in range(self.positions)]
        out = [self.tokens[:0]]
        for i in range(1, self.positions):  # parents precede children
            out.append(np.append(out[self.tree.parents[i]], self.tokens[i - 1]))
        return out


EMPTY = Proposal(np.zeros(0, np.int64))  # no proposal: the round is one plain decode step


class NoProposer:
    """Method "none": plain decoding through the same core (every proposal empty)."""

    name = "none"
    tree = False  # proposes chains
    needs_hidden = False
    feature = "hidden"  # the target graph output ``start``/``observe`` receive (with needs_hidden)
    max_nodes = 0  # most tokens one proposal adds to the target pass
    step_seconds = 0.0  # chain proposers: measured seconds per proposed token (a tree's cost: the core measures it)
    passes = 0

    def start(self, row, hidden) -> None:
        pass

    def propose(self, rows, ks) -> list[Proposal]:
        return [EMPTY] * len(rows)

    def observe(self, row, new, hidden) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass
