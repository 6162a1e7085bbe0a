"""Proposers: cheap guesses of the next tokens, for the target to verify in ONE pass per round.

One proposer object serves every row of a decode core (runtime/core.py) behind the ``Proposer``
protocol below; what it keeps about a sequence is keyed by the row's request id
(``row.request.request_id``), never by cache slot. The core calls, for each sequence:

    start(row, hidden)        a new sequence: row.seq = prompt + first token; hidden [P, F] = the
                              target's ``feature`` output at the prompt positions (None when the
                              proposer's ``feature`` is None or the graph has no such output)
    propose(rows, ks)         -> one ``Proposal`` per row, at most ks[b] tokens (chains) or a tree
                              (tree proposers: ks[b] > 0 means "a tree fits"); ks[b] == 0: ``EMPTY``
    observe(row, new, hidden) proposers with a ``feature`` only, after the target pass: ``new`` =
                              the tokens the round emitted, hidden [n + 1, F] = the target's
                              features at the root and the accepted nodes
    finish(row)               the sequence left (finished or cancelled): drop what is kept for it

Rows carry ``slot`` (the row's cache slot), ``seq`` (prompt + emitted tokens), ``params``
(``SamplingParams``), ``rng`` (the row's generator: a proposer that samples draws from it, so a
row's random stream does not depend on the rest of the batch), ``request`` (its
``SequenceRequest``: ``request_id``, ``cache_scope``) and ``matcher`` (its grammar state, None
without a constraint). A proposer that samples (the draft model) turns its logits into q with
``sampling.process_logits`` exactly as the target's are (penalties, logit_bias, min_tokens, the
grammar's mask at the same prefix); the core cuts every proposal where the grammar forbids a
token (``constrained.prune``), so deterministic proposers need not know about constraints.
A core may hold several proposers (one per method it serves); each row has its own.

Cache slots are the core's: a proposer with a model cache of its own (the draft model, the EAGLE
head) exposes it as ``runner``, slot for slot with the target's, and the core moves and frees
that runner's slots with the target's. For the prefix cache (runtime/prefix_cache.py) such a proposer
also has ``cached(row)`` (asked as a row leaves: how many leading tokens of row.seq its slot covers) and
``cache_lag`` (entries = tokens covered - lag; default 0), and ``start`` continues from the entries the
core left in the slot (``runner.lengths[row.slot]``; 0 = a cold start); ``hidden`` then covers only the
prompt positions the target ran (the last ones). Worked example, n-gram at γ = 3 on row.seq = [5, 1, 2, 3,
9, 1, 2]: ``propose([row], [3])`` -> ``[Proposal(tokens=[3, 9, 1])]``; the target verifies
[2, 3, 9, 1] in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...trees import Tree


@dataclass
class Proposal:
    tokens: np.ndarray  # int64 [k]: a chain x_1..x_k, or a tree's nodes 1..k (node 0, the root, is the last emitted token)
    q: np.ndarray | None = None  # float [k, V] a chain's proposer distributions; None = deterministic (point masses)
    tree: Tree | None = None  # the candidate tree (tree.size == k + 1); None = a chain
    forced: bool = False  # the grammar's forced tokens (runtime/proposers/constrained.py), not the proposer's
    kind: int | None = None  # a lookup's class of guess that predicts its acceptance (n-gram: the match length): the
    # core prices the chain by what that kind's guesses realized (gamma.KindAlphas), not the row's α; None: the row's

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


class Proposer(Protocol):
    """What the decode core may assume of a proposer (see the module docstring for the call order).

    The core reads only these attributes and calls only these methods. A chain proposer returns
    proposals of at most ks[b] tokens and may attach its distributions q (a sampled draft) or not
    (point masses: n-gram, suffix); a tree proposer (``tree``) returns a ``Proposal`` with its
    ``Tree`` of at most ``max_nodes`` nodes beyond the root, or ``EMPTY``. Proposals never depend
    on other rows of the batch (a row's randomness comes from ``row.rng``).
    """

    name: str  # the method: "none" | "draft" | "ngram" | "suffix" | "medusa" | "eagle"
    tree: bool  # proposes trees (verified whole: γ is 0 or 1) instead of chains of <= γ tokens
    max_nodes: int  # most tokens one proposal adds to the target pass (chains: the exported γ)
    depth: int  # trees only: the tree's depth
    feature: str | None  # the target output start/observe receive: "hidden" [., H], "aux_hidden" [., 3H]; None: none
    runner: object | None  # the proposer's own model cache (a Runner), slot for slot with the target's; None: none
    passes: int  # graph calls made so far (the core attributes them to the rows it asked for)
    passes_name: str  # the stats key of ``passes`` ("draft_passes", "heads_passes", "head_passes")
    step_seconds: float | None  # chains: measured seconds per proposed token (None: not measured yet)
    tree_name: str | None  # trees: the tree's name in the stats
    shadow: bool  # chains of no model cost (n-gram, suffix): while a row's γ is 0 the core still asks for one
    # token each step and scores it against the token the step emits (``DecodeCore._score_shadows``): α stays
    # measured without probe steps

    def start(self, row, hidden: np.ndarray | None) -> None: ...

    def propose(self, rows: list, ks: list[int]) -> list[Proposal]: ...

    def observe(self, row, new: list[int], hidden: np.ndarray) -> None: ...

    def finish(self, row) -> None: ...


class NoProposer:
    """Method "none": plain decoding through the same core (every proposal empty). A ``Proposer``
    with nothing to keep, so also the simplest base for a test's proposer."""

    name = "none"
    tree = False
    max_nodes = 0
    depth = 0
    feature = None
    runner = None
    passes = 0
    passes_name = "proposer_passes"
    step_seconds = 0.0
    tree_name = None
    shadow = False

    def start(self, row, hidden) -> None:
        pass

    def propose(self, rows, ks) -> list[Proposal]:
        return [EMPTY] * len(rows)

    def observe(self, row, new, hidden) -> None:
        pass

    def finish(self, row) -> None:
        pass
