"""Candidate trees: compilation, masks, bad specs, tree-mask logits, and the tree verifiers."""
import json

import numpy as np
import pytest

from specrt.runtime.sampling import SamplingParams
from specrt.trees import (DEFAULT_SIZES, TreeError, compile_tree, default_tree, greedy_tree, load_tree,
                                 unpack_mask)
from specrt.runtime.verify import verify_tree_greedy, verify_tree_sampled, verify_tree_typical
from reference import fresh_logits, fresh_runner, tree_logits

CHAIN = [[0] * d for d in range(1, 8)]  # deep, chain only: 8 nodes, depth 7
WIDE = [[r] for r in range(15)]  # wide: 16 nodes, depth 1
SMALL = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def random_choices(seed: int, n: int, depth: int, width: int) -> list:
    rng = np.random.default_rng(seed)
    paths = {()}
    while len(paths) < n:
        parent = list(paths)[rng.integers(len(paths))]
        if len(parent) < depth:
            paths.add(parent + (int(rng.integers(width)),))
    return [list(p) for p in paths if p]


TREES = {"chain": CHAIN, "wide": WIDE, "small": SMALL, "random": random_choices(0, 24, 4, 3),
         **{name: name for name in DEFAULT_SIZES}}


@pytest.mark.parametrize("name", list(TREES))
def test_compiled_tree_is_consistent(name):
    t = load_tree(TREES[name])
    n = t.size
    assert n == len(t.choices) + 1 and t.mask.shape == (n, n)
    assert t.parents[0] == -1 and all(t.parents[i] < i for i in range(1, n))  # parents first
    for i in range(1, n):
        path = t.choices[i - 1]
        assert t.depths[i] == len(path) and t.ranks[i] == path[-1]
        assert t.parents[i] == (0 if len(path) == 1 else t.choices.index(path[:-1]) + 1)
        ancestors = {i}
        j = i
        while j > 0:
            j = t.parents[j]
            ancestors.add(j)
        assert set(np.flatnonzero(t.mask[i])) == ancestors  # the node and exactly its ancestors
    for i in range(n):
        assert sorted(c for c in t.children[i] if c >= 0) == sorted(np.flatnonzero(t.parents == i).tolist())
    leaves = [i for i in range(n) if t.children[i, 0] < 0]
    assert sorted(r[r >= 0][-1] for r in t.retrieve) == leaves  # one row per leaf ...
    for row in t.retrieve:
        row = row[row >= 0]
        assert row[0] == 0 and all(t.parents[b] == a for a, b in zip(row, row[1:]))  # ... a root path
    np.testing.assert_array_equal(unpack_mask(t.packed, n), t.mask)
    assert t.packed.dtype == np.int32 and t.packed.shape == (n, -(-n // 32))
    assert t.topk.tolist() == [max(t.ranks[t.depths == d]) + 1 for d in range(1, t.depth + 1)]
    assert compile_tree(t.to_json()["choices"], t.name).choices == t.choices
    with pytest.raises(ValueError):
        t.mask[0, 0] = False  # frozen arrays


def test_default_trees_have_their_sizes():
    for name, n in DEFAULT_SIZES.items():
        t = default_tree(name)
        assert t.size == n and t.depth <= 4
    bits = default_tree("medusa-64").packed
    assert (bits < 0).any()  # bit 31 is used: the int32 view really is the packed uint32


def test_greedy_tree_maximises_expected_length():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    choices = greedy_tree(acc, 6)
    t = compile_tree(choices)  # valid (every prefix present)

    def expected(ch):
        return sum(np.prod([acc[d][r] for d, r in enumerate(p)]) for p in ch)

    # brute force over all valid 5-path trees of depth <= 3, ranks < 3
    import itertools

    paths = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    best = max(expected(c) for c in itertools.combinations(paths, 5)
               if all(len(p) == 1 or p[:-1] in c for p in c))
    assert t.size == 6 and expected([tuple(c) for c in choices]) == pytest.approx(best)


@pytest.mark.parametrize("choices,message", [
    ([[0], [0, 1, 0]], "prefix \\[0, 1\\] is missing"),
    ([[1, 0]], "prefix \\[1\\] is missing"),
    ([[0], [1], [0]], "duplicate path \\[0\\]"),
    ([], "non-empty list"),
    ([[0], []], "not a non-empty list"),
    ([[0], [-1]], "ranks >= 0"),
    ([[0], [True]], "ranks >= 0"),
    ("[[0]]", "neither a default tree"),
])
def test_bad_trees_raise_clear_errors(choices, message):
    with pytest.raises(TreeError, match=message):
        load_tree(choices) if isinstance(choices, str) else compile_tree(choices)


def test_tree_json_files(tmp_path):
    (tmp_path / "mine.json").write_text(json.dumps(SMALL))
    (tmp_path / "obj.json").write_text(json.dumps({"choices": SMALL}))
    assert load_tree(tmp_path / "mine.json").choices == load_tree(tmp_path / "obj.json").choices == compile_tree(SMALL).choices
    assert load_tree(str(tmp_path / "mine.json")).name == "mine"
    (tmp_path / "bad.json").write_text("[[0], [")
    with pytest.raises(TreeError, match="not valid JSON"):
        load_tree(tmp_path / "bad.json")
    (tmp_path / "gap.json").write_text(json.dumps([[0], [2, 0]]))
    with pytest.raises(TreeError, match="gap.*prefix \\[2\\] is missing"):
        load_tree(tmp_path / "gap.json")
    with pytest.raises(TreeError, match="unknown tree"):
        default_tree("medusa-7")


# ---- tree-mask logits equal plain chains ----------------------------------------------------------
@pytest.fixture(scope="module")
def target(build_engine):
    import specrt

    e = build_engine("tree_mask", dict(arch="llama", seed=3, scale=5.0), max_len=128, prefill_chunk=8)
    return specrt.load(e).target  # a Graph: engine + spec


@pytest.mark.parametrize("name", list(TREES))
def test_tree_logits_equal_root_path_chains(target, name):
    """Logits at every node of ONE tree pass equal those of running its root path as a plain chain."""
    tree = load_tree(TREES[name])
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 32, 11).tolist()
    tokens = rng.integers(0, 32, tree.size)  # [N] node 0 = root
    tokens[0] = prompt[-1]
    logits = tree_logits(fresh_runner(target, 128), prompt[:-1], tokens, tree)  # [N, V]
    for i in range(tree.size):
        path = np.flatnonzero(tree.mask[i])  # root .. i
        chain = fresh_logits(target, prompt[:-1] + tokens[path].tolist(), 128)
        np.testing.assert_allclose(logits[i], chain, atol=1e-4, err_msg=f"node {i} of {name}")


# ---- verifiers on synthetic logits -------------------------------------------------------------------
def peaked(n, v, best, scale=50.0):
    logits = np.zeros((n, v), np.float32)
    logits[np.arange(n), best] = scale
    return logits


def test_greedy_walk_takes_the_matching_non_leftmost_path():
    t = compile_tree(SMALL)  # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
    tokens = np.array([9, 4, 5, 6, 7, 8, 3])
    best = np.array([5, 0, 8, 1, 2, 11, 12])  # root -> 5 (node 2), node 2 -> 8 (node 5), leaf 5 -> 11 (bonus)
    path, nxt = verify_tree_greedy(t, tokens, peaked(7, 16, best))
    assert path.tolist() == [2, 5] and nxt == 11
    best[0] = 15  # no child of the root matches: recovered token 15
    path, nxt = verify_tree_greedy(t, tokens, peaked(7, 16, best))
    assert path.tolist() == [] and nxt == 15


def test_sampled_walk_on_certain_distributions_matches_greedy():
    t = compile_tree(SMALL)
    tokens = np.array([9, 4, 5, 6, 7, 8, 3])
    best = np.array([4, 7, 8, 1, 14, 11, 12])  # root -> node 1 -> node 4 (leaf) -> bonus 14
    params = SamplingParams(temperature=1.0)
    for seed in range(5):
        path, nxt = verify_tree_sampled(t, tokens, peaked(7, 16, best), params, np.random.default_rng(seed))
        assert path.tolist() == [1, 4] and nxt == 14
        assert verify_tree_greedy(t, tokens, peaked(7, 16, best))[0].tolist() == [1, 4]


def test_typical_acceptance_keeps_plausible_candidates():
    t = compile_tree(SMALL)
    tokens = np.array([9, 4, 5, 6, 7, 8, 3])
    logits = np.zeros((7, 16), np.float32)  # flat: every candidate has p = 1/16 > alpha * exp(-H) = 0.3/16
    path, _ = verify_tree_typical(t, tokens, logits, SamplingParams(temperature=1.0), np.random.default_rng(0))
    assert path.tolist() == [1, 3, 6]  # longest path, leftmost on ties
    path, nxt = verify_tree_typical(t, tokens, peaked(7, 16, np.full(7, 15)), SamplingParams(temperature=1.0),
                                    np.random.default_rng(0))
    assert path.tolist() == [] and nxt == 15  # peaked elsewhere: nothing kept
