"""Automatic prefix caching (runtime/prefix_cache.py): a prompt that starts with tokens a free slot kept (or its
host-memory tier, runtime/prefix_store.py, copied) skips their prefill, and the output is a cold run's (greedy token
for token, seeded sampling the same draws) for every method, through the decode core, ``Runtime.generate`` and the
server."""
import httpx
import numpy as np
import pytest

import specrt
from reference import run_all
from serving import AUTH, MODEL, metrics
from specrt.runtime.core import CoreConfig, SequenceRequest
from specrt.runtime.prefix_cache import PrefixCache, Retained, shared_prefix
from specrt.runtime.sampling import SamplingParams

P1 = [(7 * i) % 30 + 1 for i in range(20)]  # 20 tokens: two prefill chunks of 16 (vocab 32)
SHORT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # the heads' engines (vocab 16, max_len 32 / 48)


def warm_core(rt, method, gamma=None, max_batch=2, prefix=True, host_mb=512):
    core = rt.new_core(CoreConfig(max_batch=max_batch, method=method, gamma=gamma, calibrate=False,
                                  prefix_cache=prefix, prefix_cache_mb=host_mb))
    core.prefix.min_hit = 4  # the tiny engines' prompts are short
    return core


def run(core, prompt, rid, params=None, n=8):
    """One request alone through ``core``: (token ids, stats)."""
    done = run_all(core, [SequenceRequest(rid, list(prompt), params or SamplingParams(max_new_tokens=n))])[rid]
    return done[0], done[3]


@pytest.fixture(scope="module")
def engines(llama_engine, llama_fused_engine):
    return {"traced": specrt.load(llama_engine), "fused": specrt.load(llama_fused_engine)}


def test_shared_prefix_and_the_swap_of_two_slots(engines):
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and shared_prefix([], [1]) == 0
    for rt in engines.values():
        runner = rt.runner("target", 3)[0]
        runner.prefill(0, P1[:5])
        runner.prefill(2, P1[5:17])
        a, b = runner.entries(0, 5).copy(), runner.entries(2, 12).copy()
        runner.swap(0, 2, 5, 12)
        assert runner.lengths.tolist() == [12, 0, 5]
        assert np.array_equal(runner.entries(0, 12), b) and np.array_equal(runner.entries(2, 5), a)
        runner.copy_entries(0, 1, 12)
        assert runner.lengths[1] == 0 and np.array_equal(runner.entries(1, 12), b)


@pytest.mark.parametrize("kind,method,gamma", [("traced", "none", None), ("traced", "draft", 3), ("traced", "ngram", 3),
                                               ("fused", "draft", None)])
def test_repeated_multi_turn_and_partial_prompts_equal_a_cold_run(engines, kind, method, gamma):
    rt = engines[kind]
    warm, cold = warm_core(rt, method, gamma), warm_core(rt, method, gamma, max_batch=1, prefix=False)
    first, _ = run(warm, P1, "a")
    turn = P1 + first + [3, 4]  # the next chat turn: prompt, answer, more
    cases = [(P1, len(P1) - 1), (turn, len(P1) + len(first) - 1), (P1[:12] + [5, 5, 5], 12)]
    for i, (prompt, cached) in enumerate(cases):
        got, stats = run(warm, prompt, f"w{i}")
        assert got == run(cold, prompt, f"c{i}")[0], (method, i)
        assert stats["cached_tokens"] == cached, (method, i)
    assert warm.prefix.hits == 3 and warm.prefix.hit_tokens == sum(c for _, c in cases)
    assert not warm.target.lengths.any()  # free slots keep their entries, not their lengths


def test_a_repeated_prompt_runs_one_target_position_and_no_draft_prefill(engines):
    rt = engines["traced"]
    warm = warm_core(rt, "draft", 3)
    run(warm, P1, "a")
    target_calls, draft_calls = warm.target.calls, warm.proposer.runner.calls
    warm.add(SequenceRequest("b", P1, SamplingParams(max_new_tokens=8)))
    assert warm.target.calls - target_calls == 1  # the last prompt token alone
    assert warm.proposer.runner.calls == draft_calls  # the draft's own cache held the whole prompt
    assert warm.proposer.runner.lengths[0] == len(P1) and warm.target.lengths[0] == len(P1)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_seeded_sampling_is_the_cold_run(engines, method):
    rt = engines["traced"]
    warm, cold = warm_core(rt, method, 3), warm_core(rt, method, 3, max_batch=1, prefix=False)
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=12)
    first, _ = run(warm, P1, "a", params)
    for i, prompt in enumerate([P1, P1 + first[:5] + [9]]):
        got, stats = run(warm, prompt, f"w{i}", params)
        assert stats["cached_tokens"] > 0
        assert got == run(cold, prompt, f"c{i}", params)[0], (method, i)


def test_a_group_of_choices_forks_the_cached_prefix(engines):
    """n choices of one prompt: one prefill of the uncached rest, the target's and the draft's caches copied to each."""
    rt = engines["traced"]
    warm, cold = warm_core(rt, "draft", 2, max_batch=3), warm_core(rt, "draft", 2, max_batch=1, prefix=False)
    run(warm, P1, "a")
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=10) for s in (1, 2)]
    tokens = run_group(warm, P1, params)
    for i, p in enumerate(params):
        assert tokens[f"g{i}"] == run(cold, P1, f"c{i}", p)[0]
    assert warm.prefix.hit_tokens == len(P1) - 1


def test_eviction_keeps_the_most_recent_prompts(engines):
    """Two slots, three prompts: the least recently used one is evicted, the others stay reusable (no host tier:
    prefix_cache_mb 0 turns it off)."""
    rt = engines["traced"]
    warm, cold = warm_core(rt, "none", host_mb=0), warm_core(rt, "none", max_batch=1, prefix=False)
    assert warm.prefix.store is None
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        warm_core(rt, "none", host_mb=-1)
    a, b, c = P1, [9, 8, 7, 6, 5, 4, 3, 2], [11, 12, 13, 14, 15, 16]
    for i, (prompt, cached) in enumerate([(a, 0), (b, 0), (c, 0), (a, 0), (c, len(c) - 1), (b, 0)]):
        got, stats = run(warm, prompt, f"w{i}")
        assert stats["cached_tokens"] == cached, i  # a was evicted by c; b by a; c stayed
        assert got == run(cold, prompt, f"c{i}")[0]


def test_concurrent_rows_and_a_cancelled_row(engines):
    """A row that leaves from the middle of the batch swaps with the last one: the rows that stay are intact,
    and the cancelled row's slot keeps its prompt and partial output for the next prompt."""
    rt = engines["fused"]
    warm, cold = warm_core(rt, "draft", 2, max_batch=3), warm_core(rt, "draft", 2, max_batch=1, prefix=False)
    long = SamplingParams(max_new_tokens=20)
    other = [4, 4, 2, 9, 1, 30, 12, 7, 7]
    out = []
    for rid, prompt in (("gone", P1), ("stays", other)):
        out.append(warm.add(SequenceRequest(rid, prompt, long)))
    for _ in range(3):
        out += warm.step()[0]
    gone = warm.rows[0].seq[:]
    assert warm.remove("gone") and warm.rows[0].request.request_id == "stays" and warm.rows[0].slot == 0
    while warm.rows:
        out += warm.step()[0]
    stays = [e.token_id for u in out if u.request_id == "stays" for e in u.events if e.token_id is not None]
    assert stays == run(cold, other, "c-other", long)[0]  # the row that moved into the hole was not disturbed
    prompt = gone + [5]
    got, stats = run(warm, prompt, "next")
    assert stats["cached_tokens"] >= len(gone) - 1 and got == run(cold, prompt, "c-next")[0]


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_methods_equal_a_cold_run(request, method):
    """Medusa reads the target's last feature; the EAGLE head keeps its own rows for the prefix (one lag: row t
    needs token t + 1) and gets the target's features from there on."""
    rt = specrt.load(request.getfixturevalue(f"{method}_engine"))
    warm, cold = warm_core(rt, method, 1, max_batch=2), warm_core(rt, method, 1, max_batch=1, prefix=False)
    first, _ = run(warm, SHORT, "a", n=6)
    lag = 1 if method == "eagle" else 0
    for i, (prompt, cached) in enumerate([(SHORT, len(SHORT) - 1), (SHORT + first + [2], len(SHORT) + len(first) - 1),
                                          (SHORT[:6] + [7, 7], 6 - lag)]):
        got, stats = run(warm, prompt, f"w{i}", n=6)
        assert got == run(cold, prompt, f"c{i}", n=6)[0], (method, i)
        if i == 1 and method == "eagle":  # its head covers what it caught up on as the row left
            assert len(SHORT) <= stats["cached_tokens"] <= cached
        else:
            assert stats["cached_tokens"] == cached, (method, i)
        assert stats["accepted"] > 0 or stats["rounds"] == 0
    out = warm.add_group([SequenceRequest(f"g{i}", SHORT, SamplingParams(max_new_tokens=6)) for i in range(2)])
    while warm.rows:
        out += warm.step()[0]
    want = run(cold, SHORT, "c-group", n=6)[0]
    for rid in ("g0", "g1"):  # the head's rows were forked with the target's: both choices are the cold run
        assert [e.token_id for u in out if u.request_id == rid for e in u.events if e.token_id is not None] == want


def test_generate_keeps_its_core_and_counts_hits(engines):
    rt = specrt.load(engines["traced"].manifest.root)
    a = rt.generate(P1, max_new_tokens=8, method="draft")
    b = rt.generate(P1, max_new_tokens=8, method="draft")
    assert (a.stats["cached_tokens"], b.stats["cached_tokens"]) == (0, len(P1) - 1) and a.token_ids == b.token_ids
    turn = P1 + b.token_ids + [1]
    c = rt.generate(turn, max_new_tokens=8, method="draft")
    assert c.stats["cached_tokens"] == len(turn) - 2
    assert rt.generate(turn, max_new_tokens=8, method="none").stats["cached_tokens"] == 0  # another core: cold
    d = rt.generate(turn, max_new_tokens=8, method="draft")  # the shared target slot was rewritten: the host tier
    assert d.stats["cached_tokens"] == len(turn) - 2 and d.token_ids == c.token_ids  # kept the copy b's hit made


def test_disabled_cache_and_a_proposer_without_cached(engines):
    rt = engines["traced"]
    off = warm_core(rt, "none", prefix=False)
    run(off, P1, "a")
    assert run(off, P1, "b")[1]["cached_tokens"] == 0 and off.prefix.hits == 0

    class Opaque:  # a proposer with a cache of its own that cannot say what it holds
        runner, feature, name = rt.runner("target", 2)[0], None, "none"

    assert not PrefixCache(rt.runner("target", 2)[0], Opaque(), 2).enabled


def test_lru_eviction_moves_the_newer_kept_slot(engines):
    """Claiming slot 0 moves what it kept to the free slot holding the oldest (never the newest) sequence."""
    rt = engines["traced"]
    core = warm_core(rt, "none", max_batch=3)
    cache = core.prefix
    for slot, (prompt, used) in enumerate([([1, 2, 3], 5), ([4, 5, 6], 1), ([7, 8, 9], 3)]):
        core.target.prefill(slot, prompt)
        cache.kept[slot] = Retained(prompt, 3, core.proposer, 0, used)
        core.target.release(slot)
    want = core.target.entries(0, 3).copy()
    assert cache.claim([10, 11, 12], 0, 1) == 0
    assert [r.tokens if r else None for r in cache.kept] == [None, [1, 2, 3], [7, 8, 9]]
    assert np.array_equal(core.target.entries(1, 3), want)


def test_server_reports_cached_tokens(start_server, llama_engine):
    srv = start_server(batch=CoreConfig(max_batch=2, method="ngram", calibrate=False))
    body = {"model": MODEL, "prompt": "the cat sat on the mat, the cat", "max_tokens": 6, "temperature": 0}
    first = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH).json()
    second = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert metrics(srv.url)[("specrt_prefix_cache_hit_tokens_total",)] == second["usage"]["prompt_tokens"] - 1


# ---- the host-memory tier (runtime/prefix_store.py) -------------------------------------------------------------
BURST = [[(5 * i + 3 * k) % 31 + 1 for i in range(10 + k)] for k in range(5)]  # 5 distinct prompts, 10..14 tokens


@pytest.mark.parametrize("kind,method,gamma", [("traced", "none", None), ("traced", "draft", 3), ("traced", "ngram", 3),
                                               ("fused", "draft", None)])
def test_a_repeated_burst_larger_than_the_slots_hits_the_host_tier(engines, kind, method, gamma):
    """Five prompts through two busy slots, twice: the second round takes every prefix from a slot or the host
    copies (most from the copies: every slot was busy), and each output is a cold run's."""
    rt = engines[kind]
    warm, cold = warm_core(rt, method, gamma), warm_core(rt, method, gamma, max_batch=1, prefix=False)
    for rnd in range(2):
        done = run_all(warm, [SequenceRequest(f"{rnd}-{k}", p, SamplingParams(max_new_tokens=8))
                              for k, p in enumerate(BURST)])
        for k, prompt in enumerate(BURST):
            got, _, _, stats = done[f"{rnd}-{k}"]
            assert got == run(cold, prompt, f"c{rnd}-{k}")[0], (method, rnd, k)
            assert stats["cached_tokens"] == (len(prompt) - 1 if rnd else 0), (method, rnd, k)
    assert warm.prefix.store.hits >= 3 and warm.prefix.hits == len(BURST)
    assert warm.prefix.store.hit_tokens <= warm.prefix.hit_tokens == sum(len(p) - 1 for p in BURST)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_host_tier_seeded_sampling_and_choices_are_the_cold_run(engines, method):
    """A prompt pushed out of the slots comes back from the host copy: seeded sampling draws the cold run's tokens,
    and n choices of it fork the copied prefix (the draft's own cache with the target's)."""
    rt = engines["traced"]
    warm, cold = warm_core(rt, method, 3, max_batch=2), warm_core(rt, method, 3, max_batch=1, prefix=False)
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=10) for s in (1, 2)]
    run(warm, P1, "a", params[0])
    run_all(warm, [SequenceRequest(f"x{k}", p, SamplingParams(max_new_tokens=4)) for k, p in enumerate(BURST[:2])])
    assert all(r is None or r.tokens[:len(P1)] != P1 for r in warm.prefix.kept)  # P1 left the slots ...
    assert len(warm.prefix.store) >= 1  # ... for the host tier
    got, stats = run(warm, P1, "b", params[0])
    assert stats["cached_tokens"] == len(P1) - 1 and got == run(cold, P1, "c", params[0])[0]
    run_all(warm, [SequenceRequest(f"y{k}", p, SamplingParams(max_new_tokens=4)) for k, p in enumerate(BURST[2:4])])
    tokens = run_group(warm, P1, params)
    for i, p in enumerate(params):
        assert tokens[f"g{i}"] == run(cold, P1, f"c{i}", p)[0]
    assert warm.prefix.store.hits == 2


@pytest.mark.parametrize("method", ["none", "draft"])
def test_a_prompt_that_rewrites_what_a_slot_kept_copies_nothing_out(engines, method):
    """A repeated prompt whose slot kept only the prompt's entries (here: one token asked; a target with a prefill
    graph keeps no more) and the next chat turn start with every token their slot kept: the slot will hold them
    all again, so nothing is copied to the host tier (a copy of a 300-token prompt cost about half its prefill;
    ``rewrites``). A prompt that shares a start and then differs still has the slot copied out first."""
    import doctest

    from specrt.runtime import prefix_cache

    assert doctest.testmod(prefix_cache).failed == 0  # ``rewrites``' examples
    rt = engines["traced"]
    warm, cold = warm_core(rt, method, 3, max_batch=1), warm_core(rt, method, 3, max_batch=1, prefix=False)
    run(warm, P1, "probe", n=1)
    assert warm.prefix.kept[0].target == len(P1)
    first, stats = run(warm, P1, "a")
    assert stats["cached_tokens"] == len(P1) - 1 and len(warm.prefix.store) == 0
    turn = P1 + first + [3, 4]
    got, stats = run(warm, turn, "turn")
    assert stats["cached_tokens"] == len(P1) + len(first) - 1 and got == run(cold, turn, "c1")[0]
    assert len(warm.prefix.store) == 0
    branch = P1 + [5, 5]
    got, stats = run(warm, branch, "branch")
    assert stats["cached_tokens"] == len(P1) and got == run(cold, branch, "c2")[0]
    assert len(warm.prefix.store) == 1 and warm.prefix.store.items[0].kept.tokens[:len(turn)] == turn


def test_host_tier_evicts_by_budget_and_stores_a_prefix_once(engines):
    """One slot: every new prompt copies the last sequence out. A budget of 40 tokens' entries holds two sequences of
    17: the least recently used goes; a longer sequence starting with a stored one replaces it."""
    rt = engines["traced"]
    per_token = rt.runner("target", 1)[0].entries(0, 1).nbytes
    warm = warm_core(rt, "none", max_batch=1, host_mb=40 * per_token / 2 ** 20)
    cold = warm_core(rt, "none", max_batch=1, prefix=False)
    store = warm.prefix.store
    a, b, c, d = BURST[0], BURST[1][:10], BURST[2][:10], BURST[3][:10]  # 10 tokens + 8 generated: 17 entries
    for i, prompt in enumerate([a, b, c, d]):
        assert run(warm, prompt, f"w{i}")[1]["cached_tokens"] == 0
    assert [item.kept.tokens[:10] for item in store.items] == [b, c] and store.nbytes == 34 * per_token
    for i, (prompt, cached) in enumerate([(a, 0), (c, len(c) - 1)]):  # a was evicted; c is still there
        got, stats = run(warm, prompt, f"again{i}")
        assert stats["cached_tokens"] == cached and got == run(cold, prompt, f"cold{i}")[0]
    first, _ = run(warm, a, "a2")
    longer = a + first + [1]
    run(warm, longer, "longer", n=4)  # a's kept slot is consumed whole (no copy); then b pushes ``longer`` out
    run(warm, b, "b2")
    assert sum(item.kept.tokens[:10] == a for item in store.items) == 1  # one entry for a's prefix: the longest
    assert max(len(item.kept.tokens) for item in store.items) == len(longer) + 3


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_methods_from_the_host_tier_equal_a_cold_run(request, method):
    """The EAGLE head's rows are copied out and back with the target's (its one-token lag kept)."""
    rt = specrt.load(request.getfixturevalue(f"{method}_engine"))
    warm, cold = warm_core(rt, method, 1, max_batch=2), warm_core(rt, method, 1, max_batch=1, prefix=False)
    prompts = [SHORT, SHORT[::-1], [2, 7, 1, 8, 2, 8, 1, 8], [1, 4, 1, 4, 2, 1, 3, 5]]
    for rnd in range(2):
        done = run_all(warm, [SequenceRequest(f"{rnd}-{k}", p, SamplingParams(max_new_tokens=6))
                              for k, p in enumerate(prompts)])
        for k, prompt in enumerate(prompts):
            got, _, _, stats = done[f"{rnd}-{k}"]
            assert got == run(cold, prompt, f"c{rnd}-{k}", n=6)[0], (method, rnd, k)
            assert (stats["cached_tokens"] > 0) == bool(rnd), (method, rnd, k)
    assert warm.prefix.store.hits >= 1


def test_server_counts_host_tier_hits(start_server):
    """One slot, prompts A, B, A: the third takes A's prefix from the host copy, in its usage and the counter."""
    srv = start_server(batch=CoreConfig(max_batch=1, method="none", calibrate=False))
    texts = ["the cat sat on the mat, the cat", "a dog ran in the park and a dog", "the cat sat on the mat, the cat"]
    out = [httpx.post(srv.url + "/v1/completions", headers=AUTH, json={
        "model": MODEL, "prompt": t, "max_tokens": 6, "temperature": 0}).json() for t in texts]
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out]
    assert cached == [0, 0, out[2]["usage"]["prompt_tokens"] - 1] and out[2]["choices"] == out[0]["choices"]
    assert metrics(srv.url)[("specrt_prefix_cache_hit_tokens_total",)] == cached[2]


def test_cli_prefix_cache_mb(llama_engine, monkeypatch):
    """`specrt serve --prefix-cache-mb N` reaches the core's config; a negative budget is a usage error."""
    from click.testing import CliRunner

    import specrt.runtime.serve.app as app_module
    from specrt.tools.cli import cli

    seen = {}

    def fake_build_app(spec):
        seen["batch"] = spec.config.batch
        raise ValueError("stop here")  # before uvicorn starts

    monkeypatch.setattr(app_module, "build_app", fake_build_app)
    res = CliRunner().invoke(cli, ["serve", str(llama_engine), "--prefix-cache-mb", "64"])
    assert "stop here" in res.output and seen["batch"].prefix_cache_mb == 64, res.output
    res = CliRunner().invoke(cli, ["serve", str(llama_engine), "--prefix-cache-mb", "-1"])
    assert res.exit_code != 0 and "--prefix-cache-mb" in res.output and "Traceback" not in res.output


def run_group(core, prompt: list, params: list) -> dict:
    """n choices of ``prompt`` (one per SamplingParams) run to the end: request id "g<i>" -> its tokens."""
    ups = core.add_group([SequenceRequest(f"g{i}", prompt, p) for i, p in enumerate(params)])
    tokens = {u.request_id: [e.token_id for e in u.events] for u in ups}
    while core.rows:
        for u in core.step()[0]:
            tokens[u.request_id] += [e.token_id for e in u.events if e.token_id is not None]
    return tokens
