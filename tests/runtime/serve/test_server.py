"""`specrt serve` over real HTTP on loopback: the official openai client, concurrency, disconnects, errors, metrics."""
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import specrt
from specrt.runtime.batch_policy import REASONS
from specrt.runtime.core import CoreConfig
from specrt.runtime.serve.chat import ChatTemplate, TemplateInputError
from serving import AUTH, KEY, MODEL, SlowEngine, metrics, slow_runtime

PROMPTS = ["hello world", "the cat sat on", "abc abc abc", "a", "zebra crossing, quickly."]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(batch=CoreConfig(max_batch=4, method="draft"), max_queue=64)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat_prompt(messages) -> str:
    return ChatTemplate(None).render(messages)


# ---- the openai client, equal to rt.generate greedy ----------------------------------------------
def test_completion_equals_greedy(client, ref):
    for prompt in PROMPTS:
        want = ref.generate(prompt, max_new_tokens=20, temperature=0.0, method="none")
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == want.text, prompt
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == len(ref.encode(prompt))
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        spec = got.model_extra["speculation"]
        assert spec["method"] == "draft" and 0 <= spec["accepted"] <= spec["proposed"]
        assert spec["tokens_per_pass"] >= 1


def test_chat_completion_equals_greedy(client, ref):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}]
    prompt = chat_prompt(messages)
    assert prompt == "system: be brief\nuser: say hi\nassistant:"  # the documented default template
    want = ref.generate(prompt, max_new_tokens=15, temperature=0.0, method="none")
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(ref.encode(prompt))


def test_streaming_equals_greedy(client, ref):
    for prompt in PROMPTS[:3]:
        want = ref.generate(prompt, max_new_tokens=18, temperature=0.0, method="none")
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=18, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
        assert chunks[-1].usage.completion_tokens == len(want.token_ids) and not chunks[-1].choices
        assert len({c.id for c in chunks}) == 1
    messages = [{"role": "user", "content": "count to ten"}]
    want = ref.generate(chat_prompt(messages), max_new_tokens=12, temperature=0.0, method="none")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert "speculation" in chunks[-1].model_extra


def test_seeded_sampling_at_fixed_gamma_equals_runtime(start_server, ref):
    """With a fixed γ a seed reproduces rt.generate's sample, whatever else shares the batch."""
    srv = start_server(batch=CoreConfig(max_batch=2, method="draft", gamma=2))
    http_client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    for seed in (7, 8):
        want = ref.generate("hello", max_new_tokens=12, temperature=1.0, seed=seed, method="draft", gamma=2)
        got = http_client.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=1.0, seed=seed)
        assert got.choices[0].text == want.text


# ---- concurrency -------------------------------------------------------------------------------------
async def stream_completion(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, finish, ids, done = "", None, set(), False
    async with http.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done  # nothing after [DONE]
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            ids.add(chunk["id"])
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
    return {"text": text, "finish": finish, "done": done, "ids": ids}


def test_32_concurrent_streams_each_get_their_own_tokens(server, ref):
    words = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "pixel"]
    jobs = [(f"{words[i % 8]} {words[(3 * i + 1) % 8]} {chr(97 + i % 26)}", 8 + (i * 5) % 23) for i in range(32)]
    wants = [ref.generate(p, max_new_tokens=m, temperature=0.0, method="none") for p, m in jobs]
    before = metrics(server.url)

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(stream_completion(http, server.url, p, m) for p, m in jobs))

    results = asyncio.run(main())
    for (prompt, _), want, got in zip(jobs, wants, results):
        assert got["done"], prompt  # every stream ended with [DONE]
        assert got["text"] == want.text, prompt  # no token lost or swapped
        assert got["finish"] == want.finish_reason and len(got["ids"]) == 1
    assert len({next(iter(r["ids"])) for r in results}) == 32
    after = metrics(server.url)
    steps = after[("specrt_steps_total",)] - before[("specrt_steps_total",)]
    rows = after[("specrt_sequence_passes_total",)] - before[("specrt_sequence_passes_total",)]
    assert rows > steps  # sequences shared target passes: the batch was > 1
    assert after[("specrt_batch_size",)] == 0 and after[("specrt_queue_depth",)] == 0


# ---- disconnects and overload -------------------------------------------------------------------------
def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_client_disconnect_frees_the_slot(start_server, llama_engine, ref):
    srv = start_server(runtime=slow_runtime(llama_engine), batch=CoreConfig(max_batch=1, method="none"))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 50, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one token received; leave mid-stream (50 tokens take >= 1 s)
    wait_for(lambda: metrics(srv.url)[("specrt_requests_cancelled_total",)] == 1)
    m = metrics(srv.url)
    assert m[("specrt_batch_size",)] == 0 and m[("specrt_step_tokens_total",)] < 49
    # a non-streaming client that gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=0.3)
    wait_for(lambda: metrics(srv.url)[("specrt_requests_cancelled_total",)] == 2)
    closed = ("specrt_requests_total", ("endpoint", "/v1/completions"), ("status", "499"))
    wait_for(lambda: metrics(srv.url).get(closed) == 1)  # its handler returned too
    # the single slot is free: the next requests run, unaffected
    for prompt in ("the cat", "hello"):
        got = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=30,
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}).json()
        assert got["choices"][0]["text"] == ref.generate(prompt, max_new_tokens=10, method="none").text
    assert metrics(srv.url)[("specrt_generated_tokens_total",)] == 20  # completed requests only


def test_full_queue_answers_429_and_stopped_engine_503(start_server, llama_engine, ref):
    srv = start_server(batch=CoreConfig(max_batch=1, method="none"), max_queue=1)
    worker = srv.app.state.server.worker
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": 0}
    worker.pause()  # nothing is admitted: the first request waits in the queue
    first = {}
    thread = threading.Thread(target=lambda: first.update(
        r=httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=30)))
    thread.start()
    wait_for(lambda: worker.queue_depth == 1)
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
    worker.resume()
    thread.join(30)
    assert first["r"].status_code == 200
    assert first["r"].json()["choices"][0]["text"] == ref.generate("hello", max_new_tokens=5, method="none").text
    worker.stop()
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert httpx.get(srv.url + "/health").status_code == 503


class FailingEngine:
    """Raises on decode steps (one new token per row) while ``failing`` is set: an engine failure mid-generation."""

    def __init__(self, engine):
        self.engine, self.failing = engine, False
        self.input_names, self.output_names = engine.input_names, engine.output_names

    def run(self, feeds):
        if self.failing and feeds["input_ids"].shape[1] == 1:
            raise RuntimeError("device lost")
        return self.engine.run(feeds)


def test_engine_failure_fails_the_requests_in_flight_only(start_server, llama_engine, ref):
    rt = specrt.load(llama_engine)
    rt.target.engine = engine = FailingEngine(rt.target.engine)
    srv = start_server(runtime=rt, batch=CoreConfig(max_batch=2, method="none"))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    engine.failing = True
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error" and "device lost" in r.text
    lines = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=30).text
    events = [line[len("data: "):] for line in lines.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
    engine.failing = False
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.json()["choices"][0]["text"] == ref.generate("hello", max_new_tokens=8, method="none").text
    assert metrics(srv.url)[("specrt_requests_failed_total",)] == 2


# ---- bad input -----------------------------------------------------------------------------------------
GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 3}


def test_clients_written_for_vllm_or_llama_server_are_served(start_server, ref):
    """Lenient where the peers are: an unknown field is ignored and named in a response header (--strict-api: a
    400, OpenAI's rule); ``model`` may be left out or name an alias; the /v1 paths answer without /v1 (an OpenAI
    client whose base_url lacks it); llama.cpp's n_predict is max_tokens; responses carry system_fingerprint."""
    srv = start_server(batch=CoreConfig(max_batch=2, method="ngram"), model_aliases=("gpt-3.5-turbo",))
    plain = ref.generate("hello", max_new_tokens=3, method="none").text
    greedy = {**GOOD, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json={**greedy, "id_slot": 0, "cache_prompt": True}, headers=AUTH)
    assert r.status_code == 200 and r.headers["x-specrt-ignored-fields"] == "id_slot, cache_prompt"
    assert r.json()["choices"][0]["text"] == plain and r.json()["system_fingerprint"].startswith("specrt-")
    for body in ({"prompt": "hello", "n_predict": 3, "temperature": 0}, {**greedy, "model": None},
                 {**greedy, "model": "gpt-3.5-turbo"}):
        r = httpx.post(srv.url + "/completions", json=body, headers=AUTH)
        assert r.status_code == 200 and "x-specrt-ignored-fields" not in r.headers, body
        assert r.json()["choices"][0]["text"] == plain and r.json()["model"] == MODEL
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(srv.url + "/chat/completions", json=chat, headers=AUTH).status_code == 200
    assert [m["id"] for m in httpx.get(srv.url + "/models", headers=AUTH).json()["data"]] == [MODEL, "gpt-3.5-turbo"]
    assert httpx.post(srv.url + "/completions", json={**GOOD, "model": "gpt-9"}, headers=AUTH).status_code == 404
    strict = start_server(batch=CoreConfig(max_batch=1, method="ngram"), strict_api=True)
    r = httpx.post(strict.url + "/v1/completions", json={**GOOD, "bogus": 1}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert r.json()["error"]["param"] == "bogus"


@pytest.mark.parametrize("path,body,headers,status,code,param", [
    ("/v1/completions", b"{not json", AUTH, 400, "invalid_json", None),
    ("/v1/completions", b"[1, 2]", AUTH, 400, "invalid_json", None),
    ("/v1/completions", {**GOOD, "logit_bias": {"999": 1}}, AUTH, 400, "invalid_value", "logit_bias"),  # vocab 32
    ("/v1/completions", {**GOOD, "max_tokens": 10_000}, AUTH, 400, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", {"model": MODEL}, AUTH, 400, "missing_required_parameter", "prompt"),
    ("/v1/completions", {**GOOD, "temperature": 2.5}, AUTH, 400, "invalid_value", "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, AUTH, 400, "invalid_value", "top_p"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, AUTH, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {**GOOD, "n": 5}, AUTH, 400, "invalid_value", "n"),  # more than --max-batch 4
    ("/v1/completions", {**GOOD, "seed": -1}, AUTH, 400, "invalid_value", "seed"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, AUTH, 400, "invalid_value", "stream"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, AUTH, 400, "invalid_value", "stop"),
    ("/v1/completions", {**GOOD, "prompt": "abc " * 40}, AUTH, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["one", "two"]}, AUTH, 400, "invalid_value", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 999]}, AUTH, 400, "invalid_value", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ""}, AUTH, 400, "invalid_value", "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, AUTH, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, AUTH, 400,
     "invalid_value", "messages.0.role"),
    ("/v1/completions", {**GOOD, "model": "gpt-9"}, AUTH, 404, "model_not_found", "model"),
    ("/v1/completions", GOOD, {}, 401, "invalid_api_key", None),
    ("/v1/completions", GOOD, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key", None),
    ("/v1/models", None, {}, 401, "invalid_api_key", None),
    ("/v1/embeddings", GOOD, AUTH, 404, "not_found", None),
    ("/v1/completions", None, AUTH, 405, "method_not_allowed", None),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, path, body, headers, status, code, param):
    if body is None:
        r = httpx.get(server.url + path, headers=headers)
    else:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + path, content=content, headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"
    # the server keeps serving (exact outputs are checked by the tests above; here a request from an
    # earlier test may still share the batch, and a near-tie of this random tiny model can flip)
    ok = httpx.post(server.url + "/v1/completions", json=GOOD, headers=AUTH)
    assert ok.status_code == 200 and 1 <= ok.json()["usage"]["completion_tokens"] <= GOOD["max_tokens"]


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="nope", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == [MODEL]


# ---- metrics and health -----------------------------------------------------------------------------------
def test_metrics_change_consistently(server, client):
    before = metrics(server.url)
    usages = [client.completions.create(model=MODEL, prompt=p, max_tokens=9, temperature=0).usage for p in PROMPTS[:2]]
    chunks = list(client.completions.create(model=MODEL, prompt="hi there", max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    after = metrics(server.url)

    def delta(*key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    ok = ("endpoint", "/v1/completions"), ("status", "200")
    assert delta("specrt_requests_total", *ok) == 3
    assert delta("specrt_request_duration_seconds_count", ("endpoint", "/v1/completions")) == 3
    assert delta("specrt_time_to_first_token_seconds_count") == 3
    assert delta("specrt_generated_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("specrt_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("specrt_steps_total") > 0 and delta("specrt_accepted_tokens_total") <= delta(
        "specrt_proposed_tokens_total")
    assert 0 <= after[("specrt_acceptance_rate",)] <= 1 and after[("specrt_tokens_per_target_pass",)] >= 1
    assert after[("specrt_batch_size",)] == 0 and after[("specrt_queue_depth",)] == 0
    assert after[("specrt_speculation_enabled",)] == (after[("specrt_gamma",)] > 0)
    assert sum(after[("specrt_policy_decision", ("reason", r))] for r in REASONS) == 1
    assert 0 <= after[("specrt_policy_speculation_max_batch",)] <= 4
    assert after[("specrt_tokens_per_second",)] > 0


def test_health_and_models(server):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["max_batch"] == 4 and h["model"] == MODEL
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == MODEL


# ---- chat templates and the CLI -------------------------------------------------------------------------
def test_chat_template_from_tokenizer_config(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    t = ChatTemplate(tmp_path)
    assert not t.is_default
    assert t.render([{"role": "user", "content": "hi"}]) == "<s><user>hi<assistant>"
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": strict}]}))
    with pytest.raises(TemplateInputError, match="user first"):  # the server answers it with a 400
        ChatTemplate(tmp_path).render([{"role": "system", "content": "s"}])
    assert ChatTemplate(tmp_path).render([{"role": "user", "content": "s"}]) == "ok"


def test_cli_serve_starts_and_answers(llama_engine, ref):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from specrt.tools.cli import main; main()", "serve", str(llama_engine),
           "--port", str(port), "--max-batch", "2", "--method", "ngram", "--api-key", KEY, "--api-key", "second",
           "--model-name", MODEL, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=60)
        got = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
            model=MODEL, prompt="hello", max_tokens=8, temperature=0)
        assert got.choices[0].text == ref.generate("hello", max_new_tokens=8, method="none").text
        assert got.model_extra["speculation"]["method"] == "ngram"
        assert openai.OpenAI(base_url=url + "/v1", api_key="second", max_retries=0).models.list().data  # either key
    finally:
        proc.terminate()
        proc.wait(30)


# ---- tree methods (Medusa, EAGLE) served with continuous batching ------------------------------------
TREE_PROMPTS = ["abc", "hello", "faded cab", "a", "ghijk abc", "bad", "jello fig", "cage"]  # letters of the V=16 tokenizer


@pytest.fixture(scope="module", params=["medusa", "eagle"])
def tree_server(request, start_server, medusa_engine, eagle_engine):
    """(method, reference runtime, engine dir, server with max_batch 4 running that method)."""
    engine = {"medusa": medusa_engine, "eagle": eagle_engine}[request.param]
    srv = start_server(runtime=specrt.load(engine), batch=CoreConfig(max_batch=4, method=request.param, gamma=1))
    return request.param, specrt.load(engine), engine, srv  # gamma 1: a tree every step (not the policy's choice)


def test_tree_method_completion_equals_greedy(tree_server):
    method, ref, _, srv = tree_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    accepted = 0
    for prompt in TREE_PROMPTS[:4]:
        want = ref.generate(prompt, max_new_tokens=16, temperature=0.0, method="none")
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want.text, (method, prompt)
        spec = got.model_extra["speculation"]
        assert spec["method"] == method
        accepted += spec["accepted"]
    assert accepted > 0  # candidates were accepted: the tree path ran, not only plain steps


def test_tree_method_16_concurrent_streams_each_get_their_own_tokens(tree_server):
    method, ref, _, srv = tree_server
    jobs = [(TREE_PROMPTS[i % 8] + " " + TREE_PROMPTS[(3 * i + 1) % 8][:2], 6 + (i * 5) % 11) for i in range(16)]
    wants = [ref.generate(p, max_new_tokens=m, temperature=0.0, method="none") for p, m in jobs]
    before = metrics(srv.url)

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=32)) as http:
            return await asyncio.gather(*(stream_completion(http, srv.url, p, m) for p, m in jobs))

    for (prompt, _), want, got in zip(jobs, wants, asyncio.run(main())):
        assert got["done"] and got["text"] == want.text and got["finish"] == want.finish_reason, (method, prompt)
    after = metrics(srv.url)
    steps = after[("specrt_steps_total",)] - before[("specrt_steps_total",)]
    rows = after[("specrt_sequence_passes_total",)] - before[("specrt_sequence_passes_total",)]
    assert rows > steps  # rows with their own trees shared target passes


def test_tree_method_disconnect_mid_tree_frees_the_slot(tree_server, start_server):
    method, ref, engine, _ = tree_server
    rt = specrt.load(engine)
    rt.target.engine = SlowEngine(rt.target.engine)
    srv = start_server(runtime=rt, batch=CoreConfig(max_batch=1, method=method))
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 25, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one token received; leave while trees are being verified
    wait_for(lambda: metrics(srv.url)[("specrt_requests_cancelled_total",)] == 1)
    assert metrics(srv.url)[("specrt_batch_size",)] == 0
    got = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=30,
                     json={"model": MODEL, "prompt": "hello", "max_tokens": 10, "temperature": 0}).json()
    assert got["choices"][0]["text"] == ref.generate("hello", max_new_tokens=10, method="none").text


def test_cli_serve_refuses_a_method_the_engine_dir_lacks(llama_engine):
    """Before: `specrt serve` on an engine without heads silently served another method."""
    from click.testing import CliRunner

    from specrt.tools.cli import cli

    for method, flag in (("eagle", "--eagle"), ("medusa", "--medusa")):
        res = CliRunner().invoke(cli, ["serve", str(llama_engine), "--method", method])
        assert res.exit_code != 0 and f"needs an engine dir exported with {flag}" in res.output, res.output
        assert "Traceback" not in res.output
    res = CliRunner().invoke(cli, ["serve", str(llama_engine), "--device", "gpu"])
    assert res.exit_code != 0 and "'gpu' is not one of 'cpu', 'cuda'" in res.output
    res = CliRunner().invoke(cli, ["serve", str(llama_engine), "--api-key", " "])
    assert res.exit_code != 0 and "a key must be non-empty" in res.output


def test_cli_serve_refuses_a_bad_suffix_corpus(llama_engine, tmp_path):
    from click.testing import CliRunner

    from specrt.tools.cli import cli

    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "ab"}\nnot json\n')
    for args, message in (([bad], "line 2: not a JSON object"), ([tmp_path / "none.jsonl"], "does not exist"),
                          ([bad, "--method", "ngram"], "suffix corpus is for method 'suffix'")):
        res = CliRunner().invoke(cli, ["serve", str(llama_engine), "--method", "suffix", "--suffix-corpus",
                                       *map(str, args)])
        assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output, res.output


def test_limits_content_type_and_the_tokenizer_endpoints(start_server, ref):
    srv = start_server(batch=CoreConfig(max_batch=2, method="none"), max_body_bytes=2000, max_prompt_tokens=20)
    url, good = srv.url, {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    big = httpx.post(url + "/v1/completions", json={**good, "prompt": "x" * 5000}, headers=AUTH)
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    plain = httpx.post(url + "/v1/completions", content=json.dumps(good), headers={**AUTH, "Content-Type": "text/plain"})
    assert plain.status_code == 415  # a cross-origin form post cannot run a generation
    long = httpx.post(url + "/v1/completions", json={**good, "prompt": "abc " * 6}, headers=AUTH)
    assert long.status_code == 400 and "at most 20" in long.json()["error"]["message"]
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=AUTH).json()
    assert tok["tokens"] == ref.encode("hello") and tok["count"] == len(tok["tokens"])
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=AUTH).json()
    assert chat["count"] > 1
    detok = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()
    assert detok["prompt"] == "hello"
    assert httpx.post(url + "/detokenize", json={"tokens": [10 ** 6]}, headers=AUTH).status_code == 400
    card = httpx.get(url + f"/v1/models/{MODEL}", headers=AUTH).json()
    assert card["id"] == MODEL and card["max_model_len"] == ref.manifest.max_len
    assert httpx.get(url + "/v1/models/other", headers=AUTH).status_code == 404
    assert httpx.get(url + "/version").json()["version"] == specrt.__version__
    assert httpx.post(url + "/v1/completions", json=good, headers=AUTH).status_code == 200  # still serving


def test_cors_and_host_checks(start_server):
    srv = start_server(batch=CoreConfig(max_batch=1, method="none"), allowed_origins=("https://app.example",),
                       allowed_hosts=("127.0.0.1", "localhost"))
    pre = httpx.options(srv.url + "/v1/completions", headers={"Origin": "https://app.example",
                                                               "Access-Control-Request-Method": "POST"})
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(srv.url + "/v1/completions", headers={"Origin": "https://evil.example",
                                                                 "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    assert httpx.get(srv.url + "/health", headers={"Host": "evil.example"}).status_code == 400
    assert httpx.get(srv.url + "/health").status_code == 200
    anyone = start_server(batch=CoreConfig(max_batch=1, method="none"), allowed_origins=("*",))
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/models"):  # the openai JS SDK's preflight
        pre = httpx.options(anyone.url + path, headers={"Origin": "https://app.example",
                                                        "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "authorization, x-stainless-os"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert "x-stainless-os" in pre.headers["access-control-allow-headers"].lower()


def test_a_final_assistant_message_is_continued(server, ref):
    """As llama-server (vLLM: continue_final_message): the reply continues a trailing assistant message (the prompt
    ends inside it, not with a new assistant turn); continue_final_message false turns it off; two trailing
    assistant messages are a 400."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH)
    prefix = ChatTemplate(None).continue_final(messages)
    assert prefix == "user: hi\nassistant: Hello, I"
    assert r.json()["choices"][0]["message"]["content"] == ref.generate(prefix, max_new_tokens=4, method="none").text
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "continue_final_message": False}, headers=AUTH)
    assert r.json()["choices"][0]["message"]["content"] == ref.generate(chat_prompt(messages), max_new_tokens=4,
                                                                        method="none").text
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH,
                   json={**body, "messages": [*messages, {"role": "assistant", "content": "again"}]})
    assert r.status_code == 400 and "at most one assistant message" in r.json()["error"]["message"]


def test_echo_puts_the_prompt_before_the_completion(server, ref):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "temperature": 0}
    plain = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH).json()["choices"][0]["text"]
    echoed = httpx.post(server.url + "/v1/completions", json={**body, "echo": True}, headers=AUTH).json()
    assert echoed["choices"][0]["text"] == "hello" + plain
    ids = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ref.encode("hello"), "echo": True},
                     headers=AUTH).json()
    assert ids["choices"][0]["text"] == "hello" + plain  # token-id prompts are detokenized
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "echo": True, "stream": True},
                      headers=AUTH) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello" + plain and chunks[0]["choices"][0]["text"] == "hello"
