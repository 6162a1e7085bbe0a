"""Structured outputs and tool calls through `specrt serve` on the demo engine (a small code model: its output is
valid because it is constrained): 24 JSON schemas each answered with JSON that validates, the official openai
client's response_format and tools (required, named, streamed), a Hermes template's tagged calls, the 400s,
and a grammar compiling on a thread while another request streams."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

import specrt
from specrt.runtime.api import Runtime
from serving import AUTH, KEY, MODEL
from specrt.runtime.core import CoreConfig
from specrt.runtime.serve.app import BackgroundServer, ServerConfig, create_app
from specrt.runtime.serve.chat import ChatTemplate
from test_tool_calls import HERMES_TEMPLATE

ASK = [{"role": "user", "content": "Give me the record as JSON."}]
INT = {"type": "integer", "minimum": 0, "maximum": 99}
WORD = {"type": "string", "maxLength": 12}


def obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS = {
    "flat": obj({"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "nested": obj({"person": obj({"first": WORD, "last": WORD}), "id": INT}),
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})}),
    "string_array": obj({"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}}),
    "object_array": obj({"items": {"type": "array", "maxItems": 3,
                                   "items": obj({"sku": {"type": "string", "maxLength": 8}, "qty": INT})}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}),
    "number_bounds": obj({"score": {"type": "number", "minimum": 0, "maximum": 1},
                          "temp": {"type": "number", "minimum": -40, "maximum": 60}}),
    "int_bounds": obj({"low": {"type": "integer", "minimum": -50, "maximum": -10},
                       "high": {"type": "integer", "exclusiveMinimum": 1000, "maximum": 1005}}),
    "optional": obj({"id": INT, "nickname": WORD, "email": WORD}, required=["id"]),
    "any_of": obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}}),
    "tagged_union": obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": INT}),
                                             obj({"kind": {"const": "square"}, "side": INT})]}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "const": obj({"version": {"const": 2}, "kind": {"const": "user"}, "name": WORD}),
    "nullable": obj({"note": {"type": ["string", "null"], "maxLength": 10}, "ok": {"type": "boolean"},
                     "nothing": {"type": "null"}}),
    "top_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                  "maxItems": 4},
    "top_enum": {"enum": ["yes", "no", "maybe"]},
    "refs": {**obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
             "$defs": {"point": obj({"x": INT, "y": INT})}},
    "tuple": obj({"pair": {"type": "array", "prefixItems": [WORD, INT], "items": False, "minItems": 2}}),
    "min_length": obj({"tag": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "date": obj({"when": {"type": "string", "format": "date"}}),
    "many_fields": obj({"name": WORD, "city": WORD, "country": WORD, "age": INT, "height": INT, "married": {"type": "boolean"},
                        "children": INT, "job": WORD}),
    "array_of_arrays": obj({"grid": {"type": "array", "maxItems": 2,
                                     "items": {"type": "array", "items": INT, "maxItems": 3}}}),
    "bool_only": obj({"done": {"type": "boolean"}}),
    "strings_enum_array": obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}}),
}
STRICT_SCHEMA = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": INT}, "required": ["b"]}},
                 "required": ["a"]}  # strict: additionalProperties false applied by the server
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": obj(
    {"city": WORD, "days": {"type": "integer", "minimum": 1, "maximum": 7}})}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": obj({"zone": {"enum": ["UTC", "CET"]}})}}


def start(engine_dir, servers, template_dir=None, **config):
    config = {"model_name": MODEL, "api_key": KEY, "batch": CoreConfig(max_batch=8, method="ngram", calibrate=False),
              **config}
    app = create_app(specrt.load(engine_dir), ServerConfig(**config))
    if template_dir is not None:  # a chat template that defines Hermes-style tool calls
        app.state.server.template = ChatTemplate(template_dir)
    servers.append(BackgroundServer(app).start())
    return servers[-1]


@pytest.fixture(scope="module")
def servers():
    running = []
    yield running
    for s in running:
        s.stop()


@pytest.fixture(scope="module")
def server(demo_engine_dir, servers):
    return start(demo_engine_dir, servers)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, body: dict, path="/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=AUTH, timeout=120)


def content(response: httpx.Response):
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"] if "message" in choice else choice["text"]


# ---- every schema answered with JSON that validates ----------------------------------------------------
def test_every_schema_answers_valid_json(server):
    def ask(item):
        name, schema = item
        if name.startswith(("t", "s")):  # some through /v1/completions and vLLM's field
            r = post(server, {"prompt": "record = ", "max_tokens": 200, "temperature": 0,
                              "structured_outputs": {"json": schema}}, "/v1/completions")
        else:
            r = post(server, {"messages": ASK, "max_tokens": 200, "temperature": 0, "response_format": {
                "type": "json_schema", "json_schema": {"name": name, "schema": schema}}})
        return name, content(r)

    with ThreadPoolExecutor(8) as pool:  # concurrent: the rows share target passes
        answers = dict(pool.map(ask, SCHEMAS.items()))
    assert len(answers) == len(SCHEMAS) >= 20
    for name, text in answers.items():
        jsonschema.validate(json.loads(text), SCHEMAS[name], cls=jsonschema.Draft202012Validator)


def test_strict_schema_admits_only_listed_properties(server):
    r = post(server, {"messages": ASK, "max_tokens": 100, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": STRICT_SCHEMA, "strict": True}}})
    closed = {**STRICT_SCHEMA, "additionalProperties": False,
              "properties": {"a": {**STRICT_SCHEMA["properties"]["a"], "additionalProperties": False}}}
    jsonschema.validate(json.loads(content(r)), closed)


def test_regex_choice_and_grammar(server):
    assert content(post(server, {"messages": ASK, "temperature": 0, "max_tokens": 20,
                                 "structured_outputs": {"regex": "[A-Z][a-z]{2,5} [0-9]{2}"}})).count(" ") == 1
    assert content(post(server, {"messages": ASK, "temperature": 0, "guided_choice": ["alpha", "beta"]})) in \
        ("alpha", "beta")
    text = content(post(server, {"messages": ASK, "temperature": 0.8, "seed": 3, "max_tokens": 40,
                                 "structured_outputs": {"grammar": 'root ::= "x=" [0-9] [0-9]? [0-9]? ";"'}}))  # GBNF
    assert text.startswith("x=") and text.endswith(";") and text[2:-1].isdigit()


# ---- the openai client --------------------------------------------------------------------------------
def test_openai_client_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["nested"], "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0, max_tokens=120)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS["nested"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0,
                                                 max_tokens=120, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    out = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                         temperature=0.7, seed=1, max_tokens=300,
                                         extra_body={"speculative": {"method": "none"}})  # seeded plain: deterministic
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)


def test_openai_client_tools(client):
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    out = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK], tool_choice="required",
                                         temperature=0, max_tokens=150, parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")
    # parallel calls (the default): this small model repeats its call until max_tokens; every complete call is valid
    out = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK], tool_choice="required",
                                         temperature=0, max_tokens=60)
    calls = out.choices[0].message.tool_calls
    assert len(calls) > 1 and len({c.id for c in calls}) == len(calls)
    for call in calls[:-1] if out.choices[0].finish_reason == "length" else calls:
        json.loads(call.function.arguments)
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK], tool_choice=named,
                                         temperature=0, max_tokens=100, parallel_tool_calls=False)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    # streamed: a header with id, type and name, then argument pieces; rebuilt == the whole answer's
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK], tool_choice=named,
                                                 temperature=0, max_tokens=100, stream=True))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or ())]
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == "get_time"
    assert all(p.index == 0 and p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the conversation goes on with the call and its result
    follow = ask + [out.choices[0].message,  # the client's own message object, sent back as it is
                    {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    out = client.chat.completions.create(model=MODEL, messages=follow, temperature=0, max_tokens=5)
    assert out.choices[0].message.content is not None


def test_tagged_tool_calls_on_a_hermes_template(demo_engine_dir, servers, tmp_path_factory):
    template = tmp_path_factory.mktemp("hermes")
    (template / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    srv = start(demo_engine_dir, servers, template_dir=template)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    body = {"messages": ask, "tools": [WEATHER, CLOCK], "temperature": 0, "max_tokens": 120}
    r = post(srv, {**body, "tool_choice": "required", "parallel_tool_calls": False}).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls"
    (call,) = r["message"]["tool_calls"]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    auto = post(srv, {**body, "max_tokens": 30}).json()["choices"][0]  # tool_choice defaults to "auto"
    assert auto["message"]["content"] is not None or auto["message"]["tool_calls"]
    streamed = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, **body, "max_tokens": 30, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == (auto["message"]["content"] or "")


# ---- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "additionalProperties": True}}}}, "response_format", "additionalProperties"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar", "nothing_defined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice",
     "not among the request's tools"),
    ({"tools": [WEATHER]}, "tool_choice", "template defines none"),  # "auto" (the default) without a format
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "cannot be combined"),
    ({"speculative": {"method": "eagle"}}, "speculative.method", "available: "),
    ({"speculative": {"gamma": 99}}, "speculative.gamma", "0..4"),
    ({"logit_bias": {"4096": 5}}, "logit_bias", "outside the vocabulary"),
])
def test_refused_with_a_400_naming_the_field(server, body, param, message):
    r = post(server, {"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


# ---- compilation off the event loop ---------------------------------------------------------------------
class GatedCompiler:
    """Holds every compile until ``gate`` opens (the test opens it once another stream has moved on)."""

    def __init__(self, inner):
        self.inner, self.started, self.gate = inner, threading.Event(), threading.Event()

    def compile(self, spec, max_seconds=10.0):
        self.started.set()
        assert self.gate.wait(60), "the gate never opened: the other stream stalled while this compiled"
        return self.inner.compile(spec, max_seconds=max_seconds)


def wait_until(predicate, seconds=60.0) -> bool:
    done = threading.Event()
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        done.wait(0.02)
    return predicate()


def test_a_compiling_grammar_stalls_no_other_stream(server, monkeypatch):
    gated = GatedCompiler(server.app.state.server.runtime.grammar_compiler)
    monkeypatch.setattr(Runtime, "grammar_compiler", property(lambda self: gated))
    chunks = []

    def stream():
        body = {"model": MODEL, "prompt": "def parse(text):", "max_tokens": 400, "min_tokens": 400, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            chunks.extend(line for line in r.iter_lines() if line)

    streaming = threading.Thread(target=stream)
    streaming.start()
    with ThreadPoolExecutor(1) as pool:
        try:
            assert wait_until(lambda: len(chunks) > 0)
            constrained = pool.submit(post, server, {"messages": ASK, "max_tokens": 50, "temperature": 0,
                                                     "response_format": {"type": "json_object"}})
            assert gated.started.wait(60)
            before = len(chunks)
            assert wait_until(lambda: len(chunks) >= before + 20), "the stream stalled while a grammar compiled"
        finally:
            gated.gate.set()
        assert isinstance(json.loads(content(constrained.result())), dict)
    streaming.join(120)
    assert chunks[-1] == "data: [DONE]"


def test_over_the_compile_budget_is_a_400(demo_engine_dir, servers):
    srv = start(demo_engine_dir, servers, grammar_timeout=0.05)
    heavy = {"anyOf": [obj({f"k{j}": {"type": "integer"} for j in range(i, i + 30)}, required=[f"k{i}"])
                       for i in range(400)]}  # ~1 s to compile here (the limit: "schema too large")
    r = post(srv, {"messages": ASK, "max_tokens": 5, "structured_outputs": {"json": heavy}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.json"
    assert "0.05 s" in r.json()["error"]["message"]
    assert post(srv, {"messages": ASK, "max_tokens": 5, "temperature": 0}).status_code == 200  # still serving
