"""What one `specrt serve` app is configured with: ``ServerConfig``, and the rule for its API keys."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core import CoreConfig


@dataclass
class ServerConfig:
    model_name: str  # the id in GET /v1/models and in responses; requests may name it in "model" (or none)
    model_aliases: tuple = ()  # other ids requests may name in "model" (also listed by GET /v1/models)
    strict_api: bool = False  # an unknown request field is a 400 (OpenAI's rule), not ignored with a warning
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
    grammar_timeout: float = 10.0  # seconds a request's output constraint may take to compile (else 400)


def api_keys(api_key) -> tuple:
    """ServerConfig.api_key as a tuple of keys (None or empty: no authentication); a key must be non-empty.

        api_keys(None) == ()    api_keys("k") == ("k",)    api_keys(["a", "b"]) == ("a", "b")
        api_keys(["a", " "])    # ValueError
    """
    keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    if any(not isinstance(k, str) or not k.strip() for k in keys):
        raise ValueError("a key must be non-empty text")
    return keys
