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
  2. verify: ONE target pass over the tree (runtime/tree.py mask and depths), the exact node walk
     of runtime/tree_verify.py (greedy: argmax match). Candidates are a deterministic function of
     the history, so the emitted tokens follow the target's distribution exactly.
  3. compact the target cache to root + accepted path, then re-run the head on the accepted
     tokens with the TRUE features of the tree pass (root and accepted nodes), which restores the
     head invariant and yields the next root_logits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..engines.manifest import EagleSpec
from .decode_tree import TreeStats, verify_round
from .kv_cache import KVCache
from .model import MASK_MIN, NP_DTYPES, CachedModel
from .sampling import SamplingParams, next_token
from .tree import compile_tree


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclass(eq=False)
class Node:
    """A draft-tree node: ``path`` of ranks (runtime/tree.py choices format) and its tokens."""

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


def dynamic_tree(root_logp: np.ndarray, expand, topk: int, depth: int, nodes: int) -> tuple[list, dict]:
    """EAGLE-2 tree: returns (choices, path -> token) of the ``nodes - 1`` best paths (root excluded).

    root_logp: [V] head log-probabilities of the depth-1 tokens. ``expand(frontier)`` takes the
    nodes chosen for expansion (list of ``Node``) and returns their children's log-probabilities
    [len(frontier), V]. Per depth the ``topk`` best-scoring nodes are expanded; ties in the final
    rerank go to the shallower node, so every kept node's parent is kept.
    """
    root = Node((), (), 0.0)
    layer = _children(root, np.asarray(root_logp), topk)
    cands = list(layer)
    for _ in range(1, depth):
        frontier = sorted(layer, key=lambda n: -n.score)[:topk]
        logps = expand(frontier)
        layer = [c for n, lp in zip(frontier, logps) for c in _children(n, np.asarray(lp), topk)]
        cands += layer
    kept = sorted(cands, key=lambda n: (-n.score, len(n.path)))[: nodes - 1]
    return [list(n.path) for n in kept], {n.path: n.tokens[-1] for n in kept}


class EagleHeadModel:
    """The head graph and its own KV cache (one layer, time-major, like the decoders')."""

    def __init__(self, engine, spec: EagleSpec, max_len: int):
        self.engine = engine
        self.spec = spec
        self.dtype = NP_DTYPES[spec.dtype]
        self.cache = KVCache(1, spec.num_kv_heads, spec.head_dim, max_len, dtype=self.dtype)
        self.passes = 0
        self.seconds = 0.0

    def run(self, ids, feats, positions, attend: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [Q], feats [Q, H], positions [Q], attend bool [Q, P+Q] -> (logits [Q, V], next features [Q, H])."""
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.where(attend, 0, MASK_MIN).astype(self.dtype)[None, None]
        feeds = {"input_ids": ids[None], "hidden": np.asarray(feats, dtype=self.dtype)[None],
                 "position_ids": np.asarray(positions, dtype=np.int64)[None], "attention_mask": mask,
                 **self.cache.feeds()}
        t0 = time.perf_counter()
        out = self.engine.run(feeds)
        self.seconds += time.perf_counter() - t0
        self.passes += 1
        self.cache.append(out)
        return out["logits"][0], out["next_hidden"][0]

    def chain(self, ids, feats) -> tuple[np.ndarray, np.ndarray]:
        """Commit rows at the next positions with causal attention (catch-up after a round)."""
        past, q = self.cache.length, len(ids)
        attend = np.ones((q, past + q), dtype=bool)
        attend[:, past:] = np.tri(q, dtype=bool)
        return self.run(ids, feats, past + np.arange(q), attend)


@dataclass
class EagleStats(TreeStats):
    tree_sizes: list = field(default_factory=list)  # nodes (root incl.) of each round's dynamic tree
    draft_seconds: float = 0.0  # head calls + tree building


class EagleDrafter:
    """Builds one round's dynamic tree from the head (see the module docstring)."""

    name = "eagle"

    def __init__(self, head: EagleHeadModel, topk: int, depth: int, nodes: int):
        self.head, self.topk, self.depth, self.nodes = head, topk, depth, nodes

    @property
    def draft_rows(self) -> int:
        return (self.depth - 1) * self.topk

    def draft(self, root_logits: np.ndarray, root_feat: np.ndarray):
        """-> (Tree, tokens int64 [N] with node 0 = -1). Leaves the head cache as it found it."""
        head = self.head
        committed = head.cache.length  # rows 0..L-2: the root's row is the last one
        base = committed - 1  # position of the root's row

        def expand(frontier):
            past, q = head.cache.length, len(frontier)
            attend = np.zeros((q, past + q), dtype=bool)
            attend[:, :committed] = True
            for i, n in enumerate(frontier):
                attend[i, past + i] = True
                a = n.parent
                while a is not None and a.row >= 0:
                    attend[i, a.row] = True
                    a = a.parent
            feats = np.stack([n.parent.feat if n.parent.feat is not None else root_feat for n in frontier])
            logits, nxt = head.run([n.tokens[-1] for n in frontier], feats,
                                   base + np.array([len(n.path) for n in frontier]), attend)
            for i, n in enumerate(frontier):
                n.row, n.feat = past + i, nxt[i]
            return log_softmax(logits)

        try:
            choices, tok = dynamic_tree(log_softmax(root_logits), expand, self.topk, self.depth, self.nodes)
        finally:
            head.cache.rollback(committed)
        tree = compile_tree(choices, "eagle")
        tokens = np.array([-1] + [tok[tuple(p)] for p in tree.choices], dtype=np.int64)
        return tree, tokens


def _prefill_features(target: CachedModel, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Prefill in the exported chunks; returns (last logits [V], features of every prompt position [P, H])."""
    feats, logits = [], None
    for i in range(0, len(ids), target.prefill_chunk):
        logits = target.forward(ids[i : i + target.prefill_chunk])
        feats.append(target.last_outputs["hidden"][0])
    return logits[-1], np.concatenate(feats)


def eagle_decode(target: CachedModel, drafter: EagleDrafter, prompt: list[int], params: SamplingParams, rng,
                 stats: EagleStats, budget):
    """budget() -> tokens that may still be emitted. Yields the tokens of each target pass."""
    head = drafter.head
    head.cache.reset()
    seq = list(prompt)
    logits, feats = _prefill_features(target, seq)
    stats.target_passes += target.prefill_calls(len(seq))
    stats.tree_size = drafter.nodes
    seq.append(next_token(logits, params, rng))
    yield seq[-1:]
    t0 = time.perf_counter()
    h_logits, h_feat = head.chain(seq[1:], feats)  # rows 0..L-2
    root_logits, root_feat = h_logits[-1], h_feat[-1]
    stats.draft_seconds += time.perf_counter() - t0
    while True:
        if (budget() <= 1 or target.cache.room < drafter.nodes
                or head.cache.room < drafter.draft_rows + drafter.depth + 1):
            out = target.forward(seq[-1:])
            stats.target_passes += 1
            stats.fallback_steps += 1
            seq.append(next_token(out[-1], params, rng))
            yield seq[-1:]
            if head.cache.room < 1:
                return  # nothing more fits (the caller's budget ends the run first in practice)
            t0 = time.perf_counter()
            h_logits, h_feat = head.chain(seq[-1:], target.last_outputs["hidden"][0, -1:])
            root_logits, root_feat = h_logits[-1], h_feat[-1]
            stats.draft_seconds += time.perf_counter() - t0
            continue
        t0 = time.perf_counter()
        tree, tokens = drafter.draft(root_logits, root_feat)
        stats.draft_seconds += time.perf_counter() - t0
        tokens[0] = seq[-1]
        logits = target.forward(tokens, tree_mask=tree.mask, depths=tree.depths)  # [N, V]: ONE pass
        stats.target_passes += 1
        path, nxt = verify_round(tree, tokens, logits, params, rng, "exact")
        start = len(seq) - 1  # the root's slot
        keep = np.concatenate([[0], path]).astype(np.int64)
        target.cache.compact(start, start + keep)
        true_feats = target.last_outputs["hidden"][0, keep]  # [n+1, H] f at the root and accepted nodes
        stats.record(tree.depth, len(path))
        stats.accept_lengths.append(len(path))
        stats.tree_sizes.append(tree.size)
        new = [*tokens[path].tolist(), nxt]
        seq += new
        yield new
        t0 = time.perf_counter()
        h_logits, h_feat = head.chain(new, true_feats)  # rows start..start+n: the head invariant again
        root_logits, root_feat = h_logits[-1], h_feat[-1]
        stats.draft_seconds += time.perf_counter() - t0


def eagle_stats(s: EagleStats, latency: dict, drafter: EagleDrafter) -> dict:
    """The stats keys of an EAGLE run (Runtime.stats_for adds the common ones)."""
    rounds = max(s.rounds, 1)
    lengths = np.bincount(np.asarray(s.accept_lengths, dtype=np.int64), minlength=drafter.depth + 1)
    per_pass = (s.accepted + s.rounds) / rounds
    t1 = latency.get(1) or 1e-9
    c = s.draft_seconds / rounds / t1  # head calls per round (catch-up + expansions), in target steps
    verify_ratio = latency.get(drafter.nodes, t1) / t1
    return {
        "proposed": s.proposed, "accepted": s.accepted,
        "acceptance_rate": s.accepted / s.proposed if s.proposed else 0.0, "alpha": s.alpha,
        "rejections": s.rejections, "rounds": s.rounds, "tokens_per_pass": per_pass,
        "mean_acceptance_length": per_pass, "accept_length_histogram": lengths.tolist(),
        "tree": "eagle-dynamic", "tree_size": drafter.nodes, "tree_depth": drafter.depth, "tree_topk": drafter.topk,
        "mean_tree_size": float(np.mean(s.tree_sizes)) if s.tree_sizes else 0.0,
        "fallback_steps": s.fallback_steps, "head_passes": drafter.head.passes, "draft_passes": 0,
        "c": c, "verify_ratio": verify_ratio, "predicted_speedup": per_pass / (c + verify_ratio),
        "acceptance": "exact", "lossy": False,
    }
