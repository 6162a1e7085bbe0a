"""The OpenAI-compatible surface of `specrt serve`: request schemas and response bodies (chat templates: runtime/serve/chat.py).

Requests are validated strictly where it protects: a wrong type or an out-of-range value is a 400 with an
OpenAI-style error body (``error_body``). Unknown top-level fields are ignored, as vLLM and llama-server ignore
them, and named in the response's ``X-Specrt-Ignored-Fields`` header and the server's log (``parse_request``; with
``strict=True``, `specrt serve --strict-api`, they are a 400 as OpenAI's). ``model`` may be left out (the served
model). llama.cpp's ``n_predict`` is read as ``max_tokens``. Fields of OpenAI's API
that specrt does not implement (best_of, suffix, functions, ...; tools on /v1/completions) are accepted
at their neutral value (what clients send by default) and refused with a 400 naming the field otherwise;
integral floats are accepted where the API takes an integer (16.0 for 16), as OpenAI's server does.
Structured outputs (response_format, vLLM's structured_outputs and guided_*), tools, logit_bias,
min_tokens and the per-request ``speculative`` extension are fields of the schemas below; what they
become is runtime/serve/structured.py's, tools.py's and inputs.py's.
"""
from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

STRICT = ConfigDict(extra="forbid", strict=True)


def _integral(v):
    """16.0 -> 16 (OpenAI accepts integral floats for integer fields); anything else is left to validation."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]

# OpenAI fields specrt does not implement -> the values that mean "off" (accepted; anything else: 400)
NEUTRAL = {"logit_bias": ({}, None), "echo": (False, None), "suffix": (None, ""),
           "best_of": (None, 1), "response_format": (None, {"type": "text"}), "tools": (None, []),
           "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False), "functions": (None, []),
           "function_call": (None, "none"), "service_tier": (None, "auto", "default"), "store": (None, False),
           "metadata": (None, {}), "modalities": (None, ["text"]),
           "prediction": (None,), "reasoning_effort": (None,), "audio": (None,), "web_search_options": (None,)}


class ApiRequest(BaseModel):
    """A request body's schema: ``ignored`` holds the unknown top-level fields ``parse_request`` dropped."""

    model_config = STRICT
    _ignored: tuple = PrivateAttr(default=())

    @property
    def ignored(self) -> tuple:
        return self._ignored


class ApiError(Exception):
    """An error answered with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RefusedField(ValueError):
    """A schema validator's refusal, answered as it stands: a 400 with this message, ``param`` and ``code``.

    Validators must raise ValueError for pydantic to collect the error; pydantic keeps the exception
    itself in the error's context, where ``parse_request`` finds it by type::

        raise RefusedField("top_logprobs needs logprobs=true", param="top_logprobs")
        # -> 400 {"error": {"message": "top_logprobs needs logprobs=true", "param": "top_logprobs",
        #                   "code": "invalid_value", "type": "invalid_request_error"}}
    """

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def api_error(self) -> ApiError:
        return ApiError(400, self.message, param=self.param, code=self.code)


NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    """response_format {"type": "json_schema", "json_schema": {...}} (OpenAI's)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field("response", pattern=NAME)  # required by OpenAI; vLLM and llama-server do without
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # true: objects admit only their listed properties (structured.strict_schema)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type "json_schema" only
    schema_: dict | None = Field(None, alias="schema")  # llama-server's {"type": "json_object", "schema": {...}}

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.schema_ is not None:
            if self.type != "json_object":
                raise RefusedField('response_format takes "schema" with type "json_object" only (llama-server\'s form)',
                                   param="response_format")
            return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=self.schema_))
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise RefusedField('response_format needs "json_schema" exactly when its type is "json_schema"',
                               param="response_format")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json (a schema, or its JSON text), regex, choice, grammar
    (Lark as llguidance takes it, or GBNF), json_object (true)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise RefusedField("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                               f"got {', '.join(k.rstrip('_') for k in given) or 'none'}", param="structured_outputs")
        return self


class Speculative(BaseModel):
    """The specrt extension ``speculative``: how THIS request is decoded (the response's ``speculation``
    reports what ran)."""

    model_config = STRICT
    method: str | None = None  # one the server was started with (--method), or "none"; None: the server's default
    gamma: Int | None = Field(None, ge=0)  # fixed draft length (0 = no speculation); None: the batch-aware policy


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False  # send a last chunk with empty choices and the usage


class SamplingFields(ApiRequest):
    """Fields shared by completions and chat completions (OpenAI's names and ranges)."""

    model: str | None = None  # the served model's id or an alias (GET /v1/models); None: the served model
    temperature: float = Field(1.0, ge=0, le=2)  # 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    n: Int = Field(1, ge=1, le=128)  # choices: independent samples sharing the prompt's prefill (<= --max-batch)
    stream: bool = False  # server-sent events, ending with "data: [DONE]"
    stream_options: StreamOptions | None = None  # only with stream=true
    stop: str | list[str] | None = None  # a string of any length, or a list of up to 4
    seed: Int | None = Field(None, ge=0)  # reproducible sampling (per request random stream)
    user: str | None = None  # accepted and ignored
    top_k: Int = Field(0, ge=0)  # extension: 0 = off
    min_p: float = Field(0.0, ge=0, lt=1)  # extension: 0 = off
    presence_penalty: float = Field(0.0, ge=-2, le=2)  # minus this on the logit of every token already generated
    frequency_penalty: float = Field(0.0, ge=-2, le=2)  # minus this per occurrence in the generated text
    repetition_penalty: float = Field(1.0, ge=0.01, le=100)  # extension (vLLM's): seen tokens' logits / r (or * r)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100] added to its logit
    min_tokens: Int = Field(0, ge=0)  # extension (vLLM's): EOS and stop ids are masked until this many tokens
    response_format: ResponseFormat | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM's); guided_* are read into it
    speculative: Speculative | None = None  # extension: this request's method and γ

    @model_validator(mode="before")
    @classmethod
    def _neutral_fields(cls, data: Any):
        """Drop OpenAI fields specrt does not implement when they hold their neutral value; refuse others;
        vLLM's older guided_json / guided_regex / guided_choice / guided_grammar become structured_outputs."""
        if not isinstance(data, dict):
            return data
        if "n_predict" in data:  # llama.cpp's name for max_tokens (-1: no limit)
            n = data["n_predict"]
            data = {k: v for k, v in data.items() if k != "n_predict"}
            if "max_tokens" not in data and "max_completion_tokens" not in data:
                data["max_tokens"] = None if n == -1 else n
        guided = {GUIDED[k]: v for k, v in data.items() if k in GUIDED and v is not None}
        if guided:
            if data.get("structured_outputs") is not None:
                raise RefusedField("send structured_outputs or guided_*, not both", param="structured_outputs")
            data = {**{k: v for k, v in data.items() if k not in GUIDED}, "structured_outputs": guided}
        for name, neutral in NEUTRAL.items():
            if name in data and name not in cls.model_fields:  # (a schema that implements it validates it)
                value = data[name]
                if not any(type(value) is type(v) and value == v for v in neutral if v is not None) and value is not None:
                    raise RefusedField(f"{name}={value!r} is not supported by specrt (only its neutral value is "
                                       "accepted)", param=name, code="unsupported_parameter")
                data = {k: v for k, v in data.items() if k != name}
        return data

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v):
        """OpenAI's shape: {"<token id>": bias in [-100, 100]} (the ids are checked against the vocabulary later)."""
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise RefusedField(f"logit_bias keys are token ids (decimal strings), got {key!r}", param="logit_bias")
            if not -100 <= bias <= 100:
                raise RefusedField(f"logit_bias values must be in [-100, 100], got {bias} for token {key}",
                                   param="logit_bias")
        return v

    @model_validator(mode="after")
    def _one_output_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise RefusedField("send response_format or structured_outputs, not both", param="structured_outputs")
        limit = self.max_new_tokens
        if limit is not None and self.min_tokens > limit:
            raise RefusedField(f"min_tokens ({self.min_tokens}) is larger than max_tokens ({limit})",
                               param="min_tokens")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise RefusedField("stream_options is only allowed with stream=true", param="stream_options")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]  # text, token ids, or a list holding ONE text
    echo: bool = False  # the prompt's text comes before the completion in "text" (the first chunk when streaming)
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's default 16; None = until the cache is full
    logprobs: Int | None = Field(None, ge=0, le=20)  # each token's logprob and this many alternatives

    @model_validator(mode="after")
    def _no_prompt_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise RefusedField("echo with logprobs (the prompt's logprobs) is not supported by specrt", param="echo",
                               code="unsupported_parameter")
        return self

    @property
    def top(self) -> int | None:
        return self.logprobs

    @property
    def max_new_tokens(self) -> int | None:
        """The completion's token limit (None: until the cache is full)."""
        return self.max_tokens


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An earlier assistant message's tool call, sent back in the conversation."""

    model_config = STRICT
    id: str
    type: Literal["function"]
    function: CalledFunction


MESSAGE_NEUTRAL = ("refusal", "audio", "function_call", "annotations", "reasoning_content")  # None: dropped


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this is the result of

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_fields(cls, data: Any):
        """A message echoed back from a response may carry refusal / audio / ... as null (the openai client's)."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (k in MESSAGE_NEUTRAL and v is None)}
        return data

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (and only tool messages carry one)")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it (HF's shape): content text (None with only tool calls), and
        tool calls' arguments as objects where they are JSON objects (templates write them with tojson)."""
        out = {"role": self.role, "content": None if self.content is None else self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _json_or_text(text: str):
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # true: OpenAI's strict schema rule for the arguments (structured.strict_schema)


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)  # None = until the cache is full
    max_completion_tokens: Int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False  # each generated token's logprob in choices[].logprobs.content
    top_logprobs: Int | None = Field(None, ge=0, le=20)  # and this many alternatives (needs logprobs=true)
    tools: list[Tool] | None = None  # function tools (runtime/serve/tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = None  # None = true: one or more calls; false: exactly one
    continue_final_message: bool | None = None  # vLLM's: a final assistant message is continued (None: yes)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise RefusedField("top_logprobs needs logprobs=true", param="top_logprobs")
        return self

    @property
    def tool_choice_name(self) -> str:
        """tool_choice as one string: "none" | "auto" | "required" | the named function's name."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return choice if isinstance(choice, str) else choice.function.name

    @property
    def top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        """The completion's token limit (None: until the cache is full)."""
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(ApiRequest):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(ApiRequest):
    model: str | None = None
    tokens: list[Int]


EXTRA_NAMES = ("n_predict",)  # top-level names read by a schema's before-validator, besides NEUTRAL's and GUIDED's


@functools.cache
def known_fields(schema: type[BaseModel]) -> frozenset:
    """The top-level names ``schema`` reads: its fields (and their aliases) and those its validators take."""
    names = {f.alias or name for name, f in schema.model_fields.items()} | set(schema.model_fields)
    return frozenset(names | (set(NEUTRAL) | set(GUIDED) | set(EXTRA_NAMES) if issubclass(schema, SamplingFields)
                              else set()))


def parse_request(raw: bytes, schema: type[ApiRequest], strict: bool = True) -> ApiRequest:
    """JSON bytes -> a validated request, or ApiError(400) naming the field. ``strict``: an unknown top-level
    field is a 400 (OpenAI's rule); else it is dropped and named in the request's ``ignored`` (vLLM's and
    llama-server's rule). Unknown fields inside objects (a message, response_format, ...) are 400s either way."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # nesting deeper than the interpreter's recursion limit (~1000)
        raise ApiError(400, "request body nests too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    known = known_fields(schema)
    ignored = () if strict else tuple(k for k in data if k not in known)
    try:
        req = schema.model_validate({k: v for k, v in data.items() if k not in ignored})
    except ValidationError as e:
        raise validation_error(e.errors()[0]) from None
    req._ignored = ignored
    return req


def validation_error(err: dict) -> ApiError:
    """The ApiError(400) answering pydantic's (first) validation error ``err``: a validator's ``RefusedField``
    as it stands, else a message and code by the error's kind, naming the field's dotted path."""
    refusal = err.get("ctx", {}).get("error")
    if isinstance(refusal, RefusedField):
        return refusal.api_error()
    param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    kind = err["type"]
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown parameter: {param!r}", param=param, code="unknown_parameter")
    if kind == "missing":
        return ApiError(400, f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    return ApiError(400, f"invalid value for {param!r}: {err['msg']}", param=param, code="invalid_value")


def _is_union_tag(part) -> bool:
    """pydantic puts the union member tried into error locations ("str", "list[int]", "TextPart"): drop it."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part
                                      or part[:1].isupper())


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache skipped (runtime/prefix_cache.py)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def speculation_field(stats: list[dict]) -> dict:
    """The ``speculation`` extension field: the request's proposals and acceptance over its choices
    (``stats``: one ``DecodeCore.stats_for`` per choice); with an output constraint also ``forced`` and
    ``forced_accepted``, the grammar's forced tokens proposed as drafts (not in ``proposed``)."""
    forced = {k: sum(s[k] for s in stats) for k in ("forced", "forced_accepted") if k in stats[0]}
    if len(stats) == 1:
        return {**{k: stats[0][k] for k in ("method", "proposed", "accepted", "acceptance_rate", "target_passes",
                                            "tokens_per_pass", "rounds")}, **forced}
    total = {k: sum(s[k] for s in stats) for k in ("proposed", "accepted", "target_passes", "rounds")}
    return {"method": stats[0]["method"], **total,
            "acceptance_rate": total["accepted"] / total["proposed"] if total["proposed"] else 0.0,
            "tokens_per_pass": (total["accepted"] + total["rounds"]) / max(total["rounds"], 1), **forced}


def fingerprint() -> str:
    """``system_fingerprint`` of every response and chunk: the specrt version that answered."""
    from ... import __version__

    return f"specrt-{__version__}"


def completion_body(rid: str, model: str, choices: list[dict], use: dict, stats: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(), "choices": choices, "usage": use, "speculation": stats}


def chat_body(rid: str, model: str, choices: list[dict], use: dict, stats: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(), "choices": choices, "usage": use, "speculation": stats}


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(index: int, text: str | None, finish: str, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """A chat choice; with ``tool_calls`` ([{"id", "type": "function", "function": {"name", "arguments"}}])
    the message carries them (``text`` None: no content besides the calls)."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(), "choices": [completion_choice(index, text, finish, logprobs)]}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, index: int = 0,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


# ---- logprobs (entries: (token text, logprob, ((text, logprob), ...) alternatives) per token) --------
FLOOR = -9999.0  # a filtered token's log-probability (-inf is not JSON), as OpenAI's and vLLM's servers send


def _lp(x: float) -> float:
    return x if x > FLOOR else FLOOR


def completion_logprobs(entries: list[tuple], offset: int) -> dict:
    """The legacy completions ``logprobs`` object; ``offset``: text length before the first token."""
    offsets, at = [], offset
    for text, _, _ in entries:
        offsets.append(at)
        at += len(text)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [_lp(lp) for _, lp, _ in entries],
            "top_logprobs": [{t: _lp(lp) for t, lp in top} for _, _, top in entries], "text_offset": offsets}


def chat_logprobs(entries: list[tuple]) -> dict:
    """Chat's ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(text, lp):
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(), "choices": [], "usage": use}


def sse(data) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``[DONE]``) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
