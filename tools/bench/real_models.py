"""Plain decoding on real models: specrt's engines against llama.cpp's llama-bench on the same weights.

    python -m specrt.tools.bench.real_models --llama-bench PATH/llama-bench \\
        --model smollm2 ENGINE_FP32 ENGINE_INT8 ENGINE_INT4 GGUF_F32 GGUF_Q8_0 GGUF_Q4_0 \\
        [--model gemma3 ...] --threads 1 2 --rounds 3 --out docs/bench/real-models.json

The same weights: each specrt engine is exported from the GGUF file a package ships (dequantized, then
quantized again by `specrt export --quantize`), and llama.cpp's files are that GGUF requantized with
`llama-quantize --allow-requantize` to F32 / Q8_0 / Q4_0. llama.cpp: `llama-bench -p 0 -n 128 -t T`
(tg128: 128 tokens generated after an empty prompt). specrt: `Runtime.generate` of 128 tokens, greedy,
method "none", after a short code prompt (one prefill call), tokens/s over the whole call. Every (model, threads) cell runs the six systems in turn, the order reversed every round, one
process at a time; reported: the median tokens/s over the rounds and each specrt/llama.cpp ratio
(fp32/F32, int8/Q8_0, int4/Q4_0).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

PAIRS = (("fp32", "F32"), ("int8", "Q8_0"), ("int4", "Q4_0"))  # specrt precision, llama.cpp type
SPECRT_WORKER = r'''
import json, sys, time
import specrt
rt = specrt.load(sys.argv[1], threads=int(sys.argv[2]))
prompt = "def quicksort(arr):"
rt.generate(prompt, max_new_tokens=8, method="none")  # warm-up
out = rt.generate(prompt, max_new_tokens=128, method="none")
print(json.dumps({"tokens": len(out.token_ids), "seconds": out.stats["seconds"]}))
'''


def llama_bench(binary: str, gguf: str, threads: int) -> float:
    """llama-bench's tg128 tokens/s (its own mean over 3 repetitions)."""
    out = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", "128", "-t", str(threads), "-r", "3", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def specrt_decode(engine: str, threads: int) -> float:
    """tokens/s of 128 greedy plain tokens through ``specrt.load(engine)``, in a process of its own."""
    out = subprocess.run([sys.executable, "-c", SPECRT_WORKER, engine, str(threads)], capture_output=True, text=True,
                         check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["tokens"] / r["seconds"]


def bench(models: dict, binary: str, threads: list[int], rounds: int, log=print) -> dict:
    results = {}
    for name, paths in models.items():
        engines, ggufs = paths[:3], paths[3:]
        for t in threads:
            jobs = [(f"specrt {p}", lambda e=e: specrt_decode(e, t)) for (p, _), e in zip(PAIRS, engines)]
            jobs += [(f"llama.cpp {q}", lambda g=g: llama_bench(binary, g, t)) for (_, q), g in zip(PAIRS, ggufs)]
            samples = {label: [] for label, _ in jobs}
            for r in range(rounds):
                for label, run in (jobs if r % 2 == 0 else jobs[::-1]):
                    samples[label].append(run())
                    log(f"{name} t={t} round {r} {label}: {samples[label][-1]:.1f} tok/s")
            med = {label: float(np.median(v)) for label, v in samples.items()}
            results[f"{name} t={t}"] = {"median_tok_s": med, "samples": samples, "ratio": {
                p: med[f"specrt {p}"] / med[f"llama.cpp {q}"] for p, q in PAIRS}}
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", nargs=7, action="append", required=True,
                    metavar=("NAME", "ENGINE_FP32", "ENGINE_INT8", "ENGINE_INT4", "GGUF_F32", "GGUF_Q8_0", "GGUF_Q4_0"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    res = bench({m[0]: m[1:] for m in a.model}, a.llama_bench, a.threads, a.rounds)
    for cell, r in res.items():
        print(cell, " ".join(f"{k} {v:.1f}" for k, v in r["median_tok_s"].items()),
              "| specrt/llama.cpp", " ".join(f"{k} {v:.2f}x" for k, v in r["ratio"].items()))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
