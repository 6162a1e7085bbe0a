"""A/B benchmark of two specrt checkouts at batch 1: every method, interleaved, ratios new/old.

    python -m specrt.tools.bench.ab --old /path/to/old/checkout [--new .] [--reps 3] --out docs/bench/ab.json

Each checkout runs in its own worker process (``import specrt`` resolves to that checkout), over
the same engine dirs (the demo pair; the demo target with the demo Medusa heads and with the demo
EAGLE head), loaded once and warmed up. The driver then alternates: for every repetition, method
and temperature it asks the old worker, then the new one (the order flips every repetition), to
generate the same 8 code prompts x ``--max-new-tokens`` tokens (tree methods with ``gamma=1``:
a tree every round, as older checkouts always did), and records tokens/s. Only one
worker runs at a time. Reported per method and temperature: the median tokens/s of each side and
the median of the per-repetition ratios new/old.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import checkout_env

METHODS = {"none": "draft", "draft": "draft", "ngram": "draft", "suffix": "draft", "medusa": "medusa", "eagle": "eagle"}  # -> engine

WORKER = r'''
import json, sys, time
import specrt
engines = json.loads(sys.argv[1])
prompts = json.loads(sys.argv[2])
runtimes = {name: specrt.load(path) for name, path in engines.items()}
for method, engine in METHODS.items():
    runtimes[engine].generate(prompts[0], max_new_tokens=16, method=method)  # warm-up and calibration
print(json.dumps({"ready": specrt.__file__}), flush=True)
for line in sys.stdin:
    method, temperature, max_new = json.loads(line)
    rt, tokens, seconds = runtimes[METHODS[method]], 0, 0.0
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        gamma = 1 if method in ("medusa", "eagle") else None  # a tree every round (older checkouts ignore it)
        out = rt.generate(prompt, max_new_tokens=max_new, method=method, temperature=temperature, seed=i, gamma=gamma)
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
    print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
'''


class Worker:
    """One checkout's worker process: ``run(method, temperature, max_new)`` -> tokens/s."""

    def __init__(self, checkout: Path, engines: dict, prompts: list):
        self.links, env = checkout_env(checkout)
        code = f"METHODS = {METHODS!r}\n" + WORKER
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(engines), json.dumps(prompts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.loaded_from = json.loads(self.proc.stdout.readline())["ready"]

    def run(self, method: str, temperature: float, max_new: int) -> float:
        self.proc.stdin.write(json.dumps([method, temperature, max_new]) + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return r["tokens"] / r["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self.links.cleanup()


def main(argv=None) -> None:
    from ..demo_engines import tree_engine
    from ..demo_engines import demo_engine_dir
    from ..prompts import CODE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the baseline checkout (a git worktree of the old commit)")
    ap.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[2], help="default: this checkout")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", type=Path, default=Path("bench_results/ab.json"))
    a = ap.parse_args(argv)
    engines = {"draft": str(demo_engine_dir()), "medusa": str(tree_engine("medusa")), "eagle": str(tree_engine("eagle"))}
    prompts = CODE[:8]
    workers = {"old": Worker(a.old, engines, prompts), "new": Worker(a.new, engines, prompts)}
    print({k: w.loaded_from for k, w in workers.items()}, flush=True)
    methods = a.methods.split(",")
    samples: dict = {}
    try:
        for rep in range(a.reps):
            for temperature in (0.0, 0.8):
                for method in methods:
                    order = ("old", "new") if rep % 2 == 0 else ("new", "old")
                    got = {side: workers[side].run(method, temperature, a.max_new_tokens) for side in order}
                    samples.setdefault(f"{method}@T={temperature}", []).append(got)
                    print(rep, method, temperature, {k: round(v, 1) for k, v in got.items()}, flush=True)
    finally:
        for w in workers.values():
            w.close()
    rows = {}
    for key, runs in samples.items():
        old, new = np.array([r["old"] for r in runs]), np.array([r["new"] for r in runs])
        rows[key] = {"old_tok_s": float(np.median(old)), "new_tok_s": float(np.median(new)),
                     "ratio_new_old": float(np.median(new / old)), "ratios": (new / old).round(3).tolist()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": "python -m specrt.tools.bench.ab " + " ".join(argv or sys.argv[1:]),
                                 "time": time.strftime("%F %T"), "prompts": len(prompts),
                                 "max_new_tokens": a.max_new_tokens, "reps": a.reps, "results": rows}, indent=1))
    print(f"{'method':<18}{'old tok/s':>11}{'new tok/s':>11}{'new/old':>9}")
    for key, r in rows.items():
        print(f"{key:<18}{r['old_tok_s']:>11.1f}{r['new_tok_s']:>11.1f}{r['ratio_new_old']:>9.2f}")


if __name__ == "__main__":
    main()
