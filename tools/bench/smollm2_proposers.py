"""Acceptance of the proposers trained for SmolLM2-135M-Instruct (tools/train/smollm2.py), on the runtime.

    python -m specrt.tools.bench.smollm2_proposers --target HF_DIR --run RUN_DIR --humaneval HumanEval.jsonl.gz \
        --out docs/bench/smollm2-proposers.json

Exports RUN_DIR/eagle and RUN_DIR/draft with the target at int4 (``specrt export``, into RUN_DIR/engine-*),
then decodes 8 held-out prompts (4 stdlib-function and 4 chat prompts of RUN_DIR/data/heldout.jsonl,
never trained on) and 8 HumanEval prompts, greedy, 128 tokens, with plain decoding (per engine) and each
proposer, speculation always on (draft at a fixed γ; EAGLE: γ = 1, its dynamic tree every round), checks every speculative output equals the
plain one token for token, and records tokens per target pass, accepted/proposed and tokens/s (one process,
interleaved; tokens/s on a shared machine: compare ratios).
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

HUMAN_EVAL = [f"HumanEval/{i}" for i in range(8)]


def export(target: Path, flag: str, proposer: Path, out: Path, extra=()) -> Path:
    if not (out / "manifest.json").is_file():
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "from specrt.tools.cli import main; main()", "export", "--target",
                        str(target), flag, str(proposer), "--quantize", "int4", "--out", str(out), "--force", *extra],
                       check=True)
        print(f"exported {out} in {time.time() - t0:.0f} s", flush=True)
    return out


def heldout_prompts(run: Path) -> dict:
    rows = [json.loads(l) for l in (run / "data" / "heldout.jsonl").read_text().splitlines()]
    greedy = [r for r in rows if r["temperature"] == 0.0]
    pick = [r for r in greedy if r["kind"] == "code"][:4] + [r for r in greedy if r["kind"] == "chat"][:4]
    return {r["source"]: r["prompt"] for r in pick}


def humaneval_prompts(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        tasks = {t["task_id"]: t["prompt"] for t in map(json.loads, f)}
    return {k: tasks[k] for k in HUMAN_EVAL}


def measure(engine: Path, method: str, prompts: dict, tokens: int, gamma, plain: dict) -> dict:
    """Decode ``prompts`` with ``method``; ``plain``: name -> plain greedy output, filled in on first use."""
    import specrt

    rt = specrt.load(engine)
    rt.generate("def f(x):", max_new_tokens=8, method="none")  # warm-up
    rows, plain_ok = {}, True
    for name, prompt in prompts.items():
        if name not in plain:
            plain[name] = rt.generate(prompt, max_new_tokens=tokens, method="none")
        spec = rt.generate(prompt, max_new_tokens=tokens, method=method, gamma=gamma)
        plain_ok &= spec.token_ids == plain[name].token_ids
        s = spec.stats
        rows[name] = {"tokens": len(spec.token_ids), "target_passes": s["target_passes"], "proposed": s["proposed"],
                      "accepted": s["accepted"], "plain_tok_s": round(plain[name].stats["tokens_per_second"], 1),
                      "spec_tok_s": round(s["tokens_per_second"], 1)}
    tot = {k: sum(r[k] for r in rows.values()) for k in ("tokens", "target_passes", "proposed", "accepted")}
    plain_s = sum(r["tokens"] / r["plain_tok_s"] for r in rows.values())
    spec_s = sum(r["tokens"] / r["spec_tok_s"] for r in rows.values())
    return {"method": method, "gamma": gamma, "greedy_equals_plain": plain_ok,
            "tokens_per_pass": round(tot["tokens"] / tot["target_passes"], 3),
            "acceptance": round(tot["accepted"] / max(1, tot["proposed"]), 3),
            "plain_tok_s": round(tot["tokens"] / plain_s, 1), "spec_tok_s": round(tot["tokens"] / spec_s, 1),
            "speedup": round(plain_s / spec_s, 3), "prompts": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--humaneval", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4, help="the draft's fixed γ (EAGLE: 1 = verify its tree every round)")
    a = ap.parse_args()
    engines = {"eagle": export(a.target, "--eagle", a.run / "eagle", a.run / "engine-eagle-int4"),
               "draft": export(a.target, "--draft", a.run / "draft", a.run / "engine-draft-int4")}
    sets = {"heldout": heldout_prompts(a.run), "humaneval": humaneval_prompts(a.humaneval)}
    result = {"tokens": a.tokens, "note": "shared 2-core VM under other load: tok/s are noisy",
              "results": {}}
    for method, engine in engines.items():
        plain: dict = {}  # this engine's plain runs (each engine's target graph is its own: ties may differ)
        for name, prompts in sets.items():
            r = measure(engine, method, prompts, a.tokens, a.gamma if method == "draft" else 1, plain)
            result["results"][f"{method}/{name}"] = r
            print(f"{method:6s} {name:10s} tokens/pass {r['tokens_per_pass']}, accepted/proposed {r['acceptance']}, "
                  f"{r['spec_tok_s']} vs plain {r['plain_tok_s']} tok/s ({r['speedup']}x), greedy == plain: "
                  f"{r['greedy_equals_plain']}", flush=True)
            a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
