"""What one hostile client costs everyone else: `specrt serve` (a subprocess, the CLI's defaults) under
each fault while a well-behaved client streams completions back to back.

    python -m specrt.tools.bench.faults ENGINE_DIR [--out faults.json]

For every case it reports the status the faulty request got and what the concurrent streams saw:
their largest wait for a token (from the request to its first token, and between tokens) against
the same streams with no fault (measured first, in the same server).
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import httpx

from .serve import ServeProcess

MODEL = "faults"


def stream_gaps(url: str, max_tokens: int = 32) -> list[float]:
    """Seconds from the request to its first token and between its tokens (one greedy streamed completion)."""
    body = {"model": MODEL, "prompt": "def main(", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    times = [time.perf_counter()]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def half_open(url: str, n: int = 500) -> str:
    """n connections that send half a request line and stall; the server closes them after its keep-alive timeout."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks.append(s)
    time.sleep(12)  # past the default --header-timeout of 10 s
    closed = 0
    for s in socks:
        try:
            s.settimeout(0.01)
            closed += s.recv(1) == b""
        except OSError:
            pass
        s.close()
    return f"{closed}/{n} closed by the server"


def post(url: str, content: bytes, content_type: str = "application/json") -> str:
    r = httpx.post(url + "/v1/completions", content=content, headers={"Content-Type": content_type}, timeout=300)
    code = r.json().get("error", {}).get("code") if r.status_code >= 400 else None
    return f"{r.status_code} {code}" if code else str(r.status_code)


def cases(url: str) -> dict:
    big_prompt = json.dumps({"model": MODEL, "prompt": "abc " * ((8 << 20) // 4 - 1024), "max_tokens": 4}).encode()
    return {
        "10 MB body (over --max-body-bytes)": lambda: post(url, b'{"prompt": "' + b"a" * (10 << 20) + b'"}'),
        "an 8 MB prompt (under the body limit)": lambda: post(url, big_prompt),
        "100,000-deep nested JSON": lambda: post(url, b'{"model": "faults", "prompt": ' + b"[" * 100_000
                                                 + b"]" * 100_000 + b"}"),
        "cross-origin text/plain post": lambda: post(url, b'{"model": "faults", "prompt": "x"}', "text/plain"),
        "500 half-open connections": lambda: half_open(url),
    }


def measure(url: str, fault) -> dict:
    """Run ``fault`` on a thread while streams run back to back; their largest token wait."""
    result, gaps = [], []
    worker = threading.Thread(target=lambda: result.append(fault()))
    t0 = time.perf_counter()
    worker.start()
    while worker.is_alive() or not gaps:
        gaps += stream_gaps(url)
    return {"answer": result[0], "fault_seconds": round(time.perf_counter() - t0, 2),
            "stream_max_wait_s": round(max(gaps), 3), "stream_tokens": len(gaps)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine_dir")
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args(argv)
    with ServeProcess(args.engine_dir, ["--model-name", MODEL, "--method", "none", "--log-level", "error"]) as srv:
        base = max(max(stream_gaps(srv.url)) for _ in range(5))
        rows = {"no fault": {"answer": "-", "stream_max_wait_s": round(base, 3)}}
        for name, fault in cases(srv.url).items():
            rows[name] = measure(srv.url, fault)
            print(f"{name:40s} {rows[name]}", flush=True)
        alive = httpx.get(srv.url + "/health", timeout=10).status_code
    print("\n| case | answer | concurrent streams: largest wait for a token (s) |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['answer']} | {r['stream_max_wait_s']} |")
    print(f"\n/health after all cases: {alive}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "health_after": alive}, f, indent=1)


if __name__ == "__main__":
    main()
