"""The HTTP endpoints of `specrt serve`, one small handler each, on ``router`` (``create_app`` includes it).

A handler receives its app's ``ServerState`` through the ``Server`` dependency and chains the request
steps of inputs.py. Both completion endpoints are ``complete``: authorize, parse, check the model,
encode the prompt, then admit the job and answer it (streamed or one body)::

    POST /v1/completions         complete(request, server, CompletionRequest, completion_prompt, chat=False)
    POST /v1/chat/completions    complete(request, server, ChatCompletionRequest, chat_prompt, chat=True)

The handlers parse raw request bytes themselves (strict 400s, body limits), so ``openapi_document``
describes the request bodies FastAPI cannot see.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .answer import Job
from .inputs import (Prompt, authorize, chat_prompt, check_model, completion_prompt, encode, output_grammar, parse,
                     render_and_encode, request_options, sampling_params, tool_plan)
from .openai_api import ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .state import Server, ServerState

router = APIRouter()
IGNORED_HEADER = "X-Specrt-Ignored-Fields"  # the unknown request fields a response ignored


# ---- generation ---------------------------------------------------------------------------------
# Every /v1 path is also served without the prefix (an OpenAI client whose base_url lacks /v1, llama-server's paths)
@router.post("/v1/completions")
@router.post("/completions", include_in_schema=False)
async def completions(request: Request, server: Server):
    return await complete(request, server, CompletionRequest, completion_prompt, chat=False)


@router.post("/v1/chat/completions")
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(request: Request, server: Server):
    return await complete(request, server, ChatCompletionRequest, chat_prompt, chat=True)


async def complete(request: Request, server: ServerState, schema: type,
                   prompt_of: Callable[[ServerState, object], Prompt], chat: bool):
    """One completion request answered: parsed as ``schema``, its prompt encoded by ``prompt_of`` (off
    the event loop), its output constraint (tools, response_format, structured_outputs) compiled on a
    thread, then admitted to the engine worker as one job and answered (429 when the queue is full, 503
    when the worker is not running)."""
    t0 = time.perf_counter()  # time to first token counts from here
    scope = authorize(server, request)
    req = await parse(server, request, schema)
    check_model(server, req.model)
    plan = tool_plan(server, req)
    prompt = await asyncio.to_thread(prompt_of, server, req)  # tokenization off the event loop
    params = sampling_params(server, req, prompt.ids)
    fields = request_options(server, req)
    grammar = await output_grammar(server, req, plan)  # off the event loop, within --grammar-timeout
    if grammar is not None:
        fields["grammar"] = grammar
    usage_chunk = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    job = Job(prompt.ids, params, chat, req.stream, t0, usage_chunk, prompt.echo, cache_scope=scope, fields=fields,
              tools=plan)
    response = await server.answer(request, job)
    if req.ignored:  # unknown fields dropped (ServerConfig.strict_api off): named for the client
        response = response if isinstance(response, Response) else JSONResponse(response)
        response.headers[IGNORED_HEADER] = ", ".join(req.ignored)
    return response



# ---- models, health, metrics, version -----------------------------------------------------------
@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def models(request: Request, server: Server):
    authorize(server, request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "specrt"}
                                       for name in server.model_names]}


@router.get("/v1/models/{model_id}")
@router.get("/models/{model_id}", include_in_schema=False)
async def model_card(model_id: str, request: Request, server: Server):
    authorize(server, request)
    check_model(server, model_id)
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "specrt", "max_model_len": server.max_len}


@router.get("/health")
async def health(server: Server):
    worker, config = server.worker, server.config
    body = {"status": "ok" if worker.running else "unavailable", "model": server.model, "batch_size": worker.active,
            "queue_depth": worker.queue_depth, "max_batch": config.batch.max_batch}
    if config.replica is not None:
        body["replica"] = config.replica
    return JSONResponse(body, status_code=200 if worker.running else 503)


@router.head("/health")
async def health_head(server: Server):
    return Response(status_code=200 if server.worker.running else 503)


@router.get("/metrics")
async def prometheus(server: Server):
    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    from ... import __version__

    return {"version": __version__}


# ---- tokenizer ----------------------------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(request: Request, server: Server):
    req = await tokenizer_request(request, server, TokenizeRequest)
    if req.messages is not None:
        ids = await asyncio.to_thread(render_and_encode, server, req.messages)
    elif req.prompt is not None:
        ids = await asyncio.to_thread(encode, server, req.prompt)
    else:
        raise ApiError(400, "send \"prompt\" or \"messages\"", param="prompt", code="missing_required_parameter")
    return {"tokens": ids, "count": len(ids), "max_model_len": server.max_len}


@router.post("/detokenize")
async def detokenize(request: Request, server: Server):
    req = await tokenizer_request(request, server, DetokenizeRequest)
    vocab = server.runtime.target.spec.geometry.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                       code="invalid_value")
    texts = await asyncio.to_thread(server.runtime.tokenizer.decode_batch, [req.tokens])  # releases the GIL
    return {"prompt": texts[0]}


async def tokenizer_request(request: Request, server: ServerState, schema: type):
    """A /tokenize or /detokenize request: authorized, parsed, and naming this model if it names one."""
    authorize(server, request)
    req = await parse(server, request, schema)
    check_model(server, req.model)
    return req


# ---- OpenAPI ------------------------------------------------------------------------------------
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def openapi_document(app: FastAPI, model: str) -> dict:
    """FastAPI's OpenAPI document with the request bodies described (the handlers parse raw bytes
    themselves, so FastAPI cannot see them): each schema's JSON Schema, ``model`` naming this server's."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, schema in REQUEST_BODIES.items():
            body = schema.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            if "model" in body["properties"]:
                body["properties"]["model"] = {"type": "string", "enum": [model]}
            schemas[schema.__name__] = body
            ref = {"$ref": f"#/components/schemas/{schema.__name__}"}
            doc["paths"][path]["post"]["requestBody"] = {"required": True,
                                                         "content": {"application/json": {"schema": ref}}}
        for param in doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
            param["schema"] = {"type": "string", "enum": [model]}
        app.openapi_schema = doc
    return app.openapi_schema
