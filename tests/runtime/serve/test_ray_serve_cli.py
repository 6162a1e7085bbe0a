"""`specrt serve ENGINE --ray`: starts a local Ray cluster, deploys, answers, and stops what it started on SIGTERM."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[test,ray]')")

import specrt  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_ray_answers_and_stops_on_sigterm(llama_engine):
    port = free_port()
    cmd = [sys.executable, "-c", "from specrt.tools.cli import main; main()", "serve", str(llama_engine), "--ray",
           "--replicas", "1", "--port", str(port), "--model-name", "m", "--method", "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "specrt serve --ray did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        want = specrt.load(llama_engine).generate("hello", max_new_tokens=8, method="none").text
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hello",
                                                                        "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert "replica" in httpx.get(f"http://127.0.0.1:{port}/health").json()
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
    assert rc == 0, proc.stderr.read()[-3000:]
    with pytest.raises(httpx.HTTPError):  # the proxy is gone with the cluster it started
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_cli_serve_ray_refuses_a_bad_engine_dir_before_deploying(tmp_path):
    cmd = [sys.executable, "-c", "from specrt.tools.cli import main; main()", "serve", str(tmp_path), "--ray"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Error:" in run.stderr and "Traceback" not in run.stderr
