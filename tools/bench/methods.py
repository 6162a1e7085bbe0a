"""Every proposer side by side on the demo target, in ONE run: plain, draft, medusa, eagle.

    python -m specrt.tools.bench.methods [--max-new-tokens 96] [--out docs/bench/methods.json]

Three engine dirs (a tree-verify shape holds one tree, so Medusa and EAGLE export separately):
target+draft (the `specrt demo` engine), target+medusa (medusa-8), target+eagle (32 nodes).
Prints tokens/s, ratio to plain, tokens per target pass and c, greedy and T=0.8.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..demo_engines import demo_engine_dir, tree_engine
from ..prompts import CODE


def run(rt, method: str, temperature: float, max_new: int) -> dict:
    tokens = seconds = accepted = rounds = 0
    c = []
    for i, prompt in enumerate(CODE):
        s = rt.generate(prompt, max_new_tokens=max_new, method=method, temperature=temperature, seed=i).stats
        tokens, seconds = tokens + s["new_tokens"], seconds + s["seconds"]
        if method != "none":
            accepted, rounds = accepted + s["accepted"], rounds + s["rounds"]
            c.append(s["c"])
    return {"tokens_per_second": tokens / seconds, "tokens_per_pass": (accepted + rounds) / rounds if rounds else 1.0,
            "c": sum(c) / len(c) if c else 0.0}


def main(argv=None) -> None:
    import specrt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("bench_results/methods.json"))
    a = ap.parse_args(argv)
    runtimes = {"draft": specrt.load(demo_engine_dir()), "medusa": specrt.load(tree_engine("medusa")),
                "eagle": specrt.load(tree_engine("eagle"))}
    results = {}
    for temp in (0.0, 0.8):
        rows = {}
        for method, rt in [("none", runtimes["draft"])] + list(runtimes.items()):
            rt.generate(CODE[0], max_new_tokens=8, method=method)  # warm-up and calibration
            rows[method] = run(rt, method, temp, a.max_new_tokens)
        base = rows["none"]["tokens_per_second"]
        print(f"T={temp}: " + "; ".join(f"{m} {r['tokens_per_second']:.0f} tok/s ({r['tokens_per_second'] / base:.2f}x, "
                                        f"{r['tokens_per_pass']:.2f} tok/pass, c {r['c']:.3f})" for m, r in rows.items()))
        results[f"T={temp}"] = rows
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": "python -m specrt.tools.bench.methods", "time": time.strftime("%F %T"),
                                 "prompts": len(CODE), "max_new_tokens": a.max_new_tokens, "results": results}, indent=1))
    print(f"results written to {a.out}")


if __name__ == "__main__":
    main()
