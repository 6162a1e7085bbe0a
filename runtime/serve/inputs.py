"""From one HTTP request to the engine's inputs, step by step: the caller's API key, the body, its
schema, the model it names, the prompt's token ids and the sampling parameters.

Every step raises ``ApiError`` carrying the answer (status and OpenAI-style body); the handlers of
routes.py chain the steps they need, e.g. a completion::

    scope = authorize(server, request)                     # 401
    req = await parse(server, request, CompletionRequest)  # 408, 413, 415, 400 naming the field
    check_model(server, req.model)                         # 404
    plan = tool_plan(server, req)                          # chat: 400 for tools the template cannot answer
    prompt = completion_prompt(server, req)                # 400: prompt form, length, token ids
    params = sampling_params(server, req, prompt.ids)      # 400: context length, sampling values, logit_bias ids
    options = request_options(server, req)                 # 400: a method the server does not run, γ
    grammar = await output_grammar(server, req, plan)      # 400: a constraint that does not compile in time
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

from fastapi import Request

from ..api import PromptTooLongError
from ..sampling import SamplingError, SamplingParams, check_logit_bias
from .chat import TemplateInputError
from .openai_api import ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest, parse_request
from .state import ServerState
from .structured import compile_constraint, output_constraint
from .tools import ToolChoiceError, ToolPlan, plan_tools

log = logging.getLogger("specrt.serve")


def authorize(server: ServerState, request: Request) -> str | None:
    """The request's cache scope ("key-<i>" for the i-th key; None when no key is set), or ApiError 401."""
    if not server.keys:
        return None
    scheme, _, key = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 9110)
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    given = key.strip().encode()
    hits = [secrets.compare_digest(given, k.encode()) for k in server.keys]  # every key compared: no early exit
    if not any(hits):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
    return f"key-{hits.index(True)}"


async def read_body(server: ServerState, request: Request) -> bytes:
    """The request body, refused with 415 unless JSON (a cross-origin form post cannot be), 413 past
    ``max_body_bytes`` (checked against Content-Length first, then while reading) and 408 when it takes
    longer than ``body_timeout``."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {kind or 'none'!r}",
                       code="unsupported_media_type")
    limit, timeout = server.config.max_body_bytes, server.config.body_timeout
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout") from None
    return bytes(body)


async def parse(server: ServerState, request: Request, schema):
    """The body as a validated ``schema``, parsed off the event loop: a huge body costs its own
    request's latency, not everyone's."""
    req = await asyncio.to_thread(parse_request, await read_body(server, request), schema, server.config.strict_api)
    if req.ignored:
        log.warning("%s: ignored unknown field(s) %s (--strict-api refuses them)", request.url.path,
                    ", ".join(req.ignored))
    return req


def check_model(server: ServerState, name: str | None) -> None:
    """ApiError 404 unless ``name`` is None (the served model) or one of the served model's ids."""
    if name is not None and name not in server.model_names:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {server.model!r}", param="model",
                       code="model_not_found")


def encode(server: ServerState, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids (text is tokenized, ids are checked), or ApiError 400 naming "prompt"."""
    try:
        ids = server.runtime.encode(prompt)
    except PromptTooLongError as e:
        raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from None
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), param="prompt", code="invalid_value") from None
    limit = server.config.max_prompt_tokens
    if limit is not None and len(ids) > limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limit}", param="prompt",
                       code="context_length_exceeded")
    return ids


def render_and_encode(server: ServerState, messages: list[ChatMessage], tools: list[dict] | None = None,
                      continue_final: bool = False) -> list[int]:
    """Chat messages (and OpenAI function ``tools``) rendered with the chat template, then encoded;
    ``continue_final``: the prompt ends inside the final (assistant) message, whose reply continues it."""
    from jinja2 import TemplateError

    try:
        rendered = [m.for_template() for m in messages]
        template = server.template
        prompt = template.continue_final(rendered, tools) if continue_final else template.render(rendered, tools=tools)
    except TemplateInputError as e:
        raise ApiError(400, f"chat template rejected the messages: {e}", param="messages") from None
    except (TemplateError, TypeError) as e:  # a template that cannot render these messages (e.g. a tool turn)
        raise ApiError(400, f"the chat template failed on the messages: {type(e).__name__}: {e}",
                       param="messages") from None
    return encode(server, prompt)


@dataclass
class Prompt:
    """A completion request's prompt, encoded."""

    ids: list[int]  # the prompt's token ids
    echo: str = ""  # completions with echo=true: the prompt's text, put before each choice's text


def completion_prompt(server: ServerState, req: CompletionRequest) -> Prompt:
    """/v1/completions' prompt: text, token ids, or a list of ONE text (more is a 400)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request: send a string, token ids, or a list of one string",
                           param="prompt", code="invalid_value")
        prompt = prompt[0]
    ids = encode(server, prompt)
    if not req.echo:
        return Prompt(ids)
    return Prompt(ids, prompt if isinstance(prompt, str) else server.runtime.tokenizer.decode(ids))


def chat_prompt(server: ServerState, req: ChatCompletionRequest) -> Prompt:
    """/v1/chat/completions' prompt: the messages rendered with the chat template (and the tools, unless
    tool_choice is "none")."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice_name != "none" \
        else None
    return Prompt(render_and_encode(server, req.messages, tools, continues_final(req)))


def continues_final(req: ChatCompletionRequest) -> bool:
    """Whether the reply continues the final message: an assistant's partial reply ends the messages (as
    llama-server; vLLM's ``continue_final_message``, which may also turn it off); ApiError 400 for two or more
    trailing assistant messages (as llama-server)."""
    roles = [m.role for m in req.messages]
    if roles[-1] != "assistant" or req.messages[-1].tool_calls or req.continue_final_message is False:
        return False
    if len(roles) > 1 and roles[-2] == "assistant":
        raise ApiError(400, "at most one assistant message may end the messages (it is continued)", param="messages")
    return True


def sampling_params(server: ServerState, req, ids: list[int]) -> list[SamplingParams]:
    """One ``SamplingParams`` per choice (n) of a completion request ``req`` whose prompt is ``ids``;
    with a seed, choice i samples with seed + i. A prompt and ``req.max_new_tokens`` past the engine's
    context are refused, not silently capped (as vLLM)."""
    check_context_length(server, len(ids), req.max_new_tokens)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        bias = check_logit_bias({int(k): v for k, v in (req.logit_bias or {}).items()},
                                server.runtime.target.spec.geometry.vocab_size)
    except SamplingError as e:
        raise ApiError(400, str(e), param="logit_bias", code="invalid_value") from None
    try:
        return [SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                               seed=None if req.seed is None else req.seed + i,
                               max_new_tokens=req.max_new_tokens or server.max_len - len(ids), stop=stop,
                               presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                               repetition_penalty=req.repetition_penalty, logprobs=req.top, logit_bias=bias,
                               min_tokens=req.min_tokens)
                for i in range(req.n)]
    except SamplingError as e:
        raise ApiError(400, str(e), code="invalid_value") from None


def request_options(server: ServerState, req) -> dict:
    """The request's ``speculative`` extension as SequenceRequest fields {"method", "gamma"} (absent: the
    server's); ApiError 400 for a method the server was not started with, or a γ past the exported one."""
    spec = req.speculative
    if spec is None:
        return {}
    methods = server_methods(server)
    if spec.method is not None and spec.method not in methods:
        raise ApiError(400, f"speculative.method {spec.method!r} is not running on this server; available: "
                       f"{', '.join(methods)} (start it with specrt serve --method)", param="speculative.method",
                       code="invalid_value")
    top = server.core.gamma_max
    if spec.gamma is not None and spec.gamma > top:
        raise ApiError(400, f"speculative.gamma must be in 0..{top} (the engine's exported verify shape), got "
                       f"{spec.gamma}", param="speculative.gamma", code="invalid_value")
    return {"method": spec.method, "gamma": spec.gamma}


def server_methods(server: ServerState) -> tuple:
    """The methods a request may ask for: those the core serves ("none" always among them)."""
    return tuple(server.core.proposers)


def tool_plan(server: ServerState, req) -> ToolPlan | None:
    """How a chat request's tools constrain its answer (runtime/serve/tools.py), or None; ApiError 400 for
    tool_choice the model's template cannot answer, a missing named function, or tools with structured_outputs."""
    if not isinstance(req, ChatCompletionRequest) or not req.tools and req.tool_choice_name in ("none", "auto"):
        return None
    choice = req.tool_choice_name
    if choice != "none" and req.structured_outputs is not None:
        raise ApiError(400, "structured_outputs cannot be combined with tools (tool_choice "
                       f"{choice!r}); use response_format", param="structured_outputs", code="invalid_value")
    fmt = output_constraint(req) if choice == "auto" else None  # "auto": a text answer follows response_format
    text_schema = None if fmt is None else (fmt[0].value if fmt[0].kind == "json_schema" else {"type": "object"})
    try:
        return plan_tools([t.model_dump() for t in req.tools or ()], choice, req.parallel_tool_calls is not False,
                          server.template.writes_tool_calls, text_schema)
    except ToolChoiceError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


async def output_grammar(server: ServerState, req, plan: ToolPlan | None):
    """The request's compiled constraint (tools' plan, else response_format / structured_outputs), or None."""
    if plan is not None:
        return await compile_constraint(server, plan.constraint, "tools")
    wanted = output_constraint(req)
    return None if wanted is None else await compile_constraint(server, *wanted)


def check_context_length(server: ServerState, prompt_tokens: int, max_tokens: int | None) -> None:
    """ApiError 400 naming "max_tokens" when the prompt and ``max_tokens`` do not fit the engine's context."""
    limit = server.max_len
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
                       "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
