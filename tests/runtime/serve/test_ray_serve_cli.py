"""`specrt serve ENGINE --ray`: starts a local Ray cluster, deploys, answers, and stops what it started
on SIGTERM / SIGINT, whether the signal reaches only its process, its whole process group (Ctrl-C,
``kill -TERM -PGID``) or every process of the service (systemd's KillMode=control-group): exit 0
within the drain timeout (not Ray's 60 s wait for a lost GCS), nothing left running."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[test,ray]')")

import psutil  # noqa: E402  (Ray's; importable once ray is)

import specrt  # noqa: E402

DRAIN_TIMEOUT = 10
STOPPED_WITHIN = DRAIN_TIMEOUT + 30  # s: the drain, then Ray's own shutdown (the bug: a 60 s hang, exit 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serving(engine, tmp_path):
    """`specrt serve --ray` in a session of its own, once serving: (process, url, stderr file)."""
    port, err = free_port(), tmp_path / "stderr.txt"
    cmd = [sys.executable, "-c", "from specrt.tools.cli import main; main()", "serve", str(engine), "--ray",
           "--replicas", "1", "--port", str(port), "--model-name", "m", "--method", "none",
           "--drain-timeout", str(DRAIN_TIMEOUT)]
    with open(err, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while "serving 'm'" not in err.read_text() or not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_everything(proc)
            pytest.fail(f"specrt serve --ray did not come up (rc {proc.poll()}):\n{err.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, url, err


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def service_processes(proc) -> list:
    """The live processes of the service: its own session's and the Ray driver's session's (the driver
    is its child, in a session of its own)."""
    sessions = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children()}
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) in sessions and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def stop_everything(proc) -> None:
    """Cleanup after a failed test: SIGKILL the service's sessions (known pids only)."""
    for p in service_processes(proc) if proc.poll() is None else []:
        try:
            p.kill()
        except psutil.Error:
            pass


def assert_stopped_cleanly(proc, err, sessions: set, url: str) -> None:
    try:
        rc = proc.wait(STOPPED_WITHIN)
    except subprocess.TimeoutExpired:
        stop_everything(proc)
        pytest.fail(f"still running {STOPPED_WITHIN} s after the signal:\n{err.read_text()[-3000:]}")
    log = err.read_text()
    assert rc == 0 and "Traceback" not in log and "Failed to connect to GCS" not in log, log[-3000:]
    left = [p for p in psutil.process_iter(["status", "name"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and safe_getsid(p.pid) in sessions]
    assert not left, [f"{p.info['name']}({p.pid})" for p in left]
    with pytest.raises(httpx.HTTPError):  # the proxy is gone with the cluster it started
        httpx.get(url + "/health", timeout=2)


def safe_getsid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_cli_serve_ray_answers_and_stops_on_sigterm_to_its_process(llama_engine, tmp_path):
    proc, url, err = start_serving(llama_engine, tmp_path)
    want = specrt.load(llama_engine).generate("hello", max_new_tokens=8, method="none").text
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 8,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert "replica" in httpx.get(url + "/health").json()
    sessions = {safe_getsid(p.pid) for p in service_processes(proc)}
    assert len(sessions) == 2  # Ray's processes are in the driver's session, not in the caller's
    proc.send_signal(signal.SIGTERM)  # only the parent: it forwards the stop to the driver
    assert_stopped_cleanly(proc, err, sessions, url)


@pytest.mark.parametrize("how", ["SIGTERM to the process group", "SIGINT to the process group",
                                 "SIGTERM to every process"])
def test_cli_serve_ray_stops_cleanly_when_the_signal_reaches_more_than_its_process(llama_engine, tmp_path, how):
    proc, url, err = start_serving(llama_engine, tmp_path)
    processes = service_processes(proc)
    sessions = {safe_getsid(p.pid) for p in processes}
    if how == "SIGTERM to every process":  # systemd's KillMode=control-group: Ray's processes die too
        for p in processes:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    else:  # kill -TERM -PGID, or Ctrl-C in a terminal
        os.killpg(proc.pid, signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT)
    assert_stopped_cleanly(proc, err, sessions, url)


def test_cli_serve_ray_refuses_a_bad_engine_dir_before_deploying(tmp_path):
    cmd = [sys.executable, "-c", "from specrt.tools.cli import main; main()", "serve", str(tmp_path), "--ray"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Error:" in run.stderr and "Traceback" not in run.stderr
