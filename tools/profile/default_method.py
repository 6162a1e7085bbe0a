"""The default method of an exported engine dir, chosen by measurement (`specrt export` runs it last).

Every method the engine dir can run (plain decoding ``none``, ``ngram``, ``suffix``, and its ``draft`` /
``medusa`` / ``eagle`` where it has one) generates the same short prompts greedily, one request at a time,
the methods interleaved prompt by prompt, after one warm-up each. The fastest in tokens per second becomes
the manifest's ``defaults.method``; plain decoding is one of the contestants, so the default is never a
method this machine measured slower than plain. ``defaults.measured`` keeps the figures:

    {"method": "ngram", "gamma": null,
     "measured": {"tokens": 48, "prompts": 3, "speedup": {"none": 1.0, "ngram": 1.31, "eagle": 0.78}}}

A measurement of a few seconds on three prompts is a first guess for this machine, not a benchmark:
`specrt profile --write-defaults` measures more (docs/profiling.md), `--method` overrides either.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..prompts import CODE

PROSE = ("The river was high that spring, and the old bridge at the edge of town had been closed for a week. "
         "Most people took the long road through the hills;")
PROMPTS = (CODE[0], CODE[1], PROSE)  # code (where lookup methods shine) and prose (where they do not)
TOKENS = 48  # generated per prompt and method


def candidate_methods(manifest) -> list[str]:
    """The methods the engine dir can run, plain decoding first."""
    heads = [m for m in ("draft", "medusa", "eagle") if getattr(manifest, m) is not None]
    return ["none", "ngram", "suffix", *heads]


def measure(rt, methods: list[str], prompts=PROMPTS, tokens: int = TOKENS) -> dict:
    """{method: tokens per second} over ``prompts``, greedy, the methods interleaved prompt by prompt (a prompt
    cut to its first tokens where the engine's cache is short)."""
    max_len = rt.manifest.max_len
    tokens = min(tokens, max_len // 4)
    room = max(1, max_len - tokens - rt.gamma_max - 2)  # the verify pass's room past the last token
    prompts = [ids[:room] for ids in rt.encode_texts(list(prompts))]
    for m in methods:  # warm-up: sessions, proposers' first calls
        rt.generate(prompts[0], max_new_tokens=4, method=m)
    done = {m: [0, 0.0] for m in methods}
    for prompt in prompts:
        for m in methods:
            t0 = time.perf_counter()
            out = rt.generate(prompt, max_new_tokens=tokens, method=m)
            done[m][0] += len(out.token_ids)
            done[m][1] += time.perf_counter() - t0
    return {m: n / s for m, (n, s) in done.items()}


def choose_default(engine_dir: str | Path, log=print) -> dict:
    """Measure, then write ``defaults.method`` (and ``defaults.measured``) into the engine dir's manifest
    (atomically); returns the new defaults."""
    import specrt

    rt = specrt.load(engine_dir)
    methods = candidate_methods(rt.manifest)
    rate = measure(rt, methods)
    del rt
    best = max(methods, key=lambda m: rate[m])
    speedup = {m: round(rate[m] / rate["none"], 2) for m in methods}
    log("default method, measured here (greedy, tokens/s vs plain): "
        + ", ".join(f"{m} {s:.2f}x" for m, s in speedup.items()) + f" -> {best}")
    path = Path(engine_dir) / "manifest.json"
    raw = json.loads(path.read_text())
    raw["defaults"] = {**raw.get("defaults", {}), "method": best,
                       "measured": {"tokens": TOKENS, "prompts": len(PROMPTS), "speedup": speedup}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)
    return raw["defaults"]
