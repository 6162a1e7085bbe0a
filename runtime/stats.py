"""Per-sequence decode statistics: what one sequence did, and the one builder of its stats dict."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .gamma import expected_tokens, predicted_speedup


@dataclass
class SequenceCounts:
    """Counters of one sequence, updated by the decode core every round."""

    target_passes: int = 0  # target graph calls this sequence took part in (prefill chunks included)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not prefilled)
    proposed: int = 0  # tokens proposed (a tree round counts its depth: the most it can accept)
    accepted: int = 0  # proposed tokens the target kept
    rounds: int = 0  # speculative rounds (verify passes after the first token)
    rejections: int = 0  # rounds that ended in a rejection (n < k)
    proposal_lengths: list = field(default_factory=list)  # k proposed per round
    gamma_history: list = field(default_factory=list)  # γ the policy chose per round
    accept_lengths: list = field(default_factory=list)  # tokens accepted per round
    tree_sizes: list = field(default_factory=list)  # nodes (root incl.) of each tree round
    fallback_steps: int = 0  # tree methods: plain steps (no room for a tree, or 1 token left)
    proposer_passes: int = 0  # proposer graph calls this sequence took part in
    proposer_seconds: float = 0.0  # wall time of the proposer's work for this sequence (shared calls: all of it)

    def record(self, k: int, n: int, tree_size: int = 0) -> None:
        self.rounds += 1
        self.proposed += k
        self.accepted += n
        self.rejections += int(n < k)
        self.proposal_lengths.append(k)
        self.accept_lengths.append(n)
        if tree_size:
            self.tree_sizes.append(tree_size)

    @property
    def alpha(self) -> float:
        """Per-token acceptance α̂ = accepted / (accepted + rejections): the MLE under the formula's
        i.i.d. assumption. accepted / proposed understates it: proposals after the first
        rejection of a round are never tested."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else 0.0


def sequence_stats(s: SequenceCounts, method: str, new_tokens: int, proposer, seconds: Callable[[int], float],
                   gamma_max: int, acceptance: str = "exact", lossy: bool = False) -> dict:
    """The stats of one finished sequence. seconds(n): measured seconds of one batch-1 target pass
    over n positions (T(n)); proposer: the method's proposer (tree shape, step time)."""
    rounds = max(s.rounds, 1)
    per_pass = (s.accepted + s.rounds) / rounds
    stats = {"method": method, "new_tokens": new_tokens, "target_passes": s.target_passes,
             "cached_tokens": s.cached_tokens,
             "proposed": s.proposed, "accepted": s.accepted,
             "acceptance_rate": s.accepted / s.proposed if s.proposed else 0.0, "rounds": s.rounds,
             "tokens_per_pass": per_pass}
    if method == "none":
        return stats
    t1 = seconds(1) or 1e-9
    stats.update({"alpha": s.alpha, "rejections": s.rejections,
                  "draft_passes": s.proposer_passes if method == "draft" else 0, "gamma_history": s.gamma_history})
    if not proposer.tree:
        c = (proposer.step_seconds or 0.0) / t1  # per proposed token, in target steps
        ratio = lambda k: seconds(k + 1) / t1  # noqa: E731  T(k+1)/T(1)
        num = sum(expected_tokens(s.alpha, k) for k in s.proposal_lengths)
        den = sum(k * c + ratio(k) for k in s.proposal_lengths)
        stats.update({"c": c, "verify_ratio": ratio(gamma_max), "predicted_speedup": num / den if den else 1.0,
                      "predicted_speedup_reference_formula":
                          predicted_speedup(s.alpha, round(s.proposed / rounds), c)})
        return stats
    depth = proposer.depth
    lengths = np.bincount(np.asarray(s.accept_lengths, dtype=np.int64), minlength=depth + 1)  # [D+1]
    reached = lengths[::-1].cumsum()[::-1][1:] / rounds  # [D] fraction of rounds accepting >= d tokens
    c = s.proposer_seconds / rounds / t1  # proposer work per round, in target steps
    ratio = seconds(proposer.max_nodes + 1) / t1
    stats.update({"mean_acceptance_length": per_pass, "per_depth_acceptance": [round(float(x), 4) for x in reached],
                  "accept_length_histogram": lengths.tolist(), "tree": proposer.tree_name,
                  "tree_size": proposer.max_nodes + 1, "tree_depth": depth,
                  "mean_tree_size": float(np.mean(s.tree_sizes)) if s.tree_sizes else 0.0,
                  "fallback_steps": s.fallback_steps, proposer.passes_name: s.proposer_passes,
                  "c": c, "verify_ratio": ratio, "predicted_speedup": per_pass / (c + ratio),
                  "acceptance": acceptance, "lossy": lossy})
    if proposer.name == "eagle":
        stats["tree_topk"] = proposer.topk
    return stats
