"""The tree-speculative decode loop (Medusa): heads propose a tree, ONE target pass verifies it.

Mirrors ``speculative_decode`` in runtime/decode.py, with the same cache invariant: the
target's cache holds every token of ``seq`` except the last one (the pending root).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .decode import DecodeStats
from .model import CachedModel
from .sampling import SamplingParams, next_token
from .tree import Tree
from .tree_verify import verify_tree_greedy, verify_tree_sampled, verify_tree_typical

ACCEPTANCE = ("exact", "typical")  # "typical" (Medusa-2) is lossy: opt-in only


@dataclass
class TreeStats(DecodeStats):
    """DecodeStats of a tree run; per round ``proposed`` counts the tree depth (the most it can accept)."""

    tree_size: int = 0  # N: nodes per tree-verify pass, root included
    accept_lengths: list = field(default_factory=list)  # candidates accepted per round
    fallback_steps: int = 0  # single-token passes (no room for a tree in the cache, or 1 token left)
    acceptance: str = "exact"  # verification rule: "exact" | "typical"
    lossy: bool = False  # typical acceptance at temperature > 0: output NOT the target's distribution


def verify_round(tree: Tree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams,
                 rng: np.random.Generator, acceptance: str) -> tuple[np.ndarray, int]:
    if params.greedy:
        return verify_tree_greedy(tree, tokens, logits)
    if acceptance == "typical":
        return verify_tree_typical(tree, tokens, logits, params, rng)
    return verify_tree_sampled(tree, tokens, logits, params, rng)


def tree_speculative_decode(target: CachedModel, proposer, tree: Tree, prompt: list[int], params: SamplingParams,
                            rng, stats: TreeStats, budget, acceptance: str = "exact"):
    """budget() -> tokens that may still be emitted. Yields the tokens of each target pass."""
    seq = list(prompt)
    stats.tree_size = tree.size
    logits = target.prefill(seq)  # [V]
    stats.target_passes += target.prefill_calls(len(seq))
    hidden = target.last_outputs["hidden"][0, -1]  # [H] at the position that predicted the root
    seq.append(next_token(logits, params, rng))
    yield seq[-1:]
    while True:
        if budget() <= 1 or target.cache.room < tree.size:
            hidden = yield from step_plain(target, seq, params, rng, stats)
            continue
        tokens = proposer.propose(hidden)  # [N] candidates; node 0 is the root
        tokens[0] = seq[-1]
        logits = target.forward(tokens, tree_mask=tree.mask, depths=tree.depths)  # [N, V]: ONE pass
        stats.target_passes += 1
        path, nxt = verify_round(tree, tokens, logits, params, rng, acceptance)  # accepted nodes [n]
        start = len(seq) - 1  # the root's slot
        target.cache.compact(start, start + np.concatenate([[0], path]))  # root + accepted path, contiguous
        hidden = target.last_outputs["hidden"][0, path[-1] if path.size else 0]  # [H]
        stats.record(tree.depth, len(path))
        stats.accept_lengths.append(len(path))
        new = [*tokens[path].tolist(), nxt]
        seq += new
        yield new


def step_plain(target: CachedModel, seq: list[int], params: SamplingParams, rng, stats: TreeStats):
    """One ordinary decode step (generator: yields the token, returns the new hidden state)."""
    logits = target.forward(seq[-1:])[-1]
    stats.target_passes += 1
    stats.fallback_steps += 1
    seq.append(next_token(logits, params, rng))
    yield seq[-1:]
    return target.last_outputs["hidden"][0, -1]


def calibrate_tree(target: CachedModel, proposer, token: int, reps: int = 3) -> None:
    """Time target calls of 1 and N tokens (and the heads) on the current cache, then roll back.

    The first call of each shape is a warm-up and is not recorded.
    """
    start, n = target.length, proposer.tree.size
    if target.cache.room < n:
        return
    for rep in range(reps + 1):
        if rep == 1:
            target.clear_latency()
            proposer.step_seconds = None
        for q in (1, n):
            target.forward(np.full(q, token))
            target.rollback(start)
        proposer.propose(target.last_outputs["hidden"][0, -1])
    proposer.passes = 0


def tree_stats(s: TreeStats, latency: dict, proposer) -> dict:
    """The stats keys of a Medusa run (Runtime.stats_for adds the common ones)."""
    rounds = max(s.rounds, 1)
    depth = proposer.tree.depth
    lengths = np.bincount(np.asarray(s.accept_lengths, dtype=np.int64), minlength=depth + 1)  # [D+1]
    reached = lengths[::-1].cumsum()[::-1][1:] / rounds  # [D] fraction of rounds accepting >= d tokens
    t1 = latency.get(1) or 1e-9
    c = (proposer.step_seconds or 0.0) / t1
    verify_ratio = latency.get(proposer.tree.size, t1) / t1
    per_pass = (s.accepted + s.rounds) / rounds
    return {
        "proposed": s.proposed, "accepted": s.accepted, "acceptance_rate": s.accepted / s.proposed if s.proposed else 0.0,
        "alpha": s.alpha, "rejections": s.rejections,
        "rounds": s.rounds, "tokens_per_pass": per_pass, "mean_acceptance_length": per_pass,
        "per_depth_acceptance": [round(float(x), 4) for x in reached],
        "accept_length_histogram": lengths.tolist(), "tree": proposer.tree.name, "tree_size": s.tree_size,
        "tree_depth": depth, "fallback_steps": s.fallback_steps, "heads_passes": proposer.passes, "draft_passes": 0,
        "c": c, "verify_ratio": verify_ratio, "predicted_speedup": per_pass / (c + verify_ratio),
        "acceptance": s.acceptance, "lossy": s.lossy,
    }
