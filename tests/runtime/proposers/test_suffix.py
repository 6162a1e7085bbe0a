"""Suffix decoding: the index, the proposal walk, the bounded global cache, exactness through the core."""
import numpy as np
import pytest

import specrt
from reference import assert_batched_rows_equal_batch1
from specrt.runtime.proposers.suffix import SuffixCache, SuffixIndex, propose
from stat_harness import P_MIN, exactness

V = 16
TARGET = dict(arch="llama", vocab_size=V, seed=0, scale=10.0, eos_token_id=None)
WEAK_DRAFT = dict(arch="llama", vocab_size=V, seed=1, hidden=16, layers=1, scale=10.0, eos_token_id=None)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def engine(build_engine):
    return build_engine("exact_weak", TARGET, WEAK_DRAFT, gamma=3, max_len=32)  # (shared with test_exactness)


def test_index_counts_continuations_and_uncounts_them():
    idx = SuffixIndex(depth=2)
    seq = [1, 2, 3, 1, 2, 4]
    idx.add(seq, 0, len(seq))
    assert idx.next[(1, 2)] == {3: 1, 4: 1} and idx.next[(2,)] == {3: 1, 4: 1} and idx.next[(3, 1)] == {2: 1}
    assert idx.longest([9, 1, 2]) == (2, {3: 1, 4: 1})
    assert idx.longest([7]) == (0, None)
    idx.add(seq, 0, len(seq), sign=-1)
    assert idx.next == {}


def test_the_longest_match_by_binary_search_is_the_longest_by_scan():
    """Random sequences over a small alphabet, some evicted from a bounded cache: the binary search in
    ``longest`` finds what scanning every length does."""
    rng = np.random.default_rng(0)
    cache = SuffixCache(depth=8, max_tokens=300)
    for _ in range(12):
        cache.add(rng.integers(0, 4, int(rng.integers(5, 80))).tolist())  # later ones evict earlier ones
    index = cache.index
    for _ in range(300):
        context = rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
        scan = next(((n, index.next[tuple(context[-n:])]) for n in range(min(8, len(context)), 0, -1)
                     if index.next.get(tuple(context[-n:]))), (0, None))
        assert index.longest(context) == scan


def test_the_docstrings_worked_example():
    shared, local = SuffixIndex(3), SuffixIndex(3)
    shared.add([7, 1, 2, 3, 4], 0, 5)
    local.add([9, 1, 2], 0, 3)
    assert propose(local, shared, [9, 1, 2], k=4, factor=1.0, min_prob=0.1) == [3, 4]
    assert propose(local, shared, [9, 1, 2], k=4, factor=0.5, min_prob=0.1) == [3]  # length follows the match
    assert propose(local, None, [9, 1, 2], k=4, factor=1.0, min_prob=0.1) == []


def test_most_frequent_continuation_and_the_probability_floor():
    idx = SuffixIndex(4)
    for tail in ([5, 6], [5, 6], [5, 7], [8, 6]):
        idx.add([1, 2, *tail], 0, 4)
    assert propose(idx, None, [1, 2], k=3, factor=2.0, min_prob=0.1) == [5, 6]  # 5 (3 of 4), then 6 (2 of 3)
    assert propose(idx, None, [1, 2], k=3, factor=2.0, min_prob=0.6) == [5]  # 0.75 * 0.67 = 0.5 < 0.6


def test_global_cache_is_bounded_and_evicts_the_oldest():
    cache = SuffixCache(depth=4, max_tokens=100)
    rng = np.random.default_rng(0)
    for _ in range(50):
        cache.add(rng.integers(0, 50, size=30).tolist())
        assert cache.tokens <= 100
    assert len(cache.sequences) == 3
    ref = SuffixIndex(4)
    for seq in cache.sequences:
        ref.add(seq, 0, len(seq))
    assert cache.index.next == ref.next  # evicted sequences left nothing behind


def test_a_repeated_request_drafts_more_from_the_global_cache(engine):
    rt = specrt.load(engine)
    prompt = [3, 1, 4, 1, 5]
    first = rt.generate(prompt, max_new_tokens=24, method="suffix", gamma=3)
    second = rt.generate(prompt, max_new_tokens=24, method="suffix", gamma=3)
    assert second.token_ids == first.token_ids == rt.generate(prompt, max_new_tokens=24, method="none").token_ids
    assert second.stats["accepted"] > first.stats["accepted"]
    assert second.stats["tokens_per_pass"] > first.stats["tokens_per_pass"]
    assert 0 < second.stats["c"] < 100


def test_global_cache_is_per_scope(engine):
    """A request draws only on earlier sequences of its own cache scope (the server's API key): the
    same request in another scope drafts as a first request does, a repeat in its own scope more."""
    from specrt.runtime.core import CoreConfig, DecodeCore, SequenceRequest
    from specrt.runtime.sampling import SamplingParams

    core = specrt.load(engine).new_core(CoreConfig(max_batch=2, method="suffix", gamma=3, calibrate=False))

    def run(scope: str, i: int) -> dict:
        update = core.add(SequenceRequest(f"r{i}", [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=24), scope))
        while not update.finish_reason:
            update = core.step()[0][0]
        return update

    first, other, again = run("key-0", 0), run("key-1", 1), run("key-0", 2)
    assert first.token_ids == other.token_ids == again.token_ids
    assert other.stats["accepted"] == first.stats["accepted"] < again.stats["accepted"]
    assert set(core.proposer.caches) == {"key-0", "key-1"}
    assert all(len(c.sequences) == n for c, n in zip(core.proposer.caches.values(), (2, 1)))


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)], ids=str)
def test_suffix_sampling_is_exact(engine, sampling):
    """Every trial re-emits the same prompt, so the global cache proposes from earlier trials' outputs."""
    pv, totals = exactness(specrt.load(engine), engine.parent / "target", PROMPT, V, sampling, method="suffix", gamma=2)
    assert min(pv.values()) > P_MIN, pv
    assert totals["proposed"] > 0


def test_batched_suffix_rows_equal_batch1_greedy(engine):
    rt = specrt.load(engine)
    prompts = [PROMPT, PROMPT[:5] * 2, [2, 7, 1, 8, 2, 8]]
    assert_batched_rows_equal_batch1(rt, "suffix", prompts, [12, 7, 10], gamma=3)
