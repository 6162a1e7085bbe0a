"""The serving parts one app's route handlers share (``ServerState``), and the FastAPI dependency
(``Server``) through which a handler receives them.

``create_app`` builds one ``ServerState`` per app and keeps it in ``app.state.server``; nothing is
global, so several apps can live in one process::

    @router.get("/health")
    async def health(server: Server):  # FastAPI passes request.app.state.server
        ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

if TYPE_CHECKING:
    from ..api import Runtime
    from ..core import DecodeCore
    from .answer import Answerer
    from .chat import ChatTemplate
    from .config import ServerConfig
    from .metrics import ServerMetrics
    from .worker import EngineWorker


@dataclass
class ServerState:
    """One app's runtime, engine worker, metrics and answerer."""

    runtime: Runtime  # the loaded engine dir: tokenizer, manifest (max_len, tokenizer_dir), target geometry
    config: ServerConfig  # the server's options (model name, limits, keys)
    core: DecodeCore  # the decode core the worker steps: runtime.new_core(config.batch)
    worker: EngineWorker  # the thread that owns ``core``, and its bounded FIFO queue
    metrics: ServerMetrics  # the app's own Prometheus registry (GET /metrics)
    answer: Answerer  # answer(request, job): submits a Job to ``worker``; streams or collects its events
    template: ChatTemplate  # renders chat messages into one prompt text
    keys: tuple  # the API keys (str each; api_keys(config.api_key)); () = no authentication

    @property
    def model(self) -> str:
        """The served model's id (GET /v1/models, responses' ``model``)."""
        return self.config.model_name

    @property
    def model_names(self) -> tuple:
        """The ids a request may name in ``model``: the served model's, then its aliases."""
        return (self.config.model_name, *self.config.model_aliases)

    @property
    def max_len(self) -> int:
        """Tokens the engine's cache holds: prompt + completion."""
        return self.runtime.manifest.max_len


async def server_state(request: Request) -> ServerState:
    """The state of the app that received ``request`` (async: FastAPI would run a plain def on a thread)."""
    return request.app.state.server


Server = Annotated[ServerState, Depends(server_state)]  # a handler parameter of this type gets its app's state
