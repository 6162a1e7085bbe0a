"""What wraps every route of a `specrt serve` app: per-response metrics, the Host and CORS checks, and
the exception handlers that answer every error with an OpenAI-style body.

Starlette runs the last middleware added outermost: CORS, then the Host check, then the metrics
(so a refused Host is not counted), then the routes. ``ApiError`` and HTTP errors (404, 405) are
answered next to the routes; any other exception by the outermost handler, as a 500.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServerConfig
from .metrics import ServerMetrics
from .openai_api import ApiError, error_body

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/version")  # the metrics' endpoint labels; any other path is "other"


def add_middleware(app: FastAPI, config: ServerConfig, metrics: ServerMetrics) -> None:
    """Response metrics, and the Host and CORS checks ``config`` asks for."""
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if tuple(config.allowed_hosts) != ("*",):
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts))
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # as vLLM's: any request header (the openai JS SDK sends x-stainless-* ones), credentials allowed, so the
        # caller's origin is echoed where "*" allows any
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], allow_credentials=True)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    """The error's own status and body; 429 and 503 also say when to retry."""
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing's errors (an unknown path, a wrong method) with an OpenAI-style body."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(error_body(str(exc.detail), param=None, code=code), status_code=exc.status_code)


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status and times it to its last byte (streams included)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]  # a /v1 endpoint served without /v1 counts as that endpoint
        endpoint = path if path in ENDPOINTS else "/v1" + path if "/v1" + path in ENDPOINTS else "other"
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
