"""Benchmarks on the demo pair, every ratio measured in ONE run; results written to a JSON file.

    specrt bench plain [--optimum-python PATH]   # plain greedy: specrt vs HF transformers vs optimum ORT
    specrt bench spec                            # plain / draft / ngram vs HF assisted + prompt lookup

`plain` (issue 2): specrt's own plain decode against HF `generate` (torch eager, CPU) and
optimum's `ORTModelForCausalLM.generate`, which needs transformers<4.58 and so runs in a separate
venv given by --optimum-python (tools/bench/optimum.py is run there). `spec` (issue 3): specrt
plain, draft (γ=4 and adaptive), ngram, and HF assisted generation (`assistant_model=`) and prompt
lookup (`prompt_lookup_num_tokens=`) on the same models and prompt sets, greedy and T=0.8.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from ..prompts import CODE, REPETITIVE

DEMO = Path(__file__).resolve().parents[1] / "demo_models"


def run_specrt(rt, prompts, max_new: int, method: str, gamma=None, temperature: float = 0.0) -> dict:
    """Sum over prompts of one method's generation; per-prompt seeds fixed."""
    tokens = seconds = engine = proposed = accepted = rounds = rejections = 0
    predicted = []
    outputs = []
    for i, prompt in enumerate(prompts):
        out = rt.generate(prompt, max_new_tokens=max_new, method=method, gamma=gamma, temperature=temperature,
                          seed=i)
        s = out.stats
        tokens += s["new_tokens"]
        seconds += s["seconds"]
        engine += s["engine_seconds"]
        outputs.append(out.token_ids)
        if method != "none":
            proposed, accepted, rounds = proposed + s["proposed"], accepted + s["accepted"], rounds + s["rounds"]
            rejections += s.get("rejections", 0)
            predicted.append((s["predicted_speedup"], s["seconds"]))
    res = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
           "loop_overhead": 1 - engine / seconds, "outputs": outputs}
    if method != "none":
        res.update(alpha=accepted / max(accepted + rejections, 1), accepted_share=accepted / max(proposed, 1),
                   tokens_per_pass=(accepted + rounds) / max(rounds, 1),
                   predicted_speedup=sum(p * t for p, t in predicted) / sum(t for _, t in predicted))
    return res


def run_hf(model_dir: Path, prompts, max_new: int, temperature: float = 0.0, assistant_dir: Path | None = None,
           prompt_lookup: int | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=max_new, pad_token_id=tok.eos_token_id)
    kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else kw.update(
        do_sample=False)
    if assistant_dir is not None:
        kw["assistant_model"] = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    if prompt_lookup:
        kw["prompt_lookup_num_tokens"] = prompt_lookup
    tokens = seconds = 0
    outputs = []
    for i, prompt in enumerate(prompts):
        ids = tok(prompt, return_tensors="pt").input_ids
        torch.manual_seed(i)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, ids.shape[1]:]
        seconds += time.perf_counter() - t0
        tokens += len(out)
        outputs.append(out.tolist())
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, "outputs": outputs}


def run_optimum(python: str, model_dir: Path, prompts, max_new: int) -> dict:
    script = Path(__file__).parent / "optimum.py"
    proc = subprocess.run([python, str(script), str(model_dir), str(max_new)], input=json.dumps(prompts),
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(title: str, rows: dict, base: str) -> None:
    """One benchmark table, within 80 columns (the JSON has every number)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD)
    for c in ("method", "tok/s", "speedup", "alpha", "tok/pass", "predicted", "overhead"):
        t.add_column(c, no_wrap=True)
    b = rows[base]["tokens_per_second"]
    for name, r in rows.items():
        label = name.removeprefix("specrt ")
        if "error" in r:
            t.add_row(label, "could not run: " + r["error"][:50], "", "", "", "", "")
            continue
        t.add_row(label, f"{r['tokens_per_second']:.1f}", f"{r['tokens_per_second'] / b:.2f}x",
                  f"{r['alpha']:.2f}" if "alpha" in r else "",
                  f"{r['tokens_per_pass']:.2f}" if "tokens_per_pass" in r else "",
                  f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "",
                  f"{r['loop_overhead']:.1%}" if "loop_overhead" in r else "")
    Console().print(t)


def bench_plain(a) -> dict:
    import specrt

    from ..demo_engines import demo_engine_dir

    rt = specrt.load(demo_engine_dir(), **({'threads': a.threads} if a.threads else {}))
    prompts = CODE[: a.prompts]
    rt.generate(prompts[0], max_new_tokens=8, method="none")  # warm-up
    rows = {"specrt": run_specrt(rt, prompts, a.max_new_tokens, "none"),
            "hf-transformers": run_hf(DEMO / "target", prompts, a.max_new_tokens)}
    rows["optimum-ort"] = (run_optimum(a.optimum_python, DEMO / "target", prompts, a.max_new_tokens)
                           if a.optimum_python else {"error": "--optimum-python not given (optimum-onnx needs "
                                                              "transformers<4.58: run it from a separate venv)"})
    same = {k: r.get("outputs") == rows["specrt"]["outputs"] for k, r in rows.items() if "outputs" in r}
    table(f"plain greedy decode, demo target, {len(prompts)} prompts x {a.max_new_tokens} tokens", rows, "specrt")
    print("identical tokens to specrt:", same)
    return {"rows": rows, "identical_tokens": same}


class Progress:
    """One line per finished row on stderr: what it measured, elapsed time and an ETA."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def row(self, name: str, result: dict) -> dict:
        self.done += 1
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {name}: {result['tokens_per_second']:.0f} tok/s "
              f"({elapsed:.0f} s elapsed, ~{eta:.0f} s left)", file=sys.stderr, flush=True)
        return result


def bench_spec(a) -> dict:
    import specrt

    from ..demo_engines import demo_engine_dir

    rt = specrt.load(demo_engine_dir(), **({'threads': a.threads} if a.threads else {}))
    results = {}
    specrt_rows = {"specrt plain": ("none", None), "specrt draft g=4": ("draft", 4), "specrt draft adaptive": ("draft", None),
                   "specrt ngram g=4": ("ngram", 4), "specrt ngram adaptive": ("ngram", None)}
    progress = Progress(4 * (len(specrt_rows) + (0 if a.skip_hf else 3)))
    for set_name, prompts in (("code", CODE[: a.prompts]), ("repetitive", REPETITIVE)):
        for temp in (0.0, 0.8):
            rt.generate(prompts[0], max_new_tokens=8, method="draft")  # warm-up + calibration
            key = f"{set_name} T={temp}"
            rows = {name: progress.row(f"{key} {name}", run_specrt(rt, prompts, a.max_new_tokens, m, g, temp))
                    for name, (m, g) in specrt_rows.items()}
            if not a.skip_hf:
                hf = {"hf plain": {}, "hf assisted": {"assistant_dir": DEMO / "draft"},
                      "hf prompt lookup": {"prompt_lookup": 4}}
                for name, kw in hf.items():
                    rows[name] = progress.row(f"{key} {name}", run_hf(DEMO / "target", prompts, a.max_new_tokens,
                                                                      temp, **kw))
            table(f"{key}: {len(prompts)} prompts x {a.max_new_tokens} tokens", rows, "specrt plain")
            if temp == 0.0:
                base = rows["specrt plain"]["outputs"]
                print("greedy outputs identical to specrt plain:",
                      {k: r["outputs"] == base for k, r in rows.items() if k.startswith("specrt")})
            results[key] = rows
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="specrt bench", description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["plain", "spec"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(CODE), help="code prompts to use")
    ap.add_argument("--optimum-python", help="python of a venv with optimum-onnx (plain bench)")
    ap.add_argument("--skip-hf", action="store_true", help="spec bench: skip the HF transformers rows")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: specrt's)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file (default bench_results/<which>.json)")
    a = ap.parse_args(argv)
    results = bench_plain(a) if a.which == "plain" else bench_spec(a)
    out = a.out or Path("bench_results") / f"{a.which}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "specrt bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": platform.processor() or platform.machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
