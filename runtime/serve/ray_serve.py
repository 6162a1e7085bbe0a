"""`specrt serve --ray`: specrt's OpenAI server as Ray Serve replicas (``pip install 'specrt[ray]'``).

Every replica builds its own app from the same ``AppSpec`` with ``app.build_app`` (the engine
dir must sit at the same path on every node), so a replica is one `specrt serve` process: its own
engine worker, continuous batching, limits and errors. Ray Serve's proxy spreads requests over the
replicas. What this module adds:

    limits     Serve's ``max_ongoing_requests`` per replica = max_batch + max_queue + 1, so specrt's
               own 429 answers a full replica (Serve's default of 5 starved an 8-slot batch)
    threads    ONNX Runtime intra-op threads = the CPUs Ray gives the replica (``num_cpus``)
    health     ``check_health`` raises once the replica's engine worker stopped: Serve replaces it
    metrics    a thread mirrors the replica's specrt_* and process_* samples into Ray's metrics
               (gauges tagged with deployment and replica; Ray exports them as ``ray_specrt_...``),
               so one Prometheus scrape of the cluster's metrics agents sees every replica

``deployment(spec, ...)`` is the Serve application (``serve.run`` it on an existing cluster, or
use ``docs/scale-out.md``'s config); ``run(...)`` is what `specrt serve --ray` does.
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace

from .app import AppSpec, build_app

MIRRORED = ("specrt_", "process_")  # metric name prefixes mirrored into Ray's metrics


def check_spec(spec: AppSpec) -> AppSpec:
    """On the driver, before anything is deployed: the engine dir is valid and has the method (the
    replicas load the same path). Returns ``spec`` with its method resolved; raises EngineError /
    SamplingError."""
    from ...engines.manifest import load_manifest
    from ..methods import resolve_method

    method = resolve_method(load_manifest(spec.engine_dir), spec.config.batch.method)
    return replace(spec, config=replace(spec.config, batch=replace(spec.config.batch, method=method)))


def replica_options(spec: AppSpec, replicas: int, cpus: float) -> dict:
    """The ``serve.deployment`` options for ``replicas`` replicas of ``spec`` with ``cpus`` CPUs each."""
    cfg = spec.config
    return {"name": "specrt", "num_replicas": replicas, "ray_actor_options": {"num_cpus": cpus},
            "max_ongoing_requests": cfg.batch.max_batch + cfg.max_queue + 1,
            "health_check_period_s": 2, "health_check_timeout_s": 30}


def deployment(spec: AppSpec, replicas: int = 1, cpus: float = 1.0, metrics_interval: float = 2.0):
    """The bound Serve application: ``replicas`` specrt replicas of ``cpus`` CPUs each."""
    from ray import serve

    @serve.deployment(**replica_options(spec, replicas, cpus))
    @serve.ingress()
    class SpecrtReplica:
        def __init__(self, spec: AppSpec, cpus: float, metrics_interval: float):
            context = serve.get_replica_context()
            self.replica = context.replica_id.unique_id
            threads = spec.threads or max(1, int(cpus))
            # (``self.app`` is Serve's read-only property: the app lives in ``self.specrt_app``)
            self.specrt_app = build_app(replace(spec, threads=threads, config=replace(spec.config, replica=self.replica)))
            self.mirror = MetricsMirror(self.specrt_app.state.server.metrics.registry, metrics_interval)
            self.mirror.start()

        def __serve_build_asgi_app__(self):
            return self.specrt_app

        def check_health(self) -> None:
            if not self.specrt_app.state.server.worker.running:
                raise RuntimeError(f"replica {self.replica}: specrt's engine worker is not running")

        def __del__(self):
            if getattr(self, "mirror", None) is not None:
                self.mirror.stop()

    return SpecrtReplica.bind(spec, cpus, metrics_interval)


def app_builder(args: dict):
    """Ray's ``serve run`` entry point (values arrive as strings):

        serve run specrt.runtime.serve.ray_serve:app_builder engine_dir=/models/engine replicas=2 cpus=4 \
            max_batch=8 max_queue=128 method=draft model_name=code api_key=KEY threads=4

    Only ``engine_dir`` is required; the rest default as in `specrt serve`.
    """
    from pathlib import Path

    from ..core import CoreConfig
    from .config import ServerConfig

    known = {"engine_dir", "replicas", "cpus", "max_batch", "max_queue", "method", "gamma", "model_name", "api_key",
             "threads", "backend"}
    unknown = sorted(set(args) - known)
    if unknown or "engine_dir" not in args:
        raise ValueError(f"specrt app_builder: engine_dir=DIR is required; unknown arguments {unknown}; "
                         f"known: {', '.join(sorted(known))}")
    get = lambda k, cast, default: cast(args[k]) if k in args else default  # noqa: E731
    config = ServerConfig(model_name=args.get("model_name") or Path(args["engine_dir"]).resolve().name,
                          max_queue=get("max_queue", int, 128), api_key=args.get("api_key"),
                          batch=CoreConfig(max_batch=get("max_batch", int, 8), method=args.get("method"),
                                           gamma=get("gamma", int, None)))
    spec = check_spec(AppSpec(args["engine_dir"], config, backend=args.get("backend", "ort"),
                              threads=get("threads", int, None)))
    return deployment(spec, replicas=get("replicas", int, 1), cpus=get("cpus", float, 1.0))


class MetricsMirror:
    """Copies a prometheus_client registry's samples into Ray gauges every ``interval`` s (a thread)."""

    def __init__(self, registry, interval: float):
        self.registry, self.interval = registry, interval
        self.gauges: dict = {}  # (name, tag keys) -> ray.serve.metrics.Gauge
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specrt-ray-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.copy()

    def copy(self) -> None:
        from ray.serve.metrics import Gauge

        for family in self.registry.collect():
            for s in family.samples:
                if not s.name.startswith(MIRRORED) or s.name.endswith("_created"):
                    continue
                keys = tuple(sorted(s.labels))
                gauge = self.gauges.get((s.name, keys))
                if gauge is None:
                    gauge = self.gauges[(s.name, keys)] = Gauge(s.name, family.documentation, tag_keys=keys)
                gauge.set(s.value, tags=dict(s.labels) or None)


def run(spec: AppSpec, replicas: int, address: str | None, host: str, port: int, cpus: float,
        log=print) -> None:
    """Deploy on the Ray cluster at ``address`` (None: start a local one) and serve until SIGINT or
    SIGTERM; then remove the application, and stop the cluster if this call started it. The engine
    dir is checked first (EngineError / SamplingError before anything starts)."""
    spec = check_spec(spec)
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # (a local cluster; set it to "token" for real ones)
    started, stop = address is None, threading.Event()
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose own SIGTERM handler exits mid-call
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(spec, replicas, cpus), name="specrt", route_prefix="/")
        if not stop.is_set():
            log(f"serving {spec.config.model_name!r} on {replicas} Ray Serve replica(s) at http://{host}:{port}")
        while not stop.wait(1.0):
            pass
    except SystemExit:  # SIGTERM while ray.init was starting the cluster
        pass
    finally:
        if ray.is_initialized():
            try:
                serve.delete("specrt")
                serve.shutdown()
            except Exception as e:  # nothing deployed yet, or the cluster is going away
                log(f"stopping Ray Serve: {type(e).__name__}: {e}")
        if started:
            ray.shutdown()  # (also a cluster whose start a SIGTERM interrupted)
