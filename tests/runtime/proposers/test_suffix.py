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


@pytest.fixture(scope="module")
def native():
    from specrt.runtime.proposers.suffix import native_available

    if not native_available():
        pytest.skip("suffix decoding's native index needs a C++17 compiler (g++ or $CXX)")


def test_the_native_index_answers_as_the_python_one(native):
    """Random sequences over small alphabets through two bounded caches (evictions, merged request indexes) and
    request indexes: the native index (custom_ops/suffix.py) finds the same longest matches and counts, and the
    native walk proposes what the Python one does, at several factors and floors."""
    from specrt.runtime.proposers.suffix import new_index

    rng = np.random.default_rng(1)
    for alphabet, depth in ((3, 4), (6, 8), (50, 24)):
        caches = {kind: SuffixCache(depth, 400, new_index(depth, kind)) for kind in (False, True)}
        for _ in range(15):
            seq = rng.integers(0, alphabet, int(rng.integers(2, 90))).tolist()
            for kind, cache in caches.items():
                own = new_index(depth, kind)
                own.add(seq, 0, len(seq) // 2)
                own.add(seq, len(seq) // 2, len(seq))
                cache.add(seq, counted=own if len(seq) % 2 else None)  # merged, or counted again
        python, native = caches[False].index, caches[True].index
        assert len(native) == len(python)
        local = {kind: new_index(depth, kind) for kind in (False, True)}
        for kind in local:
            local[kind].add(seq[::-1], 0, len(seq))
        for _ in range(200):
            context = rng.integers(0, alphabet, int(rng.integers(0, 30))).tolist()
            assert native.longest(context) == python.longest(context)
            for factor, min_prob in ((1.0, 0.1), (3.0, 0.0), (0.5, 0.5)):
                args = (context, 8, factor, min_prob)
                assert propose(local[True], [native], *args) == propose(local[False], [python], *args)


def test_the_docstrings_worked_example():
    shared, local = SuffixIndex(3), SuffixIndex(3)
    shared.add([7, 1, 2, 3, 4], 0, 5)
    local.add([9, 1, 2], 0, 3)
    assert propose(local, [shared], [9, 1, 2], k=4, factor=1.0, min_prob=0.1) == [3, 4]
    assert propose(local, [shared], [9, 1, 2], k=4, factor=0.5, min_prob=0.1) == [3]  # length follows the match
    assert propose(local, [], [9, 1, 2], k=4, factor=1.0, min_prob=0.1) == []


def test_most_frequent_continuation_and_the_probability_floor():
    idx = SuffixIndex(4)
    for tail in ([5, 6], [5, 6], [5, 7], [8, 6]):
        idx.add([1, 2, *tail], 0, 4)
    assert propose(idx, [], [1, 2], k=3, factor=2.0, min_prob=0.1) == [5, 6]  # 5 (3 of 4), then 6 (2 of 3)
    assert propose(idx, [], [1, 2], k=3, factor=2.0, min_prob=0.6) == [5]  # 0.75 * 0.67 = 0.5 < 0.6


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
    merged = SuffixCache(depth=4, max_tokens=100)  # a finished request's own index merged, not counted again
    for seq in cache.sequences:
        own = SuffixIndex(4)
        own.add(seq, 0, 7)
        own.add(seq, 7, len(seq))  # indexed as it was generated
        merged.add(seq, counted=own)
    assert merged.index.next == ref.next


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


def test_the_python_and_native_proposers_decode_alike(engine, native):
    """The same requests through a core on each index: the same tokens (plain greedy's) and the same proposals
    (equal proposed and accepted counts), the second request drawing on the first's in the global cache."""
    from specrt.runtime.core import CoreConfig, SequenceRequest
    from specrt.runtime.proposers.suffix import SuffixProposer
    from specrt.runtime.sampling import SamplingParams

    rt = specrt.load(engine)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8] * 2]
    runs = {}
    for kind in (False, True):
        core = rt.new_core(CoreConfig(max_batch=1, method="suffix", gamma=3, calibrate=False),
                           proposer=SuffixProposer(3, native=kind))
        runs[kind] = []
        for i, prompt in enumerate(prompts):
            update = core.add(SequenceRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=20)))
            while not update.finish_reason:
                update = core.step()[0][0]
            runs[kind].append((update.token_ids, update.stats["proposed"], update.stats["accepted"]))
    assert runs[False] == runs[True]
    for prompt, (tokens, proposed, _) in zip(prompts, runs[True]):
        assert tokens == rt.generate(prompt, max_new_tokens=20, method="none").token_ids
    assert runs[True][1][1] > 0


def test_a_corpus_proposes_for_every_scope_and_output_is_unchanged(engine):
    """A fixed corpus holding the request's own continuation: the first request of any scope drafts from it,
    and greedy output is plain greedy output."""
    from specrt.runtime.core import CoreConfig, SequenceRequest
    from specrt.runtime.proposers.suffix import SuffixProposer, corpus_index
    from specrt.runtime.sampling import SamplingParams

    rt = specrt.load(engine)
    prompt = [3, 1, 4, 1, 5]
    plain = rt.generate(prompt, max_new_tokens=24, method="none").token_ids
    corpus = corpus_index([prompt + plain])

    def first_request(proposer, scope: str):
        core = rt.new_core(CoreConfig(max_batch=1, method="suffix", gamma=3, calibrate=False), proposer=proposer)
        update = core.add(SequenceRequest("r", prompt, SamplingParams(max_new_tokens=24), scope))
        while not update.finish_reason:
            update = core.step()[0][0]
        return update

    without = first_request(SuffixProposer(3), "key-0")
    for scope in ("key-0", "key-1"):
        with_corpus = first_request(SuffixProposer(3, corpus=corpus), scope)
        assert with_corpus.token_ids == without.token_ids == plain
        assert with_corpus.stats["accepted"] > without.stats["accepted"]


def test_corpus_files_read_as_jsonl_records_or_whole_text(tmp_path, engine):
    from specrt.runtime.core import CoreConfig
    from specrt.runtime.proposers.suffix import corpus_index, read_corpus

    (tmp_path / "c.jsonl").write_text('{"text": "abc"}\n\n{"text": "bcd", "kind": "code"}\n')
    (tmp_path / "c.txt").write_text("line one\nline two\n")
    assert read_corpus(tmp_path / "c.jsonl") == ["abc", "bcd"]
    assert read_corpus(tmp_path / "c.txt") == ["line one\nline two\n"]
    rt = specrt.load(engine)
    core = rt.new_core(CoreConfig(max_batch=1, method="suffix", calibrate=False, suffix_corpus=str(tmp_path / "c.jsonl")))
    expected = corpus_index((rt.tokenizer.encode(t, add_special_tokens=False).ids for t in ("abc", "bcd")), native=False)
    got = core.proposer.corpus  # native where it builds: compared through what it answers
    assert len(got) == len(expected) and all(got.longest(ctx) == expected.longest(ctx) for ctx in expected.next)
    assert rt.suffix_corpus(tmp_path / "c.jsonl") is core.proposer.corpus  # read once per Runtime


@pytest.mark.parametrize("content, error", [('{"text": "a"}\n[1, 2]\n', "line 2"), ('{"text": 3}\n', "line 1"),
                                            ("", None)])
def test_bad_corpus_files_are_clear_errors(tmp_path, content, error):
    from specrt.runtime.proposers.suffix import read_corpus

    path = tmp_path / "c.jsonl"
    path.write_text(content)
    if error is None:
        assert read_corpus(path) == []
        return
    with pytest.raises(ValueError, match=f"{path}.*{error}"):
        read_corpus(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_corpus(tmp_path / "missing.jsonl")


def test_a_corpus_needs_method_suffix(engine, tmp_path):
    from specrt.runtime.core import CoreConfig
    from specrt.runtime.sampling import SamplingError

    with pytest.raises(SamplingError, match="suffix corpus is for method 'suffix'"):
        specrt.load(engine).new_core(CoreConfig(max_batch=1, method="ngram", suffix_corpus=str(tmp_path / "c.txt")))
