"""`specrt serve`: logprobs, n choices, penalties, and what the operator sees (auth scheme, HEAD /health, metrics)."""
import concurrent.futures
import json

import httpx
import openai
import pytest

from serving import AUTH, KEY, MODEL, metrics
from specrt.runtime.core import CoreConfig


@pytest.fixture(scope="module")
def server(start_server):
    """Draft-model speculation at a fixed γ: seeded sampled rows equal their batch-1 output."""
    return start_server(batch=CoreConfig(max_batch=4, method="draft", gamma=2))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def tok_text(ref, i: int) -> str:
    return ref.tokenizer.decode([i])


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=5)], ids=str)
def test_completion_logprobs_are_the_runtimes(client, ref, sampling):
    want = ref.generate("hello world", max_new_tokens=10, method="draft", gamma=2, logprobs=3, **sampling)
    got = client.completions.create(model=MODEL, prompt="hello world", max_tokens=10, logprobs=3, **sampling)
    lp = got.choices[0].logprobs
    assert lp.tokens == [tok_text(ref, t) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([max(x, -9999.0) for x, _ in want.logprobs], abs=1e-6)
    for top, (_, alts) in zip(lp.top_logprobs, want.logprobs):
        assert list(top) == [tok_text(ref, i) for i, _ in alts] or len(set(top)) < 3  # (two ids may share a text)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert got.model_extra["speculation"]["proposed"] > 0  # speculation was on


def test_chat_logprobs_streamed_and_not(client, ref):
    messages = [{"role": "user", "content": "say hi"}]
    body = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = body.choices[0].logprobs.content
    assert len(content) == body.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the best token
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_seeded_each_equals_the_runtime(client, ref):
    got = client.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=12, n=3, temperature=1.0,
                                    seed=40)
    assert [c.index for c in got.choices] == [0, 1, 2]
    wants = [ref.generate("the cat sat on", max_new_tokens=12, temperature=1.0, seed=40 + i, method="draft", gamma=2)
             for i in range(3)]
    for c, want in zip(got.choices, wants):
        assert c.text == want.text and c.finish_reason == want.finish_reason
    assert len({c.text for c in got.choices}) > 1
    again = client.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=12, n=3, temperature=1.0,
                                      seed=40)
    assert [c.text for c in again.choices] == [c.text for c in got.choices]  # reproducible
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
    assert got.usage.prompt_tokens == len(ref.encode("the cat sat on"))


def test_n_choices_streamed(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, n=2, temperature=1.0, seed=1, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, finished = {0: "", 1: ""}, set()
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    body = openai.OpenAI(base_url=client.base_url, api_key=KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2, temperature=1.0, seed=1)
    assert [texts[0], texts[1]] == [c.message.content for c in body.choices]
    assert chunks[-1].usage.completion_tokens == body.usage.completion_tokens
    assert "speculation" in [ch for ch in chunks if ch.choices][-1].model_extra


@pytest.mark.parametrize("pen", [dict(presence_penalty=1.5), dict(frequency_penalty=2.0, repetition_penalty=1.3)],
                         ids=str)
def test_penalties_through_the_server_equal_the_runtime(client, ref, pen):
    want = ref.generate("abc abc abc", max_new_tokens=16, method="draft", gamma=2, **pen)
    extra = {k: v for k, v in pen.items() if k == "repetition_penalty"}
    got = client.completions.create(model=MODEL, prompt="abc abc abc", max_tokens=16, temperature=0,
                                    presence_penalty=pen.get("presence_penalty", 0),
                                    frequency_penalty=pen.get("frequency_penalty", 0), extra_body=extra)
    assert got.choices[0].text == want.text


def test_bearer_scheme_is_case_insensitive(server):
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
        assert r.status_code == 200, header
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401


def test_head_health_and_process_metrics(server, client):
    assert httpx.head(server.url + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0, stream=False)
    list(client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0, stream=True))
    m = metrics(server.url)
    assert m[("process_resident_memory_bytes",)] > 1e6 and m[("process_cpu_seconds_total",)] > 0
    assert m[("specrt_queue_wait_seconds_count",)] >= 2
    assert m[("specrt_inter_token_latency_seconds_count",)] >= 5


def test_n_beyond_max_batch_and_bad_logprobs_are_400(server):
    cases = [({"n": 5}, "n"), ({"logprobs": 2, "echo": True}, "echo"), ({"logprobs": 30}, "logprobs")]
    for extra, param in cases:
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_20_character_stop_string_inside_the_text(client, ref, stream):
    full = ref.generate("hello world", max_new_tokens=50, method="none").text
    assert len(full) >= 45, full
    stop = full[20:40]
    want = full[: full.index(stop)]
    kw = dict(model=MODEL, prompt="hello world", max_tokens=50, temperature=0, stop=stop)
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got = client.completions.create(**kw)
        text, finish = got.choices[0].text, got.choices[0].finish_reason
    assert (text, finish) == (want, "stop")


def test_serve_method_suffix_concurrent_streams_equal_greedy(start_server, ref):
    """Suffix decoding served batched: 4 concurrent greedy streams, each == its own rt.generate; a repeat
    of an earlier request drafts from the server's global cache."""
    srv = start_server(batch=CoreConfig(max_batch=4, method="suffix", gamma=4))
    prompts = ["hello world", "the cat sat on", "abc abc abc", "x = 1"]
    want = {p: ref.generate(p, max_new_tokens=30, method="none").text for p in prompts}

    def stream(prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["speculation"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = dict(zip(prompts, pool.map(stream, prompts)))
    assert {p: t for p, (t, _) in got.items()} == want
    text, spec = stream("hello world")  # the same request again: its earlier output is in the global cache
    assert text == want["hello world"] and spec["method"] == "suffix" and spec["accepted"] > 0


def test_serve_suffix_cache_is_per_api_key(start_server, ref):
    """Two API keys: a request repeated under the other key does not draft from the first key's
    output; repeated under its own key it does (docs/serving.md)."""
    other = "second-key"
    srv = start_server(api_key=(KEY, other), batch=CoreConfig(max_batch=2, method="suffix", gamma=4))

    def spec(key: str) -> dict:
        body = {"model": MODEL, "prompt": "the cat sat on", "max_tokens": 30, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["speculation"]

    first, second_key, again = spec(KEY), spec(other), spec(KEY)
    assert second_key["accepted"] == first["accepted"] < again["accepted"]
    bad = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                     headers={"Authorization": "Bearer third"}, timeout=60)
    assert bad.status_code == 401
