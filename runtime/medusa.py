"""Medusa proposals: the heads graph reads the target's last hidden state; top-k per head fill the tree."""
from __future__ import annotations

import time

import numpy as np

from ..engines.manifest import MedusaSpec
from .model import NP_DTYPES
from .tree import Tree, TreeError


def check_tree_fits(tree: Tree, spec: MedusaSpec) -> None:
    """A tree must fit the exported tree-verify shape and have a head for each of its depths."""
    exported = spec.tree["nodes"]
    if tree.size > exported:
        raise TreeError(f"tree {tree.name!r} has {tree.size} nodes but the engine's tree-verify shape is "
                        f"{exported}: re-export with --tree {tree.name}")
    if tree.depth > spec.num_heads:
        raise TreeError(f"tree {tree.name!r} is {tree.depth} deep but the engine has {spec.num_heads} Medusa heads")
    if tree.topk.max() > spec.vocab_size:
        raise TreeError(f"tree {tree.name!r} uses rank {tree.topk.max() - 1} but the vocabulary has "
                        f"{spec.vocab_size} tokens")


class MedusaProposer:
    """Deterministic tree candidates from the Medusa heads graph.

    ``propose(hidden)`` runs the heads on the target's hidden state at the last accepted
    position (the one whose logits produced the pending root token) and lays head d's top-k
    tokens on the depth-d nodes: node path (r1, .., rd) carries head d's rank-rd token.
    """

    name = "medusa"

    def __init__(self, engine, spec: MedusaSpec, tree: Tree):
        check_tree_fits(tree, spec)
        self.engine = engine
        self.tree = tree
        self.dtype = NP_DTYPES[spec.dtype]
        self.step_seconds = None  # EWMA seconds of one heads call + top-k
        self.passes = 0  # heads graph calls
        self._k = int(tree.topk.max())  # candidates taken from each head

    def propose(self, hidden: np.ndarray) -> np.ndarray:
        """hidden: [H] -> candidate tokens int64 [N] (node 0, the root, is filled by the caller: -1)."""
        t0 = time.perf_counter()
        logits = self.engine.run({"hidden": hidden.astype(self.dtype, copy=False)[None]})["medusa_logits"][0]
        logits = logits[: self.tree.depth]  # [D, V] heads the tree uses
        top = np.argpartition(-logits, self._k - 1, axis=-1)[:, : self._k]  # [D, k] unordered
        order = np.argsort(-np.take_along_axis(logits, top, axis=-1), axis=-1, kind="stable")
        top = np.take_along_axis(top, order, axis=-1)  # [D, k] by descending logit
        tokens = np.full(self.tree.size, -1, dtype=np.int64)  # [N]
        tokens[1:] = top[self.tree.depths[1:] - 1, self.tree.ranks[1:]]
        dt = time.perf_counter() - t0
        self.step_seconds = dt if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * dt
        self.passes += 1
        return tokens
