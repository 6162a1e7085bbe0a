"""`specrt serve` under hostile input: a huge request costs its own latency only, and schemathesis
(generated requests from the server's own OpenAPI document) finds no 5xx."""
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serving import AUTH, KEY, MODEL, slow_runtime
from specrt.runtime.core import CoreConfig


def stream_gaps(url: str, body: dict, started: threading.Event | None = None) -> list[float]:
    """Seconds from the request to its first data event and between its data events (one streamed completion)."""
    times = [time.perf_counter()]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    if started is not None and len(times) == 3:
                        started.set()
    return list(map(float.__sub__, times[1:], times[:-1]))


def test_a_10mb_prompt_does_not_stall_concurrent_streams(start_server, llama_engine):
    """Streams run back to back while one 10 MB prompt is read, parsed and tokenized (12 s of work here):
    no stream's first token or next token waits 0.5 s longer than without it."""
    srv = start_server(runtime=slow_runtime(llama_engine), batch=CoreConfig(max_batch=2, method="none"),
                       max_body_bytes=16 << 20)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "temperature": 0, "stream": True}
    alone = max(max(stream_gaps(srv.url, body)) for _ in range(3))
    huge = {"model": MODEL, "prompt": "abc " * (10 << 18), "max_tokens": 4}  # 10 MB of text
    started, answer = threading.Event(), []

    def post_huge():
        started.wait(30)
        answer.append(httpx.post(srv.url + "/v1/completions", json=huge, headers=AUTH, timeout=120))

    poster = threading.Thread(target=post_huge)
    poster.start()
    together = stream_gaps(srv.url, body, started)
    while poster.is_alive():
        together += stream_gaps(srv.url, body)
    assert answer[0].status_code == 400  # the prompt is longer than the context
    assert answer[0].json()["error"]["code"] == "context_length_exceeded"
    assert max(together) < alone + 0.5, (max(together), alone)


def test_slow_clients_are_closed_and_a_slow_body_gets_408(start_server):
    srv = start_server(batch=CoreConfig(max_batch=1, method="none"), header_timeout=1.0, body_timeout=1.0)
    addr = (srv.host, srv.port)
    idle, half, slow_body, kept = (socket.create_connection(addr) for _ in range(4))
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"mo")
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    kept.settimeout(5)
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /hea")  # a kept-alive connection that stalls in its next request's headers
    t0 = time.monotonic()
    for s in (idle, half, kept):
        s.settimeout(5)
        assert s.recv(100) == b""  # closed by the server
    assert time.monotonic() - t0 < 4
    slow_body.settimeout(5)
    assert slow_body.recv(100).startswith(b"HTTP/1.1 408")
    assert httpx.get(srv.url + "/health").status_code == 200
    for s in (idle, half, slow_body, kept):
        s.close()


def test_schemathesis_finds_no_server_error(start_server):
    pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")
    srv = start_server(batch=CoreConfig(max_batch=4, method="draft"))
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", srv.url + "/openapi.json", "--checks",
           "not_a_server_error", "--max-examples", "12", "--seed", "1", "--header", f"Authorization: Bearer {KEY}",
           "--request-timeout", "30", "--generation-database", "none", "--phases", "coverage,fuzzing", "--no-color"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout.split("SUMMARY")[-1], run.stdout[-3000:]
