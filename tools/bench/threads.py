"""ONNX Runtime thread settings on an idle and on a busy machine: which defaults hold up.

    python -m specrt.tools.bench.threads [--reps 3] [--max-new-tokens 96] --out docs/bench/threads.json

For each setting of the ONNX Runtime sessions (intra-op threads 1 / all cores, spinning on / off /
bounded to N microseconds (``session.intra_op.spin_duration_us``);
0 = ORT's own default for every graph; specrt's default gives the draft one thread) it measures plain and draft-model
greedy decoding of the demo pair (8 code prompts) on an idle machine and on a busy one (a CPU
hog per core but one, started and stopped by this script), every setting in its own worker
process, interleaved: for each repetition and load, every setting in turn (the order rotating).
Reports median tokens/s per (setting, load, method) and each setting's ratio to the best.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORKER = r'''
import json, sys, time
import specrt
engine, prompts, threads, spinning = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
opts = {k: v for k, v in (("threads", threads), ("spinning", spinning)) if v is not None}
rt = specrt.load(engine, **opts)
for m in ("none", "draft"):
    rt.generate(prompts[0], max_new_tokens=16, method=m)
print("ready", flush=True)
for line in sys.stdin:
    method, max_new = json.loads(line)
    tokens, seconds = 0, 0.0
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        tokens += len(rt.generate(p, max_new_tokens=max_new, method=method, gamma=4 if method == "draft" else None).token_ids)
        seconds += time.perf_counter() - t0
    print(json.dumps(tokens / seconds), flush=True)
'''


def settings() -> dict:
    cores = os.cpu_count() or 1
    return {"ORT default (all cores, spinning)": (0, True), f"{cores} threads, no spinning": (cores, False),
            "all cores, spin <= 20 us (specrt's default)": (0, None), "1 thread": (1, None)}


def main(argv=None) -> None:
    from ..demo_engines import demo_engine_dir
    from ..prompts import CODE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("bench_results/threads.json"))
    a = ap.parse_args(argv)
    engine, prompts = str(demo_engine_dir()), CODE[:8]
    workers = {}
    for name, (threads, spinning) in settings().items():
        proc = subprocess.Popen([sys.executable, "-c", WORKER, engine, json.dumps(prompts), json.dumps(threads),
                                 json.dumps(spinning)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        workers[name] = proc
    samples: dict = {}
    try:
        for rep in range(a.reps):
            for load in ("idle", "busy"):
                hogs = [] if load == "idle" else [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                                                  for _ in range(max(1, (os.cpu_count() or 1) - 1))]
                try:
                    names = list(workers)[rep % len(workers):] + list(workers)[: rep % len(workers)]
                    for name in names:
                        for method in ("none", "draft"):
                            w = workers[name]
                            w.stdin.write(json.dumps([method, a.max_new_tokens]) + "\n")
                            w.stdin.flush()
                            tps = json.loads(w.stdout.readline())
                            samples.setdefault((name, load, method), []).append(tps)
                            print(f"rep {rep} {load:>4} {method:>5} {name:<34} {tps:7.1f} tok/s", flush=True)
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait(30)
    rows = {}
    for (name, load, method), v in samples.items():
        rows.setdefault(name, {})[f"{load} {method}"] = float(np.median(v))
    best = {k: max(r[k] for r in rows.values()) for k in next(iter(rows.values()))}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": "python -m specrt.tools.bench.threads " + " ".join(argv or sys.argv[1:]),
                                 "time": time.strftime("%F %T"), "cpu_count": os.cpu_count(), "reps": a.reps,
                                 "tokens_per_second": rows, "best": best}, indent=1))
    cols = list(best)
    print(f"{'setting':<36}" + "".join(f"{c:>18}" for c in cols))
    for name, r in rows.items():
        print(f"{name:<36}" + "".join(f"{r[c]:>9.0f} ({r[c] / best[c]:.2f})" for c in cols))


if __name__ == "__main__":
    main()
