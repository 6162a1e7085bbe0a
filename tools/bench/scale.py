"""What Ray Serve adds and what a second replica buys: one `specrt serve` process vs Ray Serve with one
replica vs two replicas on two Ray nodes (on one machine here, so the point is Ray's overhead and
that both replicas serve, not multi-machine scaling).

    python -m specrt.tools.bench.scale ENGINE_DIR --out docs/bench/scale.json

Every configuration gets the same CPUs per replica (``--threads``, default 1 = Ray's ``num_cpus``
per replica), the same greedy streaming clients (tools/bench/serve.py's) at each concurrency, and
the blocks run in the order serve, ray-1, ray-2, then reversed (ABC CBA), each row the mean of the
two. Results: tokens/s, p50/p99 inter-token latency and time to first token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

from .serve import ServeProcess, run_clients, summarize

MODES = ("serve", "ray-1", "ray-2")
KEYS = ("tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms")


def measure(url: str, prompts, concurrency, per_client: int, max_tokens: int) -> dict:
    asyncio.run(run_clients(url, prompts, 1, 1, 4))  # warm-up
    rows = {}
    for c in concurrency:
        t0 = time.perf_counter()
        reqs = asyncio.run(run_clients(url, prompts, c, per_client, max_tokens))
        rows[c] = summarize(reqs, time.perf_counter() - t0, {}, {})
    return rows


class RayCluster:
    """Two local Ray nodes of ``cpus`` CPUs each and a Serve proxy on 127.0.0.1:``port``."""

    def __init__(self, cpus: int, port: int):
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
        self.cluster.add_node(num_cpus=cpus)
        ray.init(address=self.cluster.address, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.url = f"http://127.0.0.1:{port}"

    def deploy(self, spec, replicas: int, cpus: int) -> None:
        import httpx
        from ray import serve

        from ...runtime.serve.ray_serve import deployment

        serve.run(deployment(spec, replicas=replicas, cpus=cpus), name="specrt", route_prefix="/")
        seen, deadline = set(), time.monotonic() + 120
        while len(seen) < replicas and time.monotonic() < deadline:  # every replica routes
            r = httpx.get(self.url + "/health", timeout=30)
            if r.status_code == 200:
                seen.add(r.json().get("replica"))

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        self.cluster.shutdown()


def main(argv=None) -> None:
    from ...runtime.core import CoreConfig
    from ...runtime.serve.app import AppSpec, ServerConfig
    from ..prompts import CODE
    from .serve import free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine_dir")
    ap.add_argument("--out", default=None)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--method", default="none")
    ap.add_argument("--threads", type=int, default=1, help="ORT threads (= Ray CPUs) per replica")
    args = ap.parse_args(argv)
    conc = [int(c) for c in args.concurrency.split(",")]
    serve_args = ["--model-name", "bench", "--max-batch", str(args.max_batch), "--method", args.method,
                  "--threads", str(args.threads), "--log-level", "error"]
    spec = AppSpec(args.engine_dir, ServerConfig(model_name="bench", batch=CoreConfig(max_batch=args.max_batch,
                                                                                       method=args.method)),
                   threads=args.threads)
    runs = {m: [] for m in MODES}
    ray_cluster = RayCluster(args.threads, free_port())
    try:
        for mode in (*MODES, *reversed(MODES)):
            if mode == "serve":
                with ServeProcess(args.engine_dir, serve_args) as srv:
                    rows = measure(srv.url, CODE, conc, args.requests_per_client, args.max_tokens)
            else:
                ray_cluster.deploy(spec, replicas=int(mode[-1]), cpus=args.threads)
                rows = measure(ray_cluster.url, CODE, conc, args.requests_per_client, args.max_tokens)
            runs[mode].append(rows)
            print(mode, {c: round(r["tokens_per_s"]) for c, r in rows.items()}, flush=True)
    finally:
        ray_cluster.close()
    table = {m: {c: {k: float(np.mean([rep[c][k] for rep in runs[m]])) for k in KEYS} for c in conc} for m in MODES}
    print("\n| clients | " + " | ".join(f"{m} tok/s (ITL p50/p99 ms, TTFT p50 ms)" for m in MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for c in conc:
        cells = [f"{table[m][c]['tokens_per_s']:.0f} ({table[m][c]['itl_p50_ms']:.1f} / {table[m][c]['itl_p99_ms']:.1f}, "
                 f"{table[m][c]['ttft_p50_ms']:.0f})" for m in MODES]
        print(f"| {c} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "table": table, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
