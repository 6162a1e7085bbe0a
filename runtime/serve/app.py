"""`specrt serve`: an OpenAI-compatible HTTP server over one ``DecodeCore`` (FastAPI + uvicorn).

``create_app(runtime, config)`` builds the app and its engine worker (started and stopped with
the app's lifespan); nothing is global, so several apps can live in one process. See
docs/serving.md for the endpoints, errors, metrics and the batch-aware speculation policy.
"""
from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core import CoreConfig
from .chat import ChatTemplate, TemplateInputError
from .openai_api import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                         error_body, parse_request)
from ..api import PromptTooLongError
from ..sampling import SamplingError, SamplingParams
from .answer import Answerer, Job
from .metrics import ServerMetrics
from .worker import EngineWorker

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/version")


@dataclass
class ServerConfig:
    model_name: str  # the id in GET /v1/models; requests must name it in "model"
    batch: CoreConfig = field(default_factory=CoreConfig)  # slots, method, γ (None = batch-aware policy)
    max_queue: int = 128  # requests waiting for a slot beyond which new ones get 429
    api_key: str | tuple | None = None  # a key or several: /v1/* require "Authorization: Bearer <one of them>";
    # each key's requests share suffix decoding's cache of earlier outputs only among themselves
    max_body_bytes: int = 8 << 20  # a larger request body is answered 413 without being read further
    max_prompt_tokens: int | None = None  # a longer prompt is a 400 (None: the engine's max_len - 1)
    allowed_origins: tuple = ()  # CORS: browser origins allowed to call the API ("*" = any); () = none
    allowed_hosts: tuple = ("*",)  # Host headers answered (others get 400): guards against DNS rebinding
    body_timeout: float = 60.0  # seconds to receive a request's whole body once its headers arrived (else 408)
    replica: str | None = None  # this process's replica id under Ray Serve (reported by /health)


@dataclass
class AppSpec:
    """Everything `specrt serve` builds an app from; picklable: Ray ships it to every replica."""

    engine_dir: str  # the engine dir (on every node, at this path)
    config: ServerConfig  # server options; config.batch.method None = the engine dir's default
    backend: str = "ort"  # ort | torch
    threads: int | None = None  # ONNX Runtime intra-op threads (None: ORT's choice)
    device: str | None = None  # cpu | cuda (None: cpu)


def build_app(spec: AppSpec) -> FastAPI:
    """Load the engine dir and build its app: the one builder of `specrt serve` under uvicorn and of
    each Ray Serve replica. Raises EngineError, SamplingError or ValueError with the user's message."""
    from dataclasses import replace

    from ..api import Runtime

    options = {k: v for k, v in (("device", spec.device), ("threads", spec.threads)) if v}
    rt = Runtime.load(spec.engine_dir, backend=spec.backend, **options)
    batch = replace(spec.config.batch, method=rt.resolve_method(spec.config.batch.method))
    return create_app(rt, replace(spec.config, batch=batch))


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status and times it to its last byte (streams included)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        t0, status = time.perf_counter(), [None]

        async def send_and_observe(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_observe)
        except Exception:
            status[0] = status[0] or 500  # answered by the outermost error middleware
            raise
        finally:
            if status[0] is not None:
                self.metrics.requests.labels(endpoint, str(status[0])).inc()
                self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)


def create_app(runtime, config: ServerConfig) -> FastAPI:
    """An ASGI app serving ``runtime``'s engine dir. The engine worker runs while the app's lifespan does."""
    generator = runtime.new_core(config.batch)
    metrics = ServerMetrics(max_batch=config.batch.max_batch, policy=generator.policy,
                            current_alpha=lambda: generator.served.alpha)
    worker = EngineWorker(generator, config.max_queue, on_step=metrics.observe_step,
                          on_cancel=lambda handle: metrics.cancelled.inc(), on_admit=metrics.queue_wait.observe)
    answer = Answerer(worker, metrics, config.model_name, lambda i: runtime.tokenizer.decode([i]))
    template = ChatTemplate(runtime.manifest.tokenizer_dir)
    model = config.model_name

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.generator = worker, metrics, generator
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if tuple(config.allowed_hosts) != ("*",):
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts))
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), param=None, code=code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    keys = api_keys(config.api_key)

    def authorize(request: Request) -> str | None:
        """The request's cache scope ("key-<i>" for the i-th key; None when no key is set), or ApiError 401."""
        if not keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 9110)
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        given = key.strip().encode()
        hits = [secrets.compare_digest(given, k.encode()) for k in keys]  # every key compared: no early exit
        if not any(hits):
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        return f"key-{hits.index(True)}"

    async def read_body(request: Request) -> bytes:
        """The request body, refused with 415 unless JSON (a cross-origin form post cannot be) and 413 past
        ``max_body_bytes`` (checked against Content-Length first, then while reading)."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got {kind or 'none'!r}",
                           code="unsupported_media_type")
        limit = config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large")
        body = bytearray()
        try:
            async with asyncio.timeout(config.body_timeout):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {config.body_timeout:g} s",
                           code="request_timeout") from None
        return bytes(body)

    async def parse(request: Request, schema):
        """Parse off the event loop: a huge body costs its own request's latency, not everyone's."""
        return await asyncio.to_thread(parse_request, await read_body(request), schema)

    def check_model(name: str) -> None:
        if name != model:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model!r}", param="model",
                           code="model_not_found")

    def encode(prompt) -> list[int]:
        try:
            ids = runtime.encode(prompt)
        except PromptTooLongError as e:
            raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from None
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param="prompt", code="invalid_value") from None
        if config.max_prompt_tokens is not None and len(ids) > config.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                           f"{config.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
        return ids

    def sampling(req, ids: list[int], max_tokens: int | None) -> list[SamplingParams]:
        """One ``SamplingParams`` per choice (n); with a seed, choice i samples with seed + i."""
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        limit = runtime.manifest.max_len
        if max_tokens is not None and len(ids) + max_tokens > limit:  # as vLLM: refused, not silently capped
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                           "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        try:
            return [SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                                   seed=None if req.seed is None else req.seed + i,
                                   max_new_tokens=max_tokens or runtime.manifest.max_len - len(ids), stop=stop,
                                   presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                   repetition_penalty=req.repetition_penalty, logprobs=req.top)
                    for i in range(req.n)]
        except SamplingError as e:
            raise ApiError(400, str(e), code="invalid_value") from None

    @app.get("/health")
    async def health():
        body = {"status": "ok" if worker.running else "unavailable", "model": model, "batch_size": worker.active,
                "queue_depth": worker.queue_depth, "max_batch": config.batch.max_batch}
        if config.replica is not None:
            body["replica"] = config.replica
        return JSONResponse(body, status_code=200 if worker.running else 503)

    @app.head("/health")
    async def health_head():
        return Response(status_code=200 if worker.running else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specrt"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        scope = authorize(request)
        req = await parse(request, CompletionRequest)
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request: send a string, token ids, or a list of one "
                               "string", param="prompt", code="invalid_value")
            prompt = prompt[0]
        ids = await asyncio.to_thread(encode, prompt)  # tokenization off the event loop
        params = sampling(req, ids, req.max_tokens)
        echo = (prompt if isinstance(prompt, str) else runtime.tokenizer.decode(ids)) if req.echo else ""
        return await answer(request, job(req, t0, ids, params, scope, chat=False, echo=echo))

    def render_and_encode(messages) -> list[int]:
        try:
            prompt = template.render([{"role": m.role, "content": m.text()} for m in messages])
        except TemplateInputError as e:
            raise ApiError(400, f"chat template rejected the messages: {e}", param="messages") from None
        return encode(prompt)

    @app.get("/v1/models/{model_id}")
    async def model_card(model_id: str, request: Request):
        authorize(request)
        check_model(model_id)
        return {"id": model, "object": "model", "created": 0, "owned_by": "specrt",
                "max_model_len": runtime.manifest.max_len}

    @app.get("/version")
    async def version():
        from ... import __version__

        return {"version": __version__}

    async def tokenizer_request(request: Request, schema):
        """A /tokenize or /detokenize request: authorized, parsed, and naming this model if it names one."""
        authorize(request)
        req = await parse(request, schema)
        if req.model:
            check_model(req.model)
        return req

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await tokenizer_request(request, TokenizeRequest)
        if req.messages is not None:
            ids = await asyncio.to_thread(render_and_encode, req.messages)
        elif req.prompt is not None:
            ids = await asyncio.to_thread(encode, req.prompt)
        else:
            raise ApiError(400, "send \"prompt\" or \"messages\"", param="prompt", code="missing_required_parameter")
        return {"tokens": ids, "count": len(ids), "max_model_len": runtime.manifest.max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await tokenizer_request(request, DetokenizeRequest)
        vocab = runtime.target.spec.geometry.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                           code="invalid_value")
        text = await asyncio.to_thread(lambda: runtime.tokenizer.decode_batch([req.tokens])[0])  # releases the GIL
        return {"prompt": text}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        scope = authorize(request)
        req = await parse(request, ChatCompletionRequest)
        check_model(req.model)
        ids = await asyncio.to_thread(render_and_encode, req.messages)  # off the event loop
        params = sampling(req, ids, req.max_completion_tokens or req.max_tokens)
        return await answer(request, job(req, t0, ids, params, scope, chat=True))

    def job(req, t0: float, ids: list[int], params: list[SamplingParams], scope: str | None, chat: bool,
            echo: str = "") -> Job:
        usage_chunk = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        return Job(ids, params, chat, req.stream, t0, usage_chunk, echo, scope)

    app.openapi = lambda: openapi_document(app, model)
    return app


def api_keys(api_key) -> tuple:
    """ServerConfig.api_key as a tuple of keys (None or empty: no authentication); a key must be non-empty."""
    keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    if any(not isinstance(k, str) or not k.strip() for k in keys):
        raise ValueError("a key must be non-empty text")
    return keys


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
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/"
                                                                                      f"{schema.__name__}"}}}}
        for param in doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
            param["schema"] = {"type": "string", "enum": [model]}
        app.openapi_schema = doc
    return app.openapi_schema


class BackgroundServer:
    """Run an app under uvicorn on a thread, on 127.0.0.1 and a free port (tests, benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, header_timeout: float = 10.0):
        import uvicorn

        from .http import timed_h11

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                                    http=timed_h11(header_timeout)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
