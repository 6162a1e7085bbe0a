"""Candidate-tree topology: Medusa's "choices" format, compiled once into a frozen ``Tree``.

A tree is given as a list of paths, Medusa's format: ``[[0], [1], [0, 0], [0, 1], ...]``. A path
``[r1, r2, ..., rd]`` is the node at depth d reached by taking the rank-r1 candidate of head 1,
then the rank-r2 candidate of head 2, and so on; every proper prefix of a path must itself be a
path. Node 0 is the root (the last emitted token, not in the list), so a tree of ``len(choices)``
paths has N = len(choices) + 1 nodes and is verified by ONE target pass of Q = N tokens.

Nodes are numbered root first, then paths sorted by (depth, path): a parent always precedes
its children, so every array below is in that node order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class TreeError(ValueError):
    """A tree spec is malformed, unknown, or does not fit the engine or heads it is used with."""


@dataclass(frozen=True, eq=False)
class Tree:
    """A compiled candidate tree (arrays are read-only; N nodes incl. the root, D = depth)."""

    name: str  # default-tree name, file stem, or "custom"
    choices: tuple  # the paths, sorted by (depth, path): node i >= 1 is choices[i - 1]
    parents: np.ndarray  # int64 [N] parent node index; -1 for the root
    depths: np.ndarray  # int64 [N] depth (root 0): position offset after the cached prefix
    ranks: np.ndarray  # int64 [N] candidate rank within its head (last path element); -1 for the root
    mask: np.ndarray  # bool [N, N] mask[i, j]: node i attends to node j (j is i or an ancestor of i)
    children: np.ndarray  # int64 [N, C] child node indices of each node, padded with -1 (C >= 1)
    retrieve: np.ndarray  # int64 [L, D + 1] node indices of each root-to-leaf path, padded with -1
    packed: np.ndarray  # int32 [N, ceil(N / 32)] mask as bits: bit b of word w in row i = mask[i, 32 w + b]

    @property
    def size(self) -> int:
        """N: nodes including the root (the tree-verify query length)."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        """D: the longest path; a tree needs at least D heads."""
        return int(self.depths.max())

    @property
    def topk(self) -> np.ndarray:
        """int64 [D]: candidates needed from head d+1 (the largest rank used at depth d+1, plus one)."""
        out = np.zeros(self.depth, dtype=np.int64)
        np.maximum.at(out, self.depths[1:] - 1, self.ranks[1:] + 1)
        return out

    def to_json(self) -> dict:
        """The manifest's form: enough to rebuild the tree with ``compile_tree``."""
        return {"name": self.name, "nodes": self.size, "depth": self.depth, "choices": [list(c) for c in self.choices]}


def compile_tree(choices, name: str = "custom") -> Tree:
    """Validate Medusa-style ``choices`` and build the ``Tree``; raises ``TreeError``."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise TreeError(f"tree {name!r}: expected a non-empty list of paths like [[0], [1], [0, 0]]")
    paths = []
    for c in choices:
        if (not isinstance(c, (list, tuple)) or not c
                or not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0 for r in c)):
            raise TreeError(f"tree {name!r}: path {c!r} is not a non-empty list of ranks >= 0")
        paths.append(tuple(int(r) for r in c))
    seen = set()
    for p in paths:
        if p in seen:
            raise TreeError(f"tree {name!r}: duplicate path {list(p)}")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(f"tree {name!r}: path {list(p)} has no parent: its prefix {list(p[:-1])} is missing")
    paths.sort(key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(paths)}  # path -> node index
    n = len(paths) + 1
    parents = np.array([-1] + [index.get(p[:-1], 0) for p in paths], dtype=np.int64)  # [N]
    depths = np.array([0] + [len(p) for p in paths], dtype=np.int64)  # [N]
    ranks = np.array([-1] + [p[-1] for p in paths], dtype=np.int64)  # [N]
    mask = np.eye(n, dtype=bool)  # [N, N]
    for i in range(1, n):
        mask[i] |= mask[parents[i]]  # parents precede children: the parent's row is final
    kids = [np.flatnonzero(parents == i) for i in range(n)]
    children = np.full((n, max(1, max(len(k) for k in kids))), -1, dtype=np.int64)  # [N, C]
    for i, k in enumerate(kids):
        children[i, : len(k)] = k
    leaves = [i for i in range(n) if not len(kids[i])]
    retrieve = np.full((len(leaves), depths.max() + 1), -1, dtype=np.int64)  # [L, D+1]
    for row, leaf in enumerate(leaves):
        path = np.flatnonzero(mask[leaf])  # ancestors-or-self, in node order = root to leaf
        retrieve[row, : len(path)] = path
    tree = Tree(name, tuple(paths), parents, depths, ranks, mask, children, retrieve, pack_mask(mask))
    for a in (parents, depths, ranks, mask, children, retrieve, tree.packed):
        a.setflags(write=False)
    return tree


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """bool [N, N] -> int32 [N, ceil(N / 32)]: bit b of word w in row i is mask[i, 32 w + b]."""
    n = mask.shape[1]
    words = -(-n // 32)
    padded = np.zeros((mask.shape[0], words * 32), dtype=np.uint64)
    padded[:, :n] = mask
    bits = padded.reshape(mask.shape[0], words, 32) << np.arange(32, dtype=np.uint64)  # [N, W, 32]
    return bits.sum(-1).astype(np.uint32).view(np.int32)


def unpack_mask(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of ``pack_mask``: int32 [N, W] -> bool [N, n]."""
    words = packed.view(np.uint32).astype(np.uint64)[:, :, None]  # [N, W, 1]
    bits = (words >> np.arange(32, dtype=np.uint64)) & 1  # [N, W, 32]
    return bits.reshape(len(packed), -1)[:, :n].astype(bool)


def greedy_tree(accuracy, nodes: int) -> list[list[int]]:
    """The ``nodes``-node tree (root included) maximising expected accepted length (Medusa's construction).

    accuracy: [K, R] with accuracy[k][r] = P(head k+1's rank-r candidate is the token the target
    accepts). A path's acceptance probability is the product along it, so it never exceeds its
    parent's: taking the nodes - 1 most probable paths (ties: shorter, then smaller ranks) always
    yields a valid tree, and it maximises the sum of path probabilities = E[accepted tokens].
    """
    acc = np.asarray(accuracy, dtype=np.float64)  # [K, R]
    frontier = {(r,): acc[0, r] for r in range(acc.shape[1])}
    chosen: list[tuple] = []
    while len(chosen) < nodes - 1 and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-r for r in p)))
        prob = frontier.pop(best)
        chosen.append(best)
        if len(best) < acc.shape[0]:
            frontier.update({best + (r,): prob * acc[len(best), r] for r in range(acc.shape[1])})
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


# Per-head top-k accuracy (P(rank-r candidate of head k is the target's greedy token)) measured on
# held-out text with the demo heads (tools/demo_models/medusa/README.md); the default trees are
# greedy_tree of this table, so they fit heads whose accuracy falls off with depth like these.
DEFAULT_ACCURACY = (
    (0.312, 0.120, 0.067, 0.051, 0.039, 0.033, 0.023, 0.019, 0.016, 0.015),
    (0.206, 0.095, 0.066, 0.043, 0.034, 0.031, 0.024, 0.023, 0.022, 0.018),
    (0.162, 0.079, 0.059, 0.050, 0.037, 0.032, 0.023, 0.022, 0.016, 0.017),
    (0.142, 0.078, 0.055, 0.043, 0.035, 0.026, 0.025, 0.025, 0.021, 0.019),
)
DEFAULT_SIZES = {"medusa-8": 8, "medusa-16": 16, "medusa-32": 32, "medusa-64": 64}  # name -> nodes (root incl.)


def default_tree(name: str) -> Tree:
    if name not in DEFAULT_SIZES:
        raise TreeError(f"unknown tree {name!r}; default trees: {', '.join(DEFAULT_SIZES)} (or a JSON file)")
    return compile_tree(greedy_tree(DEFAULT_ACCURACY, DEFAULT_SIZES[name]), name)


def load_tree(spec) -> Tree:
    """A ``Tree`` from a default name, a JSON file (a list of paths, or {"choices": [...]}), or a list."""
    if isinstance(spec, Tree):
        return spec
    if isinstance(spec, (list, tuple)):
        return compile_tree(spec)
    if str(spec) in DEFAULT_SIZES:
        return default_tree(str(spec))
    path = Path(spec)
    if not path.is_file():
        raise TreeError(f"tree {str(spec)!r} is neither a default tree ({', '.join(DEFAULT_SIZES)}) nor a file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TreeError(f"tree file {path}: not valid JSON ({e})") from None
    choices = data.get("choices") if isinstance(data, dict) else data
    return compile_tree(choices, name=path.stem)
