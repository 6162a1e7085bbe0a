"""Medusa proposals: the heads graph reads the target's last hidden state; top-k per head fill the tree."""
from __future__ import annotations


import numpy as np

from ...contract import NP_DTYPES
from ...engines.manifest import MedusaSpec
from ...trees import Tree, TreeError
from . import EMPTY, Proposal


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
    """Deterministic tree candidates from the Medusa heads graph, for every row in ONE heads call.

    A ``Proposer`` (runtime/proposers/__init__.py). Per request it keeps the target's hidden state at the last accepted position (the one whose
    logits produced the pending root token); ``propose`` runs the heads on those states and lays
    head d's top-k tokens on the depth-d nodes: node path (r1, .., rd) carries head d's rank-rd token.
    """

    name = "medusa"
    tree, feature, runner, step_seconds = True, "hidden", None, None
    passes_name = "heads_passes"  # the stats key of ``passes``
    shadow = False

    def __init__(self, engine, spec: MedusaSpec, tree: Tree):
        check_tree_fits(tree, spec)
        self.engine = engine
        self.candidates = tree
        self.max_nodes = tree.size - 1
        self.tree_name, self.depth = tree.name, tree.depth
        self.dtype = NP_DTYPES[spec.dtype]
        self.hidden: dict[str, np.ndarray] = {}  # request id -> [H] the target's feature at its last accepted position
        self.passes = 0  # heads graph calls
        self._k = int(tree.topk.max())  # candidates taken from each head

    def start(self, row, hidden) -> None:
        self.hidden[row.request.request_id] = hidden[-1].astype(self.dtype)

    def observe(self, row, new, hidden) -> None:
        self.hidden[row.request.request_id] = hidden[-1].astype(self.dtype)

    def finish(self, row) -> None:
        self.hidden.pop(row.request.request_id, None)

    def propose(self, rows, ks) -> list[Proposal]:
        active = [b for b, k in enumerate(ks) if k > 0]
        out = [EMPTY] * len(rows)
        if not active:
            return out
        tree = self.candidates
        hidden = np.stack([self.hidden[rows[b].request.request_id] for b in active])  # [A, H]
        logits = self.engine.run({"hidden": hidden})["medusa_logits"][:, : tree.depth]  # [A, D, V]
        top = np.argpartition(-logits, self._k - 1, axis=-1)[..., : self._k]  # [A, D, k] unordered
        order = np.argsort(-np.take_along_axis(logits, top, axis=-1), axis=-1, kind="stable")
        top = np.take_along_axis(top, order, axis=-1)  # [A, D, k] by descending logit
        nodes = top[:, tree.depths[1:] - 1, tree.ranks[1:]]  # [A, N - 1] node i+1 carries head d's rank-r token
        for j, b in enumerate(active):
            out[b] = Proposal(nodes[j].astype(np.int64), None, tree)
        self.passes += 1
        return out
