"""InPlaceRunner (the fused graph's cache, written by the graph) against HostRunner (the traced graph's
cache, appended by numpy): the same logits through batches, rollbacks, tree compaction and slot moves."""
import numpy as np
import pytest

from specrt.export.onnx_export import example_tree_mask
from specrt.runtime.in_place import InPlaceRunner, consecutive_runs
from specrt.runtime.runner import CacheFullError, HostRunner
from specrt.runtime.api import Runtime

TOL = 1e-4
TARGET = dict(arch="llama", hidden=64, scale=20.0)  # head_dim 16: the fused graph


@pytest.fixture(scope="module")
def runners(build_engine):
    """(in-place, host) runners of 3 slots over the same model, the in-place cache's stale part all NaN."""
    fused = Runtime.load(build_engine("inplace_fused", TARGET, max_len=48, graph="fused"))
    traced = Runtime.load(build_engine("inplace_traced", TARGET, max_len=48, graph="traced"))

    def make():
        a, b = fused.runner("target", 3)[0], traced.runner("target", 3)[0]
        assert isinstance(a, InPlaceRunner) and isinstance(b, HostRunner)
        a.data[:] = np.nan  # a stale entry that leaked into a result would show
        return a, b

    return make


def both(pair, *args, **kw):
    """forward on both runners; asserts equal logits; returns both passes."""
    a, b = (r.forward(*args, **kw) for r in pair)
    np.testing.assert_allclose(a.logits, b.logits, atol=TOL, rtol=0)
    assert np.isfinite(a.logits).all()
    return a, b


def test_batches_rollbacks_trees_and_moves_match_the_host_runner(runners):
    pair = runners()
    prompts = [[3, 5, 7, 9, 11, 13, 15], list(range(1, 13)), [2, 4, 6]]
    for slot, p in enumerate(prompts):
        for r in pair:
            r.prefill(slot, p)
    passes = both(pair, [0, 1, 2], [[1], [2], [3]])  # Q = 1 over rows of lengths 7, 12, 3
    for r, p in zip(pair, passes):
        r.commit(p)
    passes = both(pair, [0, 2], [[4, 5, 6, 7], [8, 9, 10, 11]])  # chains over non-consecutive slots
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 1], [0]])  # keep 2 and 1: the rest rolled back
    mask = example_tree_mask().numpy()
    depths = mask.sum(-1) - 1
    passes = both(pair, [1], [np.arange(20, 28)], blocks=[mask], depths=[depths])
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 2, 5, 7]])  # the root and the path 2 -> 5 -> 7: compacted
    both(pair, [0, 1, 2], [[5], [6], [7]])
    for r in pair:
        r.move(2, 0)
        r.release(1)
    assert pair[0].lengths.tolist() == pair[1].lengths.tolist() == [5, 0, 0]  # slot 2: 3 + 1 + 1
    both(pair, [0], [[1, 2, 3]])


def test_padding_past_the_cache_is_cut_and_a_full_cache_refused(runners):
    pair = runners()
    a = pair[0]
    for r in pair:
        r.prefill(0, [i % 31 + 1 for i in range(46)])  # max_len 48: room for 2
    p = a.forward([0], [[1, 2, 3, 4, 5]])
    ref = pair[1].forward([0], [[1, 2, 3, 4, 5]])
    np.testing.assert_allclose(p.logits[0, :2], ref.logits[0, :2], atol=TOL, rtol=0)
    with pytest.raises(CacheFullError):
        a.commit(p)
    a.commit(p, [[0, 1]])
    assert a.room(0) == 0


def test_consecutive_runs():
    assert [r.tolist() for r in consecutive_runs(np.array([3, 4, 7, 8, 9, 1]))] == [[0, 1], [2, 3, 4], [5]]


def test_chain_calls_through_bound_arrays_interleaved_with_tree_calls(runners):
    """Decode steps and chain verifies (arrays bound once per Q, only the mask rebound) stay equal to the host
    runner when tree calls and rollbacks on the same slot rebind the graph in between."""
    pair = runners()
    for r in pair:
        r.prefill(0, [3, 5, 7])
    mask = example_tree_mask().numpy()
    depths = mask.sum(-1) - 1
    for step, ids in enumerate([[1], [2, 3, 4, 5], [6], [7, 8, 9, 10], [11, 12], [13]]):
        passes = both(pair, [0], [ids])
        for r, p in zip(pair, passes):
            r.commit(p, [list(range(min(len(ids), 1 + step % 2)))])  # keep 1 or 2: the rest rolled back
        if step % 3 == 2:
            passes = both(pair, [0], [np.arange(20, 28)], blocks=[mask], depths=[depths])
            for r, p in zip(pair, passes):
                r.commit(p, [[0, 2]])
    assert pair[0].lengths.tolist() == pair[1].lengths.tolist()
