"""The OpenAI-compatible surface of `specrt serve`: request schemas and response bodies (chat templates: runtime/chat.py).

Requests are validated strictly: an unknown field, a wrong type or an out-of-range value is a
400 with an OpenAI-style error body (``error_body``), never silently ignored.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STRICT = ConfigDict(extra="forbid", strict=True)

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


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False  # send a last chunk with empty choices and the usage


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's names and ranges)."""

    model_config = STRICT
    model: str  # must be the served model's id (GET /v1/models)
    temperature: float = Field(1.0, ge=0, le=2)  # 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=1)  # one choice per request
    stream: bool = False  # server-sent events, ending with "data: [DONE]"
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, max_length=4)  # stop strings (excluded from the text)
    seed: int | None = Field(None, ge=0)  # reproducible sampling (per request random stream)
    user: str | None = None  # accepted and ignored
    top_k: int = Field(0, ge=0)  # extension: 0 = off
    min_p: float = Field(0.0, ge=0, lt=1)  # extension: 0 = off


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]  # text, token ids, or a list holding ONE text
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default 16; None = until the cache is full


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None = until the cache is full
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens


def parse_request(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """JSON bytes -> a validated request, or ApiError(400) naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        kind = err["type"]
        if kind == "extra_forbidden":
            raise ApiError(400, f"unknown parameter: {param!r}", param=param, code="unknown_parameter") from None
        if kind == "missing":
            raise ApiError(400, f"missing required parameter: {param!r}", param=param,
                           code="missing_required_parameter") from None
        raise ApiError(400, f"invalid value for {param!r}: {err['msg']}", param=param, code="invalid_value") from None


def _is_union_tag(part) -> bool:
    """pydantic puts the union member tried into error locations ("str", "list[int]", "TextPart"): drop it."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part
                                      or part[:1].isupper())


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation_field(stats: dict) -> dict:
    """The ``speculation`` extension field: this request's proposals and acceptance."""
    return {k: stats[k] for k in ("method", "proposed", "accepted", "acceptance_rate", "target_passes",
                                  "tokens_per_pass", "rounds")}


def completion_body(rid: str, model: str, text: str, finish: str, use: dict, stats: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": use, "speculation": speculation_field(stats)}


def chat_body(rid: str, model: str, text: str, finish: str, use: dict, stats: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": use, "speculation": speculation_field(stats)}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


def sse(data) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``[DONE]``) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
