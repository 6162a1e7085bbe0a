"""Per-request speculation (the ``speculative`` extension), logit_bias and min_tokens through `specrt serve`:
a server started with several methods runs each request's own, and each response equals that request's batch-1
output (seeded sampling at a fixed γ), whatever else shares the batch."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serving import AUTH, KEY, MODEL
from specrt.runtime.core import CoreConfig

JOBS = [  # (prompt, method, γ, seed)
    ("hello world", "ngram", 3, 1), ("the cat sat on", "draft", 2, 2), ("abc abc abc", "none", 0, 3),
    ("zebra crossing", "draft", 4, 4), ("a b a b a b", "ngram", 1, 5), ("quickly, now", "none", None, 6),
]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(batch=CoreConfig(max_batch=6, method="draft,ngram"))


def complete(server, prompt, method, gamma, seed, stream=False) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0.9, "seed": seed, "stream": stream,
            "speculative": {"method": method, "gamma": gamma}}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return {"text": "".join(e["choices"][0]["text"] for e in events), "speculation": events[-1]["speculation"]}


def test_each_request_runs_its_own_method(server, ref):
    with ThreadPoolExecutor(len(JOBS)) as pool:  # all in one batch: mixed methods share target passes
        answers = list(pool.map(lambda job: complete(server, *job), JOBS))
        streamed = list(pool.map(lambda job: complete(server, *job, stream=True), JOBS))
    for (prompt, method, gamma, seed), got, stream in zip(JOBS, answers, streamed):
        want = ref.generate(prompt, max_new_tokens=20, temperature=0.9, seed=seed, method=method, gamma=gamma)
        if gamma is not None:  # a seed reproduces a sample at a fixed γ
            assert got["choices"][0]["text"] == stream["text"] == want.text, (prompt, method)
        assert got["speculation"]["method"] == stream["speculation"]["method"] == method
        if method != "none" and gamma:
            assert got["speculation"]["proposed"] > 0


def test_the_default_is_the_first_method(server):
    out = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).completions.create(
        model=MODEL, prompt="hello", max_tokens=5, extra_body={"speculative": {"gamma": 2}})
    assert out.model_extra["speculation"]["method"] == "draft"


def test_a_method_the_server_does_not_run_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={
        "model": MODEL, "prompt": "hi", "speculative": {"method": "suffix"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.method"
    assert "available: draft, ngram, none" in r.json()["error"]["message"]


def test_logit_bias_and_min_tokens(server, ref):
    want = ref.generate("hello", max_new_tokens=8, method="none")
    top = want.token_ids[0]
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={
        "model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 0,
        "logit_bias": {str(top): -100, "7": 100}}).json()
    assert r["choices"][0]["text"][0] == ref.tokenizer.decode([7])  # +100 wins every position greedily
    eos = 0  # the tiny tokenizer's <eos>
    short = ref.generate("a", max_new_tokens=30, method="none", logit_bias={eos: 100})
    assert short.token_ids == [eos]
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={
        "model": MODEL, "prompt": "a", "max_tokens": 30, "temperature": 0, "logit_bias": {"0": 100},
        "min_tokens": 5}).json()
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "stop"  # EOS at the 6th
