"""EAGLE-1 against EAGLE-3 on the demo target: held-out accuracy of the heads, tokens per pass on the code prompts.

    python -m specrt.tools.bench.eagle3 --eagle3 HEAD_DIR [--eagle3 ...] [--eagle1 tools/demo_models/eagle ...] \
        --out docs/bench/eagle3.json

Exports one engine per head (the same target, the same dynamic tree: --nodes/--depth/--topk), then on
the 8 code prompts of tools/prompts.py and the openings of 8 held-out corpus files runs plain decoding and each head's `--method eagle` with a
tree every round (gamma 1: this CPU's adaptive policy would mostly decode plainly), greedy and at
T = 0.8 (seeded), the methods in turn per prompt so the ratios to plain come from the same run.
Reports tokens/s, tokens per target pass, the accepted-length histogram and the speedup over plain,
plus each head's held-out accuracy and training time from its config.json and its top-1 agreement
with the target's greedy token at draft depths 1..5 (``depth_accuracy``: the head unrolled on its
own features, as it drafts, on held-out windows of the demo corpus).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .suffix import print_table

SAMPLING = {"greedy": {}, "T=0.8": {"temperature": 0.8, "seed": 0}}


def export_engines(heads: dict, work: Path, tree: dict, log) -> dict:
    """name -> engine dir of the demo target with that head."""
    from ...export.onnx_export import ExportConfig, export_engine

    target = Path(__file__).resolve().parents[1] / "demo_models" / "target"
    return {name: export_engine(target, work / name, eagle_dir=head, eagle_tree=tree, log=log, force=True,
                                cfg=ExportConfig(gamma=4, max_len=1024)) for name, head in heads.items()}


def head_card(head_dir: Path) -> dict:
    raw = json.loads((Path(head_dir) / "config.json").read_text())
    training = raw.get("training", {})
    return {"dir": str(head_dir), "version": raw.get("version", 1), "accuracy": raw.get("accuracy"),
            "training_seconds": training.get("seconds"), "steps": training.get("steps_done"),
            "config": training.get("config")}


def depth_accuracy(heads: dict, k: int = 5, windows: int = 32, seq: int = 256) -> dict:
    """name -> top-1 agreement with the target's greedy token at draft depths 1..k on the demo target's held-out
    files: each head unrolled as it drafts (deeper steps read its own predicted features; TTT's masks)."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from ...export.eagle3_head import is_eagle3, load_head3
    from ...export.eagle_head import load_head
    from ...export.hf_checkpoint import load_hf
    from ..train.demo import split_corpus
    from ..train.eagle3 import unroll

    target_dir = Path(__file__).resolve().parents[1] / "demo_models" / "target"
    model = load_hf(target_dir).float().eval()
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    stream = np.concatenate([tok.encode(f.read_text()).ids + [0] for f in split_corpus()[1]]).astype(np.int64)
    starts = np.random.default_rng(12345).integers(0, len(stream) - seq, windows)
    out = {}
    for name, head_dir in heads.items():
        v3 = is_eagle3(head_dir)
        head = (load_head3 if v3 else load_head)(head_dir, model)[0]
        hits, counts = np.zeros(k), np.zeros(k)
        with torch.no_grad():
            for s in starts:
                ids = torch.from_numpy(stream[s : s + seq])[None]  # [1, T]
                o = model(input_ids=ids, output_hidden_states=True)
                greedy = o.logits[0, 1:].argmax(-1)  # [T-1]
                if v3:
                    aux = torch.cat([o.hidden_states[i] for i in head.cfg.aux_layers], -1)
                    steps = [head.draft_ids()[x.argmax(-1)] for _, x in
                             unroll(head.step, head.fuse(aux[:, :-1]), ids, k, head.empty_past())]
                else:
                    steps = [x.argmax(-1) for _, x in
                             unroll(head, o.hidden_states[-1][:, :-1], ids, k, head.empty_past())]
                for j, top in enumerate(steps):
                    hits[j] += int((top[0] == greedy[j : j + top.shape[1]]).sum())
                    counts[j] += top.shape[1]
        out[name] = (hits / counts).round(4).tolist()
    return out


def add_histograms(a: list, b: list) -> list:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def workloads() -> dict:
    """The code prompts of tools/prompts.py, and the openings (600 characters) of 8 held-out demo-corpus files
    (the text the heads' held-out accuracy is measured on)."""
    from ..prompts import CODE
    from ..train.demo import split_corpus

    return {"code prompts": list(CODE), "held-out files": [f.read_text()[:600] for f in split_corpus()[1][:8]]}


def measure(engines: dict, max_new_tokens: int, log) -> dict:
    """(workload, sampling) -> head | "plain" -> tokens/s, tokens per pass, accepted-length histogram, speedup."""
    import specrt

    rts = {name: specrt.load(d) for name, d in engines.items()}
    runs = [("plain", rts[next(iter(rts))], "none")] + [(name, rt, "eagle") for name, rt in rts.items()]
    for _, rt, m in runs:
        rt.generate("x = 1\n", max_new_tokens=4, method=m)  # calibration, warm-up
    totals = {}  # (workload/sampling, name) -> [tokens, seconds, passes, histogram]
    prompts = [(w, p) for w, ps in workloads().items() for p in ps]
    for i, (w, prompt) in enumerate(prompts):
        for sampling, params in SAMPLING.items():
            s = f"{w}, {sampling}"
            for name, rt, m in runs[i % len(runs):] + runs[: i % len(runs)]:
                t0 = time.perf_counter()
                out = rt.generate(prompt, max_new_tokens=max_new_tokens, method=m, gamma=1 if m == "eagle" else None,
                                  **params)  # gamma 1: a tree every round (the adaptive policy turns trees off here)
                t = totals.setdefault((name, s), [0, 0.0, 0, []])
                t[0] += len(out.token_ids)
                t[1] += time.perf_counter() - t0
                t[2] += out.stats["target_passes"]
                t[3] = add_histograms(t[3], out.stats.get("accept_length_histogram") or [])
        log(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    rows = {}
    for (name, s), (tokens, seconds, passes, hist) in totals.items():
        rows.setdefault(s, {})[name] = {"tokens_per_s": tokens / seconds, "tokens_per_pass": tokens / passes,
                                        "accept_length_histogram": hist}
    for s in rows:
        for r in rows[s].values():
            r["speedup"] = r["tokens_per_s"] / rows[s]["plain"]["tokens_per_s"]
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = Path(__file__).resolve().parents[1] / "demo_models"
    ap.add_argument("--eagle1", type=Path, action="append", help="repeatable; default: the committed demo head")
    ap.add_argument("--eagle3", type=Path, required=True, action="append", help="repeatable: several EAGLE-3 heads")
    ap.add_argument("--work", type=Path, default=Path("/tmp/specrt_bench_eagle3"), help="where the engines go")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.eagle1 = a.eagle1 or [here / "eagle"]
    heads = {f"eagle{v}" + ("" if len(dirs) == 1 else f":{d.name}"): d for v, dirs in ((1, a.eagle1), (3, a.eagle3))
             for d in dirs}
    engines = export_engines(heads, a.work, {"nodes": a.nodes, "depth": a.depth, "topk": a.topk}, lambda *_: None)
    rows = measure(engines, a.max_new_tokens, print)
    cards = {name: head_card(d) for name, d in heads.items()}
    for name, by_depth in depth_accuracy(heads).items():
        cards[name]["top1_by_depth"] = by_depth
    for name, c in cards.items():
        print(f"{name}: held-out {c['accuracy']}, trained {c['steps']} steps in {c['training_seconds']} s; top-1 by "
              f"draft depth 1..5 {c['top1_by_depth']}")
    print_table(rows, "workload, sampling")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": {k: str(v) for k, v in vars(a).items()}, "heads": cards, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
