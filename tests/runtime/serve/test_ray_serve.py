"""`specrt serve` on Ray Serve: a two-node local cluster (started and stopped here, loopback only),
two replicas, one per node. Greedy output equals rt.generate, both replicas serve, streams end,
a disconnect is cancelled on its replica, a killed replica is replaced, metrics show both."""
import os
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[test,ray]')")

import specrt  # noqa: E402
from specrt.runtime.core import CoreConfig  # noqa: E402
from specrt.runtime.serve.app import AppSpec, ServerConfig  # noqa: E402

MODEL = "tiny-ray"


@pytest.fixture(scope="module")
def engine(build_engine):
    """No EOS token: every generation runs to max_tokens (a long one is still running when its client leaves)."""
    return build_engine("ray", dict(arch="llama", seed=0, scale=30.0, eos_token_id=None),
                        dict(arch="llama", seed=1, hidden=16, layers=1, scale=30.0, eos_token_id=None), max_len=512)


def wait_until(predicate, timeout=60.0, every=0.2):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
            if value:
                return value
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(every)


def replicas_seen(url: str, n: int = 20) -> set:
    return {httpx.get(url + "/health", timeout=30).json().get("replica") for _ in range(n)}


def ray_metrics(cluster) -> dict:
    """(name, replica) -> value over every node's metrics agent (ray_specrt_* gauges)."""
    out = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        text = httpx.get(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("ray_specrt_") and 'replica="' in line:
                name = line.split("{", 1)[0]
                replica = line.split('replica="', 1)[1].split('"', 1)[0]
                out[(name, replica)] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def cluster(engine):
    from ray import serve
    from ray.cluster_utils import Cluster

    from specrt.runtime.serve.ray_serve import deployment

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": {"metrics_report_interval_ms": 1000}})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    port = 18000 + os.getpid() % 1000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = AppSpec(str(engine), ServerConfig(model_name=MODEL, batch=CoreConfig(max_batch=4, method="draft")))
    serve.run(deployment(spec, replicas=2, cpus=1, metrics_interval=0.5), name="specrt", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: all(httpx.get(url + "/health", timeout=10).status_code == 200 for _ in range(20)))
    yield c, url
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def test_greedy_through_ray_equals_the_runtime_on_both_replicas(cluster, engine):
    _, url = cluster
    ref = specrt.load(engine)
    for prompt in ("hello world", "the cat sat on", "abc abc abc"):
        want = ref.generate(prompt, max_new_tokens=24, method="none").text
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                          "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert len(replicas_seen(url) - {None}) == 2  # requests land on both replicas (one per node)


def test_streaming_through_ray_ends_with_done(cluster):
    _, url = cluster
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 17


def test_a_disconnect_is_cancelled_on_its_replica_and_metrics_show_both(cluster):
    c, url = cluster
    before = sum(v for (name, _), v in ray_metrics(c).items() if name == "ray_specrt_requests_cancelled_total")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token received: leave mid-generation
    cancelled = wait_until(lambda: sum(v for (name, _), v in ray_metrics(c).items()
                                       if name == "ray_specrt_requests_cancelled_total") > before)
    assert cancelled
    m = wait_until(lambda: (lambda m: m if len({r for (n, r) in m if n == "ray_specrt_steps_total"}) == 2 else None)(
        ray_metrics(c)))
    assert all(v >= 0 for v in m.values())


def test_a_killed_replica_is_replaced_and_requests_keep_succeeding(cluster):
    _, url = cluster
    before = replicas_seen(url) - {None}
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(sorted(before)[0]))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    ok = 0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and ok < 20:  # every request after the failover is answered
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4,
                                                      "temperature": 0}, timeout=60)
        ok = ok + 1 if r.status_code == 200 else 0
    assert ok == 20
    after = wait_until(lambda: (lambda s: s if len(s) == 2 and s != before else None)(replicas_seen(url) - {None}),
                       timeout=90, every=1.0)
    assert sorted(before)[0] not in after  # the killed replica was replaced by a new one


def test_serve_run_app_builder_validates_its_arguments(engine):
    from specrt.runtime.serve.ray_serve import app_builder

    with pytest.raises(ValueError, match="engine_dir=DIR is required"):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="unknown arguments \\['bogus'\\]"):
        app_builder({"engine_dir": str(engine), "bogus": "1"})
    app = app_builder({"engine_dir": str(engine), "replicas": "2", "max_batch": "4", "method": "ngram",
                       "prefix_cache_mb": "64"})
    assert app is not None
