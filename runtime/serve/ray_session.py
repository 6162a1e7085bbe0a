"""`specrt serve --ray`'s processes: the Ray driver runs in a child process in a session of its own.

    specrt serve ENGINE --ray          this process, in the operator's process group: supervise()
      └─ python -m specrt.runtime.serve.ray_session   a new session: ray_serve.run, the driver
           ├─ gcs_server, raylet, log monitor, agents ...   the local cluster ray.init starts
           └─ ServeController, ProxyActor, replicas          (children of the raylet)

Ctrl-C in a terminal or ``kill -TERM -PGID`` signals a whole process group. Ray's processes used to
share the driver's group, so they died with it and the driver's teardown then blocked 60 s on the lost
GCS and exited 1. Now a signal to the group reaches only this process, which forwards SIGTERM to the
driver: it drains the replicas (``--drain-timeout``), stops Serve, then the cluster, in order. A second
signal is forwarded too (the driver stops without waiting for the drain). Whatever still runs in the
driver's session once it exited (or once it overran the drain timeout by ``STOP_GRACE_S`` and was
killed) is killed. Where the signal reaches every process anyway (systemd's control-group stop), the
driver notices its GCS is gone and stops without waiting (``ray_serve.watch_stop``). If this process
dies, the driver sees its stdin close and stops too.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback

STOP_GRACE_S = 30.0  # after the drain timeout: Serve's and the cluster's own shutdown, then SIGKILL


def supervise(run_args: dict, drain_timeout: float, log=print) -> int:
    """Run ``ray_serve.run(**run_args)`` in a child process in a new session and wait for it, forwarding
    SIGINT/SIGTERM as SIGTERM; returns its exit code (0: stopped on a signal).

        rc = supervise(dict(spec=spec, replicas=2, address=None, host="127.0.0.1", port=8000, cpus=1.0,
                            drain_timeout=30), drain_timeout=30)
    """
    driver = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, start_new_session=True)
    signalled: list[float] = []  # monotonic times of the signals forwarded
    killed = False

    def forward(*_) -> None:
        signalled.append(time.monotonic())
        if driver.poll() is None:
            driver.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        send(driver, run_args)
        while (rc := wait_briefly(driver)) is None:
            if not killed and signalled and time.monotonic() - signalled[0] > drain_timeout + STOP_GRACE_S:
                log(f"the Ray driver did not stop within {drain_timeout:g} + {STOP_GRACE_S:g} s: killing it")
                driver.kill()
                killed = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        left = end_session(driver.pid)
        if left:
            log(f"stopped {len(left)} process(es) left in the Ray driver's session: {', '.join(left)}")
        driver.stdin.close()
    if signalled and not killed and rc == -signal.SIGTERM:  # stopped before it set its handlers: nothing ran
        return 0
    return 128 - rc if rc < 0 else rc  # (killed by a signal: 128 + its number, as a shell reports it)


def send(driver: subprocess.Popen, run_args: dict) -> None:
    """Pickles ``run_args`` to the driver's stdin, which stays open: its end tells the driver that this
    process is gone."""
    try:
        driver.stdin.write(pickle.dumps(run_args))
        driver.stdin.flush()
    except BrokenPipeError:  # it ended at once (a signal before it read them): its exit code tells
        pass


def wait_briefly(process: subprocess.Popen, seconds: float = 0.2) -> int | None:
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def end_session(sid: int, grace: float = 3.0) -> list[str]:
    """Ends what is left in session ``sid``: SIGTERM, then SIGKILL after ``grace`` s. Returns
    ``name(pid)`` of each process signalled."""
    left = session_processes(sid)
    for pid in left:
        signal_quietly(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and session_processes(sid).keys() & left.keys():
        time.sleep(0.1)
    for pid in session_processes(sid).keys() & left.keys():
        signal_quietly(pid, signal.SIGKILL)
    return [f"{name}({pid})" for pid, name in sorted(left.items())]


def session_processes(sid: int) -> dict[int, str]:
    """pid -> name of the live processes in session ``sid`` (zombies, which only their parent can reap,
    left out). Reads /proc: empty where there is none (Ray's own fate-sharing then has to do)."""
    out = {}
    for pid in [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        name, fields = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # (fields: state ppid pgrp session ...)
            out[pid] = name
    return out


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # gone meanwhile
        pass


def main() -> None:
    """The driver process: reads ``run``'s arguments (pickled) from stdin, serves until SIGTERM / SIGINT
    or until stdin closes (the supervising process is gone), exits 0 once stopped."""
    from ...engines import EngineError
    from . import ray_serve

    stop = ray_serve.StopRequests()
    stop.install()
    try:
        run_args = pickle.load(sys.stdin.buffer)
    except EOFError:  # the supervising process ended before it sent them
        os._exit(0)
    threading.Thread(target=watch_parent, args=(stop,), name="specrt-parent-watch", daemon=True).start()
    rc = 0
    try:
        ray_serve.run(**run_args, log=lambda m: print(m, file=sys.stderr, flush=True), stop=stop)
    except (EngineError, ValueError) as e:
        print(f"Error: {e}", file=sys.stderr)
        rc = 1
    except SystemExit as e:  # Ray's SIGTERM handler during ray.init, or a Ray call cut short
        rc = 0 if stop.drain.is_set() or not e.code else e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # (not waiting for threads a stop given up on left blocked in Ray calls)


def watch_parent(stop) -> None:
    """A thread: ``stop()`` once stdin closes, i.e. the supervising process is gone. (os.read: a thread
    blocked in sys.stdin's own read would hold its lock, which interpreter shutdown wants.)"""
    while os.read(sys.stdin.fileno(), 1 << 12):
        pass
    stop()


if __name__ == "__main__":
    main()
