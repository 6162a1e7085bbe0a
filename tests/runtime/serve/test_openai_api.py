"""Request parsing of `specrt serve` (runtime/serve/openai_api.py): OpenAI's field forms, neutral values of fields
specrt does not implement, integral floats, nesting; each refusal is a 400 naming the field."""
import json

import pytest

from specrt.runtime.serve.openai_api import ApiError, ChatCompletionRequest, CompletionRequest, parse_request

BASE = {"model": "m", "prompt": "hi"}


def parse(body, schema=CompletionRequest, strict=True):
    return parse_request(json.dumps(body).encode() if not isinstance(body, bytes) else body, schema, strict)


@pytest.mark.parametrize("extra,field,value", [
    ({"stop": "\nclass"}, "stop", "\nclass"),  # one string, any length
    ({"stop": ["a", "b", "c", "d"]}, "stop", ["a", "b", "c", "d"]),
    ({"max_tokens": 16.0}, "max_tokens", 16),  # integral floats where the API takes an integer
    ({"seed": 7.0}, "seed", 7),
    ({"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": None, "echo": False,
      "best_of": 1, "suffix": None, "user": "u"}, "max_tokens", 16),  # what clients send by default
    ({"echo": True}, "echo", True),  # completions implement echo
    ({"frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.2}, "presence_penalty", -1),
    ({"logprobs": 3}, "top", 3),
    ({"n": 3}, "n", 3),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream", True),
])
def test_accepted(extra, field, value):
    assert getattr(parse({**BASE, **extra}), field) == value


@pytest.mark.parametrize("extra,param,message", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences"),
    ({"max_tokens": 16.5}, "max_tokens", "valid integer"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than or equal to 0.01"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"logprobs": 2, "echo": True}, "echo", "echo with logprobs"),
    ({"best_of": 3}, "best_of", "best_of=3 is not supported"),
    ({"logit_bias": {"5": 101}}, "logit_bias", r"must be in \[-100, 100\]"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream=true"),
    ({"no_such_field": 1}, "no_such_field", "unknown parameter"),
])
def test_refused_naming_the_field(extra, param, message):
    with pytest.raises(ApiError, match=message) as e:
        parse({**BASE, **extra})
    assert e.value.status == 400 and e.value.param == param


def test_the_peers_forms_of_an_output_schema():
    """llama-server's {"type": "json_object", "schema": ...} and a json_schema without its name (vLLM, llama-server)
    read as OpenAI's json_schema; nothing but the schema changes; unknown fields inside stay refused."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for form in ({"type": "json_object", "schema": schema}, {"type": "json_schema", "json_schema": {"schema": schema}}):
        fmt = parse({**BASE, "response_format": form}).response_format
        assert fmt.type == "json_schema" and fmt.json_schema.schema_ == schema and fmt.json_schema.name == "response"
    with pytest.raises(ApiError, match='"schema" with type "json_object" only'):
        parse({**BASE, "response_format": {"type": "text", "schema": schema}})
    with pytest.raises(ApiError, match="unknown parameter") as e:
        parse({**BASE, "response_format": {"type": "json_object", "bogus": 1}}, strict=False)
    assert e.value.param == "response_format.bogus"


def test_unknown_top_level_fields_are_ignored_unless_strict():
    req = parse({**BASE, "id_slot": 1, "cache_prompt": False, "n_predict": 5}, strict=False)
    assert req.ignored == ("id_slot", "cache_prompt") and req.max_tokens == 5 and req.model == "m"
    assert parse({"prompt": "hi", "n_predict": -1, "max_tokens": 3}).max_tokens == 3  # max_tokens wins
    assert parse({"prompt": "hi", "n_predict": -1}).max_tokens is None and parse({"prompt": "hi"}).model is None


def test_chat_neutral_tools_fields():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "n": 1.0}
    assert parse(body, ChatCompletionRequest).n == 1


def test_chat_logprobs_fields():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse(body, ChatCompletionRequest).top is None
    assert parse({**body, "logprobs": True}, ChatCompletionRequest).top == 0
    assert parse({**body, "logprobs": True, "top_logprobs": 5}, ChatCompletionRequest).top == 5
    with pytest.raises(ApiError, match="top_logprobs needs logprobs=true") as e:
        parse({**body, "top_logprobs": 5}, ChatCompletionRequest)
    assert e.value.param == "top_logprobs"


def test_deep_nesting_is_a_400_not_a_500():
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError, match="nests too deeply") as e:
        parse(deep)
    assert e.value.status == 400
