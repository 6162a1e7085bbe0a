"""Benchmark `specrt serve` under load: throughput and latency with speculation off, forced on, and under the policy.

    python -m specrt.tools.bench.serve ENGINE_DIR --out serve-bench.json

For each mode (off: ``--method none``; on: ``--gamma G`` every step; policy: the batch-aware
policy) it starts ``specrt serve`` as a subprocess on 127.0.0.1 (a free port), and for each
concurrency c runs c streaming clients that each send ``--requests-per-client`` greedy
requests back to back. It records tokens/s (all tokens / wall time), inter-token latency
(gaps between streamed tokens; p50/p99), time per output token, time to first token, and
from /metrics the acceptance rate and the share of steps that speculated. Bounded: at most
modes × concurrencies × c × requests-per-client requests of ``--max-tokens`` tokens, and no
new configuration starts after ``--time-limit`` seconds (the rest are reported as skipped).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import checkout_env

MODES = ("off", "on", "policy")


@dataclass
class BenchConfig:
    engine_dir: str  # the engine dir to serve
    out: str  # JSON results file
    concurrency: list = field(default_factory=lambda: [1, 4, 16])  # concurrent clients per configuration
    modes: list = field(default_factory=lambda: list(MODES))  # off | on | policy
    requests_per_client: int = 2  # sequential requests per client
    max_tokens: int = 48  # tokens per request
    max_batch: int = 16  # server --max-batch
    method: str | None = None  # proposer for "on" and "policy" (default: draft if the engine has one, else ngram)
    gamma: int | None = None  # γ for "on" (default: the engine's exported gamma)
    time_limit: float = 600.0  # seconds; configurations not started by then are skipped
    threads: int | None = None  # server --threads (ONNX Runtime intra-op threads; None = ORT's default)
    prompts: list = field(default_factory=list)  # prompts cycled over requests (default: tools/prompts.py CODE)
    ab: str | None = None  # another checkout: every configuration runs on it and on this one, alternately


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`specrt serve` in a subprocess on loopback; stopped (terminated) on exit."""

    def __init__(self, engine_dir: str, args: list[str], checkout: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "from specrt.tools.cli import main; main()", "serve", engine_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", "--model-name", "bench",
               *args]
        self.links, env = checkout_env(checkout) if checkout is not None else (None, None)  # None: this checkout
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

    def __enter__(self) -> "ServeProcess":
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specrt serve exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("specrt serve did not become healthy in 120 s")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.links is not None:
            self.links.cleanup()


async def one_request(http, url: str, prompt: str, max_tokens: int) -> dict:
    """A streaming greedy completion; arrival times of its token chunks."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals, tokens = [], 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return {"start": t0, "arrivals": arrivals, "tokens": tokens}


async def run_clients(url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> list[dict]:
    import httpx

    async def client(i: int) -> list[dict]:
        out = []
        for j in range(per_client):
            prompt = prompts[(i * per_client + j) % len(prompts)]
            out.append(await one_request(http, url, prompt, max_tokens))
        return out

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        results = await asyncio.gather(*(client(i) for i in range(clients)))
    return [r for rs in results for r in rs]


def scrape(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def summarize(requests: list[dict], wall: float, before: dict, after: dict) -> dict:
    gaps = np.array([b - a for r in requests for a, b in zip(r["arrivals"], r["arrivals"][1:])])  # [G] seconds
    ttft = np.array([r["arrivals"][0] - r["start"] for r in requests if r["arrivals"]])
    tpot = np.array([(r["arrivals"][-1] - r["arrivals"][0]) / (len(r["arrivals"]) - 1)
                     for r in requests if len(r["arrivals"]) > 1])
    tokens = sum(r["tokens"] for r in requests)

    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    def pct(a, q):
        return float(np.percentile(a, q)) if a.size else None

    steps, proposed = d("specrt_steps_total"), d("specrt_proposed_tokens_total")
    return {"requests": len(requests), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "itl_p50_ms": 1e3 * pct(gaps, 50) if gaps.size else None,
            "itl_p99_ms": 1e3 * pct(gaps, 99) if gaps.size else None,
            "tpot_mean_ms": 1e3 * float(tpot.mean()) if tpot.size else None,
            "ttft_p50_ms": 1e3 * pct(ttft, 50) if ttft.size else None,
            "ttft_p99_ms": 1e3 * pct(ttft, 99) if ttft.size else None,
            "steps": steps, "mean_batch": d("specrt_sequence_passes_total") / steps if steps else None,
            "speculative_step_share": d("specrt_speculative_steps_total") / steps if steps else None,
            "acceptance_rate": d("specrt_accepted_tokens_total") / proposed if proposed else None,
            "tokens_per_target_pass": d("specrt_step_tokens_total") / max(d("specrt_sequence_passes_total"), 1)}


def run(cfg: BenchConfig, log=print) -> dict:
    import specrt

    from ..prompts import CODE

    manifest = specrt.load(cfg.engine_dir).manifest
    method = cfg.method or ("draft" if manifest.draft is not None else "ngram")
    gamma = manifest.gamma if cfg.gamma is None else cfg.gamma
    prompts = cfg.prompts or CODE
    server_args = {"off": ["--method", "none"], "on": ["--method", method, "--gamma", str(gamma)],
                   "policy": ["--method", method]}
    results = {"config": {**asdict(cfg), "method": method, "gamma_on": gamma, "prompts": len(prompts)}, "runs": []}
    t_start = time.monotonic()
    for i, mode in enumerate(cfg.modes):
        if time.monotonic() - t_start > cfg.time_limit:
            results["runs"] += [{"mode": mode, "concurrency": c, "skipped": "time limit"} for c in cfg.concurrency]
            continue
        args = ["--max-batch", str(cfg.max_batch), *server_args[mode]]
        args += ["--threads", str(cfg.threads)] if cfg.threads else []
        checkouts = [("this", None)] if cfg.ab is None else [("ab", cfg.ab), ("this", None)]
        if i % 2:
            checkouts.reverse()  # alternate which side goes first
        for side, checkout in checkouts:
            with ServeProcess(cfg.engine_dir, args, checkout) as server:
                asyncio.run(run_clients(server.url, prompts, 1, 1, 4))  # warm-up
                for c in cfg.concurrency:
                    if time.monotonic() - t_start > cfg.time_limit:
                        results["runs"].append({"mode": mode, "concurrency": c, "skipped": "time limit"})
                        continue
                    before = scrape(server.url)
                    t0 = time.perf_counter()
                    reqs = asyncio.run(run_clients(server.url, prompts, c, cfg.requests_per_client, cfg.max_tokens))
                    row = {"mode": mode, "concurrency": c, "checkout": side,
                           **summarize(reqs, time.perf_counter() - t0, before, scrape(server.url))}
                    results["runs"].append(row)
                    log(f"{side:>4} {mode:>6} c={c:<3} {row['tokens_per_s']:8.1f} tok/s  itl p50 "
                        f"{row['itl_p50_ms'] or 0:7.2f} ms  p99 {row['itl_p99_ms'] or 0:7.2f} ms  batch "
                        f"{row['mean_batch'] or 0:5.2f}  speculating {100 * (row['speculative_step_share'] or 0):5.1f}%")
    Path(cfg.out).write_text(json.dumps(results, indent=1))
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine_dir")
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: off,on,policy")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--method", choices=["draft", "ngram", "medusa", "eagle"], default=None)
    p.add_argument("--ab", default=None, help="another specrt checkout: run every configuration on it too, alternately")
    p.add_argument("--gamma", type=int, default=None, help="gamma of mode 'on' (default: the exported gamma)")
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--threads", type=int, default=None, help="server ONNX Runtime intra-op threads")
    p.add_argument("--prompts-file", default=None, help="JSON list of prompt strings")
    a = p.parse_args(argv)
    prompts = json.loads(Path(a.prompts_file).read_text()) if a.prompts_file else []
    run(BenchConfig(engine_dir=a.engine_dir, out=a.out, concurrency=[int(c) for c in a.concurrency.split(",")],
                    modes=a.modes.split(","), requests_per_client=a.requests_per_client, max_tokens=a.max_tokens,
                    max_batch=a.max_batch, method=a.method, gamma=a.gamma, time_limit=a.time_limit, threads=a.threads,
                    prompts=prompts, ab=a.ab))


if __name__ == "__main__":
    main()
