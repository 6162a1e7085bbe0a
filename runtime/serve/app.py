"""`specrt serve`'s app: ``create_app(runtime, config)`` assembles an OpenAI-compatible FastAPI app over
one ``DecodeCore`` and its engine worker (started and stopped with the app's lifespan).

    build_app(spec)        loads an engine dir, then create_app: the builder of `specrt serve` and of
                           each Ray Serve replica
    create_app(rt, cfg)    the app's state (state.py), middleware and error handlers (middleware.py),
                           and endpoints (routes.py)
    BackgroundServer(app)  runs an app under uvicorn on a thread (tests, benchmarks)

Nothing is global, so several apps can live in one process. See docs/serving.md for the endpoints,
errors, metrics and the batch-aware speculation policy.
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial

from fastapi import FastAPI

from .answer import Answerer
from .chat import ChatTemplate
from .config import ServerConfig, api_keys
from .metrics import ServerMetrics
from .middleware import add_error_handlers, add_middleware
from .routes import openapi_document, router
from .state import ServerState
from .worker import EngineWorker

__all__ = ["AppSpec", "BackgroundServer", "ServerConfig", "api_keys", "build_app", "create_app"]


@dataclass
class AppSpec:
    """Everything `specrt serve` builds an app from; picklable: Ray ships it to every replica."""

    engine_dir: str  # the engine dir (on every node, at this path)
    config: ServerConfig  # server options; config.batch.method None = the engine dir's default
    backend: str = "ort"  # ort | torch
    threads: int | None = None  # ONNX Runtime intra-op threads (None: ORT's choice)
    device: str | None = None  # cpu | cuda (None: cpu)
    attention: str | None = None  # auto | ort | specrt: who computes the graphs' attention (None: $SPECRT_ATTENTION, else auto)


def build_app(spec: AppSpec) -> FastAPI:
    """Load the engine dir and build its app: the one builder of `specrt serve` under uvicorn and of
    each Ray Serve replica. Raises EngineError, SamplingError or ValueError with the user's message."""
    from ..api import Runtime

    options = {k: v for k, v in (("device", spec.device), ("threads", spec.threads)) if v}
    if spec.attention and spec.backend == "ort":
        options["attention"] = spec.attention
    elif spec.attention not in (None, "auto"):
        raise ValueError(f"attention {spec.attention!r} runs with the ort backend, not {spec.backend!r}")
    rt = Runtime.load(spec.engine_dir, backend=spec.backend, **options)
    batch = replace(spec.config.batch, method=rt.resolve_method(spec.config.batch.method))
    return create_app(rt, replace(spec.config, batch=batch))


def create_app(runtime, config: ServerConfig) -> FastAPI:
    """An ASGI app serving ``runtime``'s engine dir. The engine worker runs while the app's lifespan does."""
    server = new_server_state(runtime, config)
    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.server = server  # what the handlers receive (state.Server)
    add_middleware(app, config, server.metrics)
    add_error_handlers(app)
    app.include_router(router)
    app.openapi = partial(openapi_document, app, config.model_name)
    return app


def new_server_state(runtime, config: ServerConfig) -> ServerState:
    """The decode core (``runtime.new_core(config.batch)``), its worker, metrics and answerer."""
    keys = api_keys(config.api_key)  # (a malformed key fails before the core is built)
    core = runtime.new_core(config.batch)
    metrics = ServerMetrics(max_batch=config.batch.max_batch, policy=core.policy,
                            current_alpha=lambda: core.served.alpha, prefix_hit_tokens=lambda: core.prefix.hit_tokens)
    worker = EngineWorker(core, config.max_queue, on_step=metrics.observe_step, on_cancel=metrics.observe_cancel,
                          on_admit=metrics.queue_wait.observe)
    answer = Answerer(worker, metrics, config.model_name, runtime.tokenizer)
    return ServerState(runtime, config, core, worker, metrics, answer, ChatTemplate(runtime.manifest.tokenizer_dir),
                       keys)


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Runs the app's engine worker while the app serves."""
    worker = app.state.server.worker
    worker.start()
    try:
        yield
    finally:
        worker.stop()


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
