"""`specrt serve`: an OpenAI-compatible HTTP server over an engine dir (see docs/serving.md)."""
from __future__ import annotations

from pathlib import Path

import click

from ...runtime.methods import METHODS
from .options import attention_option


@click.command()
@click.argument("engine_dir", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1),
              help="Sequences decoded together in one target pass.")
@click.option("--max-queue", default=128, show_default=True, type=click.IntRange(0),
              help="Requests waiting for a slot; more get HTTP 429.")
@click.option("--method", default=None, callback=lambda _ctx, _param, v: methods_option(v),
              help=f"Proposer(s), comma-separated: {', '.join(METHODS)} (none = no speculation). With several "
                   "(e.g. draft,ngram) a request picks one with its 'speculative' field; the first is the default. "
                   "Default: the engine dir's default.")
@click.option("--gamma", default=None, type=int,
              help="Fixed draft length every step (forces speculation on; 0 = off). Default: the batch-aware policy.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Free slots keep finished requests' KV caches; a prompt sharing their prefix skips its prefill.")
@click.option("--prefix-cache-mb", default=512.0, show_default=True, type=click.FloatRange(0),
              help="Host memory for copies of the KV caches the prefix cache's slots give up (with every slot busy, "
                   "a repeated prompt still hits); least recently used first out; 0 = slots only.")
@click.option("--suffix-corpus", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Method suffix: also propose from this corpus of the model's earlier text (.jsonl of {\"text\"}, "
                   "e.g. `specrt train data`'s train.jsonl, or a text file), shared by every API key.")
@click.option("--api-key", multiple=True, envvar="SPECRT_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (repeatable: any of the keys; or set "
                   "SPECRT_API_KEY, keys separated by spaces). Suffix decoding's cache of earlier outputs is kept "
                   "per key.")
@click.option("--model-name", default=None,
              help="Model id in /v1/models and responses, then any aliases, comma-separated (e.g. smollm2,gpt-4o): "
                   "a request may name any of them in 'model', or none. Default: the engine dir's name.")
@click.option("--strict-api", is_flag=True,
              help="Refuse unknown request fields with HTTP 400, as OpenAI does (default: ignore them, naming them in "
                   "the log and the X-Specrt-Ignored-Fields response header, as vLLM and llama-server do).")
@click.option("--threads", default=None, type=click.IntRange(1),
              help="ONNX Runtime intra-op threads (default: ORT's choice).")
@attention_option
@click.option("--backend", default="ort", show_default=True, type=click.Choice(["ort", "torch"]),
              help="Graph backend: ONNX Runtime, or torch over the engine dir's HF weights (export --torch-weights).")
@click.option("--device", default=None, type=click.Choice(["cpu", "cuda"]),
              help="cpu | cuda (default: cpu; ort: cuda = the CUDA execution provider, needs onnxruntime-gpu).")
@click.option("--max-body-bytes", default=8 << 20, show_default=True, type=click.IntRange(1),
              help="Larger request bodies get HTTP 413.")
@click.option("--max-prompt-tokens", default=None, type=click.IntRange(1),
              help="Longer prompts get HTTP 400 (default: the engine's max_len - 1).")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1),
              help="Concurrent connections; more get HTTP 503 (uvicorn limit_concurrency).")
@click.option("--keep-alive-timeout", default=5, show_default=True, type=click.IntRange(1),
              help="Seconds an idle keep-alive connection is held between requests.")
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(0.1),
              help="Seconds a connection has to send a complete request line and headers (slow clients are closed).")
@click.option("--body-timeout", default=60.0, show_default=True, type=click.FloatRange(0.1),
              help="Seconds to receive a request's body once its headers arrived; slower gets HTTP 408.")
@click.option("--max-header-bytes", default=64 << 10, show_default=True, type=click.IntRange(1024),
              help="Request line + headers larger than this close the connection.")
@click.option("--drain-timeout", default=30, show_default=True, type=click.IntRange(1),
              help="Seconds SIGTERM waits for running requests before closing them.")
@click.option("--allowed-origin", "allowed_origins", multiple=True,
              help="A browser origin allowed to call the API (CORS), e.g. https://app.example; repeatable; '*' = any. "
                   "Default: none.")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="A Host header to answer (others get 400), e.g. localhost; repeatable. Default: any.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Serve as Ray Serve replicas (pip install 'specrt[ray]'); see docs/scale-out.md.")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1), help="With --ray: replicas.")
@click.option("--ray-address", default=None,
              help="With --ray: the cluster to deploy on (e.g. auto, ray://head:10001). Default: start a local one.")
@click.option("--cpus-per-replica", default=1.0, show_default=True, type=click.FloatRange(0.1),
              help="With --ray: CPUs Ray reserves per replica (its ONNX Runtime threads unless --threads).")
@click.option("--grammar-timeout", default=10.0, show_default=True, type=click.FloatRange(0.01),
              help="Seconds a request's output constraint (response_format, tools, ...) may take to compile; "
                   "slower gets HTTP 400.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve(engine_dir, host, port, max_batch, max_queue, method, gamma, prefix_cache, prefix_cache_mb, suffix_corpus,
          api_key, model_name, strict_api, threads, attention, backend, device, max_body_bytes, max_prompt_tokens, max_connections, keep_alive_timeout, header_timeout,
          body_timeout, max_header_bytes, drain_timeout, grammar_timeout,
          allowed_origins, allowed_hosts, use_ray, replicas, ray_address, cpus_per_replica, log_level):
    """Serve ENGINE_DIR: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    try:
        import uvicorn

        from ...engines import EngineError
        from ...runtime.core import CoreConfig
        from ...runtime.sampling import SamplingError
        from ...runtime.serve.app import AppSpec, ServerConfig, api_keys, build_app
    except ImportError as e:
        raise click.ClickException(f"serving needs fastapi, uvicorn and prometheus-client: "
                                   f"pip install 'specrt[serve]' ({e})")
    try:
        api_keys(api_key)  # the server's own check, before anything starts (Ray included)
    except ValueError as e:
        raise click.UsageError(f"--api-key: {e}")
    names = [n.strip() for n in (model_name or "").split(",") if n.strip()] or [Path(engine_dir).resolve().name]
    spec = AppSpec(str(engine_dir), ServerConfig(
        model_name=names[0], model_aliases=tuple(names[1:]), strict_api=strict_api, max_queue=max_queue,
        api_key=tuple(api_key) or None, max_body_bytes=max_body_bytes,
        max_prompt_tokens=max_prompt_tokens, allowed_origins=tuple(allowed_origins),
        allowed_hosts=tuple(allowed_hosts) or ("*",), body_timeout=body_timeout, grammar_timeout=grammar_timeout,
        batch=CoreConfig(max_batch=max_batch, method=method, gamma=gamma, prefix_cache=prefix_cache,
                         prefix_cache_mb=prefix_cache_mb, suffix_corpus=suffix_corpus)),
        backend=backend, threads=threads, device=device, attention=attention)
    if use_ray:
        return serve_on_ray(spec, replicas, ray_address, host, port, cpus_per_replica, drain_timeout)
    try:
        app = build_app(spec)
    except (EngineError, ValueError, SamplingError) as e:
        raise click.ClickException(str(e))
    method = app.state.server.core.config.method
    policy = f"fixed gamma {gamma}" if gamma is not None else "batch-aware policy"
    click.echo(f"serving {names[0]!r} ({method}, {policy}, max batch {max_batch}, backend {backend}) on "
               f"http://{host}:{port}", err=True)
    from ...runtime.serve.http import timed_h11

    uvicorn.run(app, host=host, port=port, log_level=log_level, limit_concurrency=max_connections,
                timeout_keep_alive=keep_alive_timeout, h11_max_incomplete_event_size=max_header_bytes,
                timeout_graceful_shutdown=drain_timeout, http=timed_h11(header_timeout))



def serve_on_ray(spec, replicas: int, address, host: str, port: int, cpus: float, drain_timeout: int) -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise click.ClickException("--ray needs Ray Serve: pip install 'specrt[ray]'")
    from ...engines import EngineError
    from ...runtime.serve import ray_serve, ray_session

    try:  # the engine dir and method, before Ray starts
        spec = ray_serve.check_spec(spec)
    except (EngineError, ValueError) as e:
        raise click.ClickException(str(e))
    run_args = dict(spec=spec, replicas=replicas, address=address, host=host, port=port, cpus=cpus,
                    drain_timeout=drain_timeout)
    rc = ray_session.supervise(run_args, drain_timeout, log=lambda m: click.echo(m, err=True))
    if rc:
        raise SystemExit(rc)


def methods_option(value: str | None) -> str | None:
    """--method: one method or several, comma-separated ("draft,ngram"); the runtime's rule (parse_methods)."""
    if value is None:
        return None
    from ...runtime.methods import parse_methods
    from ...runtime.sampling import SamplingError

    try:
        return ",".join(parse_methods(value))
    except SamplingError as e:
        raise click.BadParameter(str(e))
