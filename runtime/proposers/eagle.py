"""EAGLE (EAGLE-1 head, EAGLE-2 dynamic draft tree), verified exactly in ONE target pass per round.

The head (export/eagle_head.py) reads (f_t, x_{t+1}) at "row" t and predicts f_{t+1}, whose logits
lm_head(f_{t+1}) score x_{t+2}. Invariants between rounds, with ``seq`` = tokens emitted so far
and L = len(seq):

    target cache   every token of seq except the last (the pending root x_{L-1})
    head cache     rows 0..L-2, all built from the target's TRUE features f_0..f_{L-2}
    root_logits    the head's logits of row L-2 (candidates for x_L); root_feat = its f̂_{L-1}

A round:
  1. draft (``dynamic_tree``, EAGLE-2): depth 1 holds the top-k tokens of root_logits; at each
     further depth the k nodes with the highest cumulative log-probability (path score) are
     expanded by ONE head call (each node's row attends to the committed rows and its own
     ancestors' rows: a tree mask over the draft rows), and each contributes its top-k children.
     All candidates are then reranked by path score and the best ``nodes - 1`` kept (a child
     never scores above its parent, so the kept set is a tree). The draft rows are discarded.
  2. verify (the decode core): ONE target pass over the tree (specrt/trees.py mask and depths),
     the exact node walk of runtime/verify.py (greedy: argmax match). Candidates are a
     deterministic function of the history, so the emitted tokens follow the target's distribution exactly.
  3. the core keeps root + accepted path in the target cache; the head re-runs the emitted
     tokens with the TRUE features of the tree pass (root and accepted nodes), which restores
     the head invariant and yields the next root_logits. ``observe`` only buffers them: the
     catch-up runs in one head call before the next draft, so steps without a tree (the policy
     off, no room) cost no head call.

Per request the proposer keeps root_logits, root_feat and the rows the head has not run on
(``EagleState``); the head's own cache (a ``HeadRunner`` of ``max_batch`` slots, the proposer's
``runner``) follows the target's slots, moved and freed by the core. The rows' trees grow in
lockstep, one head call per depth for every row (``dynamic_trees``).

EAGLE-3 (export/eagle3_head.py) runs the same way with two differences: the proposer reads the
target's ``aux_hidden`` output (``feature``), the hidden states of three layers, and the fc graph
fuses them into the head's input at catch-up (``fc``); root_feat and the draft rows' features are
the head's own outputs h (its ``next_hidden``), as in EAGLE-1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...contract import NP_DTYPES
from ...engines.base import EngineError
from ...engines.manifest import EagleSpec
from ...contract import batch_mask
from ..runner import HostRunner, Pass
from ...trees import compile_tree
from . import EMPTY, Proposal


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclass(eq=False)
class Node:
    """A draft-tree node: ``path`` of ranks (specrt/trees.py choices format) and its tokens."""

    path: tuple
    tokens: tuple
    score: float  # cumulative log-probability of the path under the head
    parent: "Node | None" = None
    row: int = -1  # head-cache row of this node's expansion (set by the expand callback)
    feat: object = None  # the head's predicted feature at this node (set by the expand callback)


def _children(parent: Node, logp: np.ndarray, topk: int) -> list[Node]:
    k = min(topk, len(logp))
    top = np.argpartition(-logp, k - 1)[:k] if k < len(logp) else np.arange(len(logp))
    top = top[np.lexsort((top, -logp[top]))]  # ranks 0..k-1 by descending probability (ties: smaller id)
    return [Node(parent.path + (r,), parent.tokens + (int(t),), parent.score + float(logp[t]), parent)
            for r, t in enumerate(top)]


def dynamic_trees(root_logps, expand, topk: int, depth: int, nodes: int) -> list[tuple[list, dict]]:
    """EAGLE-2 trees for several rows in lockstep: per row (choices, path -> token) of its ``nodes - 1``
    best paths (root excluded).

    root_logps: per row [V] head log-probabilities of the depth-1 tokens. ``expand(frontiers)`` takes
    per row the nodes chosen for expansion (lists of ``Node``) and returns per row their children's
    log-probabilities [len(frontier), V]: one head call for every row. Per depth the ``topk``
    best-scoring nodes of a row are expanded; ties in the final rerank go to the shallower node, so
    every kept node's parent is kept.
    """
    layers = [_children(Node((), (), 0.0), np.asarray(lp), topk) for lp in root_logps]
    cands = [list(layer) for layer in layers]
    for _ in range(1, depth):
        frontiers = [sorted(layer, key=lambda n: -n.score)[:topk] for layer in layers]
        logps = expand(frontiers)
        layers = [[c for n, lp in zip(f, lps) for c in _children(n, np.asarray(lp), topk)]
                  for f, lps in zip(frontiers, logps)]
        for row_cands, layer in zip(cands, layers):
            row_cands += layer
    out = []
    for row_cands in cands:
        kept = sorted(row_cands, key=lambda n: (-n.score, len(n.path)))[: nodes - 1]
        out.append(([list(n.path) for n in kept], {n.path: n.tokens[-1] for n in kept}))
    return out


def dynamic_tree(root_logp: np.ndarray, expand, topk: int, depth: int, nodes: int) -> tuple[list, dict]:
    """``dynamic_trees`` for one row: ``expand(frontier)`` -> [len(frontier), V]."""
    return dynamic_trees([root_logp], lambda frontiers: [expand(frontiers[0])], topk, depth, nodes)[0]


class HeadRunner(HostRunner):
    """The EAGLE head's one-layer cache. Besides the runner calls, the head's own: every row reads a
    feature (``hidden``), and draft rows carry positions and visible past rows of their own."""

    def forward_head(self, slots, ids, hidden: np.ndarray, blocks=None, positions=None,
                     past_visible=None) -> Pass:
        """Run ``ids`` [R, Q] with features ``hidden`` [R, Q, H] after each slot's valid entries.

        positions: int [R, Q] (None: each row's length + index); past_visible: bool [R, Q, P] which
        past rows each new row sees (None: all valid ones); blocks as in ``HostRunner.forward``."""
        slots = np.asarray(slots, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        lengths = self.lengths[slots]  # [R]
        mask = batch_mask(lengths, ids.shape[1], blocks, past_visible, self.dtype)  # [R, 1, Q, P+Q]
        positions = self.positions(lengths, ids.shape[1]) if positions is None else np.asarray(positions, np.int64)
        return self.run(slots, ids, positions, mask, feeds={"hidden": np.asarray(hidden, dtype=self.dtype)})


def head_runner(engine, spec: EagleSpec, max_len: int, tree: dict, max_batch: int) -> HeadRunner:
    """The head graph with its own one-layer cache, sized for the committed rows plus one round's draft rows."""
    return HeadRunner(engine, 1, spec.num_kv_heads, spec.head_dim, max_len + (tree["depth"] + 1) * tree["topk"],
                      max_batch, NP_DTYPES[spec.dtype])


@dataclass
class EagleState:
    """What the proposer keeps about one request between rounds."""

    root_logits: np.ndarray | None = None  # float32 [V] the head's candidates for the next token
    root_feat: np.ndarray | None = None  # [H] the head's f̂ at the root
    pending: list = field(default_factory=list)  # (tokens, true features [n, F]) the head has not run on yet


class EagleProposer:
    """EAGLE-2 dynamic trees from the EAGLE head (see the module docstring). A ``Proposer``
    (runtime/proposers/__init__.py) whose ``runner`` is the head's cache."""

    name = "eagle"
    tree, step_seconds = True, None
    tree_name = "eagle-dynamic"
    passes_name = "head_passes"  # the stats key of ``passes``
    shadow = False
    cache_lag = 1  # head row t needs token t + 1: its cache covers one token more than it has rows

    def __init__(self, head: HeadRunner, topk: int, depth: int, nodes: int, fc=None):
        self.runner = head  # the head's cache, slot for slot with the target's
        self.topk, self.depth, self.nodes = topk, depth, nodes
        self.fc = fc  # EAGLE-3: the fc graph's Engine (aux_hidden [1, n, 3H] -> hidden [1, n, H]); None: EAGLE-1
        self.feature = "aux_hidden" if fc is not None else "hidden"  # the target output start/observe receive
        self.max_nodes = nodes - 1
        self.states: dict[str, EagleState] = {}  # request id -> its state
        self.passes = 0  # head graph calls

    @property
    def draft_rows(self) -> int:
        return (self.depth - 1) * self.topk

    def start(self, row, hidden) -> None:
        if hidden is None:
            raise EngineError(f"method eagle: the target runner gives no {self.feature!r} output (the device runner "
                              "has `hidden` only: run an EAGLE-3 engine on the host runners)")
        n = len(row.seq) - 1 - len(hidden)  # prompt positions hidden lacks: a cached prefix, its head rows kept
        self.runner.rollback(row.slot, n)  # (runtime/prefix_cache.py: the core left exactly n rows in the slot)
        self.states[row.request.request_id] = EagleState(pending=[(row.seq[n + 1:], hidden)])  # rows n..L-2

    def observe(self, row, new, hidden) -> None:
        self.states[row.request.request_id].pending.append((new, hidden))  # rows start..start+n, run before the next draft

    def finish(self, row) -> None:
        self.states.pop(row.request.request_id, None)

    def cached(self, row) -> int:
        """Leading tokens of ``row.seq`` the head's slot covers (runtime/prefix_cache.py): rows 0..h-1 are built
        from tokens 0..h (``cache_lag`` 1). The buffered rows run first (one head call), so a sequence that never
        drafted (the policy at γ = 0) still leaves its whole history."""
        if row.request.request_id not in self.states:
            return 0
        self._catch_up(row)
        h = int(self.runner.lengths[row.slot])
        return h + 1 if h else 0

    def _catch_up(self, row) -> None:
        """Run the head on every row it has not seen (one call): the head invariant again. Rows are
        buffered, so steps without a tree (the policy off, no room) cost no head call."""
        state = self.states[row.request.request_id]
        rows, state.pending = state.pending, []
        if rows:
            feats = np.concatenate([f for _, f in rows])  # [n, H] | EAGLE-3: [n, 3H], fused here
            if self.fc is not None:
                feats = self.fc.run({"aux_hidden": feats[None].astype(self.runner.dtype)})["hidden"][0]
            self._chain(row, [t for ids, _ in rows for t in ids], feats)

    def _chain(self, row, ids, feats) -> None:
        """Commit head rows for tokens ``ids`` with true features ``feats`` [n, H] at the row's next positions
        (causal attention); the last row's outputs become the row's root."""
        p = self.runner.forward_head([row.slot], [list(ids)], np.asarray(feats)[None])
        self.runner.commit(p)
        self.passes += 1
        state = self.states[row.request.request_id]
        state.root_logits, state.root_feat = p.logits[0, -1], p.outputs["next_hidden"][0, -1]

    def propose(self, rows, ks) -> list[Proposal]:
        out = [EMPTY] * len(rows)
        drafting = []
        for b, (row, k) in enumerate(zip(rows, ks)):
            behind = sum(len(ids) for ids, _ in self.states[row.request.request_id].pending)
            if k and self.runner.room(row.slot) >= behind + self.draft_rows + self.depth + 1:
                drafting.append(b)
        if not drafting:
            return out
        for b in drafting:
            self._catch_up(rows[b])
        for b, (tree, tokens) in zip(drafting, self.draft([rows[b] for b in drafting])):
            out[b] = Proposal(tokens, None, tree)
        return out

    def draft(self, rows: list) -> list[tuple]:
        """Per row (Tree, tokens int64 [N - 1] of nodes 1..N-1), the rows' trees grown in lockstep: each depth
        is ONE head call over every row. Leaves the rows' head cache as it found it."""
        head = self.runner
        states = [self.states[row.request.request_id] for row in rows]
        slots = np.array([row.slot for row in rows], dtype=np.int64)
        committed = head.lengths[slots].copy()  # [R] rows 0..L-2 of each slot: the root's row is the last one
        root_feat = np.stack([s.root_feat for s in states])  # [R, H]
        def expand(frontiers):
            r, q = len(frontiers), max(len(f) for f in frontiers)
            past = head.lengths[slots].copy()  # [R] committed rows + this round's draft rows so far
            visible = np.zeros((r, q, int(past.max())), dtype=bool)  # committed rows and each node's ancestors
            ids = np.zeros((r, q), dtype=np.int64)
            positions = np.repeat(committed[:, None], q, axis=1)  # padding: a valid position
            feats = np.zeros((r, q, root_feat.shape[-1]), dtype=head.dtype)
            for b, frontier in enumerate(frontiers):
                visible[b, :, : committed[b]] = True
                for i, n in enumerate(frontier):
                    a = n.parent
                    while a is not None and a.row >= 0:
                        visible[b, i, a.row] = True
                        a = a.parent
                    ids[b, i], positions[b, i] = n.tokens[-1], committed[b] - 1 + len(n.path)
                    feats[b, i] = n.parent.feat if n.parent.feat is not None else root_feat[b]
            p = head.forward_head(slots, ids, feats, blocks=[np.eye(len(f), dtype=bool) for f in frontiers],
                                  positions=positions, past_visible=visible)
            head.commit(p, [np.arange(len(f)) for f in frontiers])
            self.passes += 1
            for b, frontier in enumerate(frontiers):
                for i, n in enumerate(frontier):
                    n.row, n.feat = past[b] + i, p.outputs["next_hidden"][b, i]
            return [log_softmax(p.logits[b, : len(f)]) for b, f in enumerate(frontiers)]

        try:
            grown = dynamic_trees([log_softmax(s.root_logits) for s in states], expand, self.topk, self.depth,
                                  self.nodes)
        finally:
            for s, n in zip(slots, committed):
                head.rollback(int(s), int(n))
        out = []
        for choices, tok in grown:
            tree = compile_tree(choices, "eagle")
            out.append((tree, np.array([tok[tuple(path)] for path in tree.choices], dtype=np.int64)))
        return out
