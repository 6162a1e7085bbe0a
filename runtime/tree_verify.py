"""Verification of a candidate tree against ONE target pass over it.

The tree's root (node 0) is the last emitted token; nodes 1..N-1 hold deterministic candidates
(top-k tokens of the Medusa heads). The target pass gives logits at every node: row i is the
target's next-token distribution after the root-to-i path. Terms (as in vLLM's samplers):

    accepted tokens  the candidates on the path the walk descends: at node i a target token y
                     is drawn; if a child of i carries y, that child is accepted and the walk
                     continues there. Accepted tokens are always one root-to-node path.
    recovered token  the walk stops at an inner node when y matches none of its children: y
                     itself is emitted (it replaces the rejected candidates).
    bonus token      the walk reaches a leaf: the y drawn there is emitted (the verify pass
                     already computed the leaf's distribution).
A round therefore emits len(path) + 1 tokens.

Exactness (exact acceptance): y at each node is a sample of p(node) = probs(logits, params),
the same function plain decoding uses; candidates are fixed before the pass, so "descend if y is
a child, else emit y" emits y ~ p(node) at every step: the emitted sequence follows the target's
distribution exactly, whatever the candidates are. Greedy decoding is its argmax case and is
kept on its own, fully vectorised path. Only visited nodes are sampled (at most depth + 1
rows): filtering all N rows costs far more than the walk on CPU (top-p over 64 x 4096: ~13 ms).

Typical acceptance (Medusa-2, opt-in, LOSSY): a candidate x at node i is kept when the target
finds it plausible enough, p_parent(x) > min(threshold, alpha * exp(-H(p_parent))); the longest
kept path wins (ties: the highest product of p), and the next token is sampled from p at its
end. The output no longer follows the target's distribution: it is biased towards candidates.
"""
from __future__ import annotations

import numpy as np

from .sampling import SamplingParams, probs, sample
from .tree import Tree


def _longest_path(tree: Tree, kept: np.ndarray) -> np.ndarray:
    """kept: bool [N] (root True). Node indices (root excluded) of the longest root path whose
    nodes are all kept; ties: the first retrieve row (smaller ranks)."""
    rows = tree.retrieve  # [L, D+1]
    ok = np.where(rows >= 0, kept[np.maximum(rows, 0)], False)  # [L, D+1]
    lengths = np.cumprod(ok, axis=1).sum(1)  # [L] nodes kept from the root on, root included
    best = int(np.argmax(lengths))
    return rows[best, 1 : lengths[best]].copy()


def verify_tree_greedy(tree: Tree, tokens: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, int]:
    """tokens: int [N] (node 0 = root); logits: [N, V]. Returns (accepted node indices [n], next_token).

    A node is accepted when its token is its parent's argmax; siblings hold distinct tokens, so
    at most one child per node qualifies and the accepted path is unique.
    """
    best = logits.argmax(-1)  # [N] target's greedy token after each node
    kept = np.asarray(tokens) == best[np.maximum(tree.parents, 0)]  # [N]
    kept[0] = True
    path = _longest_path(tree, kept)
    return path, int(best[path[-1] if path.size else 0])


def verify_tree_sampled(tree: Tree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams,
                        rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """The exact node walk at temperature > 0. tokens: int [N]; logits: [N, V].

    Returns (accepted node indices [n], next_token): the recovered token, or the bonus at a leaf.
    """
    tokens = np.asarray(tokens)
    node, path = 0, []
    while True:
        y = int(sample(probs(logits[node][None], params), rng)[0])  # y ~ p(node)
        kids = tree.children[node]
        kids = kids[kids >= 0]  # [c]
        hit = kids[tokens[kids] == y]
        if not hit.size:
            return np.array(path, dtype=np.int64), y
        node = int(hit[0])
        path.append(node)


def verify_tree_typical(tree: Tree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams,
                        rng: np.random.Generator, threshold: float = 0.09,
                        alpha: float = 0.3) -> tuple[np.ndarray, int]:
    """Medusa-2 typical acceptance (LOSSY; temperature > 0). Same arguments and result as above."""
    inner = np.flatnonzero(tree.children[:, 0] >= 0)  # [I] nodes with children
    p_inner = probs(logits[inner], params)  # [I, V]
    p = np.zeros((len(tokens), p_inner.shape[-1]))  # [N, V] (rows of leaves unused)
    p[inner] = p_inner
    entropy = -(p * np.log(p + 1e-5)).sum(-1)  # [N]
    limit = np.minimum(threshold, alpha * np.exp(-entropy))  # [N] per parent node
    parent = np.maximum(tree.parents, 0)  # [N]
    p_tok = p[parent, np.asarray(tokens)]  # [N] p_parent(candidate)
    kept = p_tok > limit[parent]
    kept[0] = True
    rows = tree.retrieve  # [L, D+1]
    ok = np.where(rows >= 0, kept[np.maximum(rows, 0)], False)
    lengths = np.cumprod(ok, axis=1).sum(1)  # [L]
    longest = lengths == lengths.max()
    logp = np.where(np.arange(rows.shape[1]) < lengths[:, None], np.log(p_tok[np.maximum(rows, 0)] + 1e-30), 0.0)
    logp[:, 0] = 0.0  # the root is not a candidate
    best = int(np.argmax(np.where(longest, logp.sum(1), -np.inf)))
    path = rows[best, 1 : lengths[best]].copy()
    last = path[-1] if path.size else 0
    return path, int(sample(probs(logits[last][None], params), rng)[0])
