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
use ``docs/scale-out.md``'s config); ``run(...)`` is what `specrt serve --ray`'s driver process does
(``ray_session.py`` starts it in a session of its own), stopping in order on SIGTERM / SIGINT.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace

from .app import AppSpec, build_app

MIRRORED = ("specrt_", "process_")  # metric name prefixes mirrored into Ray's metrics
CLUSTER_STOP_S = 15.0  # what a stopping driver gives ray.shutdown (about 8 s on 2 busy cores, GCS gone)


def check_spec(spec: AppSpec) -> AppSpec:
    """On the driver, before anything is deployed: the engine dir is valid and has the method (the
    replicas load the same path). Returns ``spec`` with its method resolved; raises EngineError /
    SamplingError."""
    from ...engines.manifest import load_manifest
    from ..methods import resolve_method

    method = resolve_method(load_manifest(spec.engine_dir), spec.config.batch.method)
    return replace(spec, config=replace(spec.config, batch=replace(spec.config.batch, method=method)))


def replica_options(spec: AppSpec, replicas: int, cpus: float, drain_timeout: float = 30.0) -> dict:
    """The ``serve.deployment`` options for ``replicas`` replicas of ``spec`` with ``cpus`` CPUs each; a
    stopping replica waits up to ``drain_timeout`` s for its running requests."""
    cfg = spec.config
    return {"name": "specrt", "num_replicas": replicas, "ray_actor_options": {"num_cpus": cpus},
            "max_ongoing_requests": cfg.batch.max_batch + cfg.max_queue + 1,
            "health_check_period_s": 2, "health_check_timeout_s": 30,
            "graceful_shutdown_timeout_s": drain_timeout}


def deployment(spec: AppSpec, replicas: int = 1, cpus: float = 1.0, metrics_interval: float = 2.0,
               drain_timeout: float = 30.0):
    """The bound Serve application: ``replicas`` specrt replicas of ``cpus`` CPUs each."""
    from ray import serve

    @serve.deployment(**replica_options(spec, replicas, cpus, drain_timeout))
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
            max_batch=8 max_queue=128 method=draft model_name=code api_key=KEY threads=4 prefix_cache_mb=512

    Only ``engine_dir`` is required; the rest default as in `specrt serve` (``prefix_cache_mb=0``: no
    host-memory tier of the prefix cache).
    """
    from pathlib import Path

    from ..core import CoreConfig
    from .config import ServerConfig

    known = {"engine_dir", "replicas", "cpus", "max_batch", "max_queue", "method", "gamma", "model_name", "api_key",
             "threads", "backend", "prefix_cache_mb"}
    unknown = sorted(set(args) - known)
    if unknown or "engine_dir" not in args:
        raise ValueError(f"specrt app_builder: engine_dir=DIR is required; unknown arguments {unknown}; "
                         f"known: {', '.join(sorted(known))}")
    get = lambda k, cast, default: cast(args[k]) if k in args else default  # noqa: E731
    config = ServerConfig(model_name=args.get("model_name") or Path(args["engine_dir"]).resolve().name,
                          max_queue=get("max_queue", int, 128), api_key=args.get("api_key"),
                          batch=CoreConfig(max_batch=get("max_batch", int, 8), method=args.get("method"),
                                           gamma=get("gamma", int, None),
                                           **({"prefix_cache_mb": float(args["prefix_cache_mb"])}
                                              if "prefix_cache_mb" in args else {})))
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


class StopRequests:
    """The signal handler of `specrt serve --ray`'s driver: the first SIGINT/SIGTERM asks for a drain
    (``drain``), a second one to stop now (``now``: skip what is left of the drain, still stop Ray).
    ``run`` sets ``serve_removed`` once Serve's part of the stop is over, ``finished`` once all is.

        stop = StopRequests(); stop.install()   # (again after ray.init, which sets its own)
    """

    def __init__(self):
        self.drain, self.now = threading.Event(), threading.Event()
        self.serve_removed, self.finished = threading.Event(), threading.Event()

    def __call__(self, *_) -> None:
        (self.now if self.drain.is_set() else self.drain).set()

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)


def gcs_answers(address: str | None) -> bool:
    """Whether the GCS at ``host:port`` accepts a connection (None, unknown: assumed to)."""
    if not address:
        return True
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
        return True
    except OSError:
        return False


def watch_stop(stop: StopRequests, gcs: str | None, drain_timeout: float, stop_cluster, log) -> None:
    """A thread: once a stop was asked for and until Serve is removed, ends the process (after
    ``stop_cluster()``, given ``CLUSTER_STOP_S``) when the drain runs past ``drain_timeout`` s, on a
    second signal, or once the cluster's GCS stops answering: a SIGTERM to the whole service (systemd's
    control-group stop) also reaches Ray's own processes, and Serve's calls (``serve.run`` included)
    then block 60 s on the lost GCS before Ray ends the process with exit 1. Also ends it if stopping
    the cluster afterwards takes more than ``CLUSTER_STOP_S``. (Ray's processes on this machine die
    with this one: Ray ties them to it; `specrt serve --ray` also kills what is left in their session.)"""
    stop.drain.wait()
    deadline = time.monotonic() + drain_timeout
    while not stop.serve_removed.wait(0.2):
        reason = ("a second signal" if stop.now.is_set() else "Ray's GCS is gone" if not gcs_answers(gcs)
                  else f"the drain timeout ({drain_timeout:g} s)" if time.monotonic() > deadline else None)
        if reason:
            log(f"stopping Ray Serve: {reason}; not waiting for it")
            ending = threading.Thread(target=stop_cluster, name="specrt-ray-shutdown", daemon=True)
            ending.start()
            ending.join(CLUSTER_STOP_S)
            exit_now()
    if not stop.finished.wait(CLUSTER_STOP_S):
        log(f"stopping the Ray cluster took more than {CLUSTER_STOP_S:g} s: not waiting for it")
        exit_now()


def exit_now() -> None:
    """Ends the process with exit 0 although its main thread is blocked in a Ray call."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(spec: AppSpec, replicas: int, address: str | None, host: str, port: int, cpus: float,
        drain_timeout: float = 30.0, log=print, stop: StopRequests | None = None) -> None:
    """Deploy on the Ray cluster at ``address`` (None: start a local one) and serve until SIGINT or
    SIGTERM; then remove the application (replicas drain up to ``drain_timeout`` s) and, if this call
    started the cluster, Serve and the cluster. A second signal, a drain past its timeout or a lost
    GCS end the process at once (after stopping the cluster it started: ``watch_stop``). The engine
    dir is checked first (EngineError / SamplingError before anything starts). `specrt serve --ray`
    runs this in a process of its own session (``ray_session.py``), so a signal to its process group
    reaches Ray's processes only through this stop."""
    spec = check_spec(spec)
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # (a local cluster; set it to "token" for real ones)
    started, stop, one_shutdown = address is None, stop or StopRequests(), threading.Lock()

    def stop_cluster() -> None:
        with one_shutdown:
            if started:
                ray.shutdown()  # kills its processes (also those of a start a SIGTERM interrupted)

    if stop.drain.is_set():  # a signal while this process started
        return
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        stop.install()  # after ray.init, whose own SIGTERM handler exits mid-call
        threading.Thread(target=watch_stop, args=(stop, gcs_address(), drain_timeout, stop_cluster, log),
                         name="specrt-ray-stop", daemon=True).start()
        if not stop.drain.is_set():
            serve.start(http_options={"host": host, "port": port})
            serve.run(deployment(spec, replicas, cpus, drain_timeout=drain_timeout), name="specrt",
                      route_prefix="/")
        if not stop.drain.is_set():
            log(f"serving {spec.config.model_name!r} on {replicas} Ray Serve replica(s) at http://{host}:{port}")
        while not stop.drain.wait(1.0):
            pass
    except SystemExit:  # SIGTERM while ray.init was starting the cluster
        pass
    finally:
        if ray.is_initialized():
            remove_app(started, log)
        stop.serve_removed.set()
        stop_cluster()
        stop.finished.set()


def remove_app(started: bool, log) -> None:
    """Deletes the application (its replicas drain) and, on the cluster this process started, Serve
    (on someone else's, Serve may run other applications)."""
    from ray import serve

    try:
        serve.delete("specrt")
        if started:
            serve.shutdown()
    except (Exception, SystemExit) as e:  # nothing deployed yet, or the cluster is going away (a Ray call
        # that ray.shutdown or a lost raylet cuts short raises SystemExit)
        log(f"stopping Ray Serve: {type(e).__name__}: {e}")


def gcs_address() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # (a Ray Client connection has none here)
        return None
