"""What a grammar does to proposals, for every method in one place (the decode core applies it).

    prune   a proposal loses what the grammar forbids BEFORE the target pass: a chain is cut at its
            first forbidden token (its q rows with it); a tree loses its forbidden nodes and their
            subtrees and is rebuilt as the smaller tree of the nodes left (``compile_tree`` of their
            paths: node order, masks and depths as for any tree). Pruning depends only on the proposal
            and the history, so a deterministic proposal (n-gram, suffix, heads) stays exactly verified;
            a sampled draft chain is never cut, since its q is masked like p (its tokens are allowed).
    forced  when the grammar forces the next tokens (llguidance's fast-forward tokens at the committed
            state), they are a chain of point masses (a grammar with one allowed token accepts them with
            probability 1). They are the row's proposal, whatever its method, where the method would
            propose nothing or no more (``forced_first``: decided before anything is drawn), and they
            replace a deterministic chain that does not extend them (``with_forced``); a sampled draft
            chain or a tree, once drawn, stays (choosing between a sampled chain and the forced one by
            the sample's value would bias it).

Worked example, regex ``(ab|ba)c*`` after "a": forced -> [b]; an n-gram chain [b, a, c] is cut to [b].
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np

from ...trees import Tree, compile_tree
from . import EMPTY, Proposal


def prune(p: Proposal, matcher) -> Proposal:
    """``p`` without what ``matcher`` (a constraints.Matcher at the row's committed state) forbids; ``p``
    itself when it loses nothing or the row has no grammar (matcher None)."""
    if matcher is None or not len(p.tokens):
        return p
    if p.tree is None:
        n = allowed_length(p.tokens, matcher)
        return p if n == len(p.tokens) else replace(p, tokens=p.tokens[:n], q=None if p.q is None else p.q[:n])
    return prune_tree(p, matcher)


def allowed_length(tokens: np.ndarray, matcher) -> int:
    """How many leading tokens of a chain the grammar allows (each after the ones before it)."""
    for i, tok in enumerate(tokens):
        allowed = matcher.allowed(tokens[:i])
        if allowed is not None and not allowed[tok]:
            return i
    return len(tokens)


def prune_tree(p: Proposal, matcher) -> Proposal:
    """A tree proposal without its forbidden nodes (a node is kept when its parent is and the grammar allows
    its token after the parent's path); EMPTY when no child of the root is left."""
    tree, prefixes = p.tree, p.prefixes()  # prefixes[i]: node i's path, its own token included
    keep = np.zeros(tree.size, bool)
    keep[0] = True
    for i in range(1, tree.size):  # parents precede children
        parent = tree.parents[i]
        if keep[parent]:
            allowed = matcher.allowed(prefixes[parent])
            keep[i] = allowed is None or bool(allowed[p.tokens[i - 1]])
    if keep.all():
        return p
    nodes = np.flatnonzero(keep[1:]) + 1  # kept nodes, in node order
    if not len(nodes):
        return EMPTY
    return Proposal(p.tokens[nodes - 1], None, subtree(tree, tuple(tree.choices[i - 1] for i in nodes)))


@lru_cache(maxsize=256)
def _compiled(choices: tuple, name: str) -> Tree:
    return compile_tree([list(c) for c in choices], name)


def subtree(tree: Tree, choices: tuple) -> Tree:
    """The tree of ``choices`` (a subset of ``tree.choices`` closed under parents, in its order); node j + 1
    of the result is choices[j] (compile_tree's (depth, path) order keeps the subset's order)."""
    return _compiled(choices, tree.name)


def forced(matcher, cap: int) -> Proposal | None:
    """The grammar's forced tokens at the committed state as a chain of at most ``cap`` point masses (None:
    nothing forced, or no room)."""
    tokens = matcher.forced()[:cap] if cap > 0 else []
    return Proposal(np.array(tokens, np.int64), forced=True) if tokens else None


def forced_first(f: Proposal | None, k: int, proposer) -> bool:
    """Whether the forced chain ``f`` is the row's proposal before its method proposes: the method would propose
    nothing (k 0: method "none", γ 0, no room) or no more tokens than ``f`` (k; a tree: its depth)."""
    return f is not None and len(f.tokens) >= (proposer.depth if k and proposer.tree else k)


def with_forced(p: Proposal, f: Proposal | None) -> Proposal:
    """The method's (pruned) proposal ``p`` or the forced chain ``f``: a deterministic chain gives way to ``f``
    unless it starts with it and says more; a sampled chain and a tree stay."""
    if f is None or p.q is not None or p.tree is not None:
        return p
    n = len(f.tokens)
    return p if len(p.tokens) > n and p.tokens[:n].tolist() == f.tokens.tolist() else f
