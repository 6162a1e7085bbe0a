"""Verification: one module for every proposal, a chain (modified rejection sampling) or a tree (the
exact node walk); ``verify`` takes one row's proposal and the target pass's logits over it.

Chains.

Terms (as in vLLM's rejection sampler):
    accepted token   a proposed token x_i the target keeps. Accepted tokens are a prefix of
                     the proposal: the first rejection ends the round.
    recovered token  the token emitted at the first rejected position i, sampled from the
                     residual norm(max(0, p_i - q_i)); it replaces x_i.
    bonus token      when all k proposals are accepted, one more token sampled from p_k, the
                     target's distribution after the last proposal (the verify pass computed it).
A round therefore always emits n_accepted + 1 tokens.

Exactness: x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); then
P(emit z) = min(q(z), p(z)) + max(0, p(z) - q(z)) = p(z) (see the reference text's proof).
Deterministic proposals (n-gram, top-1 heads) have q = a point mass on x_i: the rule then
accepts with probability p(x_i) and recovers from p with x_i removed, which is the same as
"sample y ~ p; accept if y == x_i, else emit y". Greedy decoding accepts while x_i is the
target's argmax and emits the argmax at the first mismatch; it is kept on its own path.

Trees.

The tree's root (node 0) is the last emitted token; nodes 1..N-1 hold deterministic candidates
(deterministic proposals: n-gram lookups, Medusa or EAGLE top-k tokens). The target pass gives logits at every node: row i is the
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

from .sampling import SamplingParams, next_token, probs, sample
from ..trees import Tree

ACCEPTANCE = ("exact", "typical")  # "typical" (Medusa-2) is lossy: opt-in only
NO_PATH = np.zeros(0, dtype=np.int64)  # no proposal accepted


def verify_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """draft_tokens: int [k]; target_logits: [k + 1, V]. Returns (n_accepted, next_token)."""
    best = target_logits.argmax(-1)  # [k + 1] target's argmax at each position
    k = len(draft_tokens)
    mismatch = np.flatnonzero(best[:k] != np.asarray(draft_tokens))  # [m] rejected positions
    n = int(mismatch[0]) if mismatch.size else k
    return n, int(best[n])


def verify_sampled(draft_tokens: np.ndarray, draft_probs: np.ndarray | None, target_probs: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """Modified rejection sampling over a chain.

    draft_tokens: int [k]; draft_probs: q [k, V], or None for deterministic proposals (point
    masses); target_probs: p [k + 1, V] from the same ``probs()``. Returns (n_accepted, next_token).
    """
    x = np.asarray(draft_tokens, dtype=np.int64)  # [k]
    k = len(x)
    rows = np.arange(k)
    p_x = target_probs[rows, x]  # [k] p_i(x_i)
    q_x = draft_probs[rows, x] if draft_probs is not None else np.ones(k)  # [k] q_i(x_i)
    u = rng.random(k)  # [k]
    accept = u * q_x < p_x  # [k] u < p/q without dividing by q
    rejected = np.flatnonzero(~accept)
    if not rejected.size:
        return k, int(sample(target_probs[k][None], rng)[0])  # bonus token
    n = int(rejected[0])
    residual = target_probs[n].copy()  # [V]
    if draft_probs is not None:
        residual = np.maximum(residual - draft_probs[n], 0.0)
    else:
        residual[x[n]] = 0.0
    if residual.sum() <= 1e-12:  # p == q up to rounding: rejection had ~0 probability
        residual = target_probs[n]
    return n, int(sample(residual[None], rng)[0])  # recovered token



def kept_lengths(tree: Tree, kept: np.ndarray) -> np.ndarray:
    """kept: bool [N] (root True). Per root-to-leaf path (``tree.retrieve`` row, [L, D+1]) how many of
    its nodes are kept from the root on, root included: int [L]."""
    rows = tree.retrieve  # [L, D+1]
    ok = np.where(rows >= 0, kept[np.maximum(rows, 0)], False)  # [L, D+1]
    return np.cumprod(ok, axis=1).sum(1)


def _longest_path(tree: Tree, kept: np.ndarray) -> np.ndarray:
    """kept: bool [N] (root True). Node indices (root excluded) of the longest root path whose
    nodes are all kept; ties: the first retrieve row (smaller ranks)."""
    lengths = kept_lengths(tree, kept)  # [L]
    best = int(np.argmax(lengths))
    return tree.retrieve[best, 1 : lengths[best]].copy()


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
    lengths = kept_lengths(tree, kept)  # [L]
    longest = lengths == lengths.max()
    logp = np.where(np.arange(rows.shape[1]) < lengths[:, None], np.log(p_tok[np.maximum(rows, 0)] + 1e-30), 0.0)
    logp[:, 0] = 0.0  # the root is not a candidate
    best = int(np.argmax(np.where(longest, logp.sum(1), -np.inf)))
    path = rows[best, 1 : lengths[best]].copy()
    last = path[-1] if path.size else 0
    return path, int(sample(probs(logits[last][None], params), rng)[0])


def verify(proposal, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           acceptance: str = "exact") -> tuple[np.ndarray, int]:
    """One row's round. proposal: ``proposers.Proposal`` (k tokens: a chain, or tree nodes 1..k);
    logits: float [k + 1, V], the target pass at the root (the last emitted token) and at each node.

    Returns (accepted node indices int64 [n] in 1..k, next token): the pass's positions
    ``[0, *path]`` are what the cache keeps. A chain's path is 1..n.
    """
    tree = proposal.tree
    if not len(proposal.tokens):  # nothing proposed: a plain decode step
        return NO_PATH, next_token(logits[0], params, rng)
    if tree is None:
        if params.greedy:
            n, nxt = verify_greedy(proposal.tokens, logits)
        else:
            n, nxt = verify_sampled(proposal.tokens, proposal.q, probs(logits, params), rng)
        return np.arange(1, n + 1, dtype=np.int64), nxt
    tokens = np.concatenate([[-1], proposal.tokens])  # [N]: node 0 is the root
    if params.greedy:
        return verify_tree_greedy(tree, tokens, logits)
    if acceptance == "typical":
        return verify_tree_typical(tree, tokens, logits, params, rng)
    return verify_tree_sampled(tree, tokens, logits, params, rng)
