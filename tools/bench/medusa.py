"""Medusa benchmark on the demo target: medusa (each default tree) vs plain vs draft; fused vs separate heads.

    python -m specrt.tools.bench.medusa [--max-new 96] [--prompts 4] [--out bench_results/medusa.json]

Each default tree gets its own engine dir (target, draft, heads graph with heads 1..depth, the
tree-verify shape N); plain and draft run on the first. Per method and temperature (greedy, T=0.8):
tokens/s, ratio to plain in the same run, mean acceptance length (tokens per target pass),
per-depth acceptance and T(tree pass)/T(decode pass) as measured by the runtime.

The fusion measurement times, on the same cache length, ONE tree pass plus the heads graph on
the accepted position (what the runtime does) against a single graph that computes the heads
on every tree node inside the target graph (the "fused" alternative), per tree.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from ..prompts import CODE

DEMO = Path(__file__).resolve().parents[1] / "demo_models"
TREES = ("medusa-8", "medusa-16", "medusa-32", "medusa-64")


def engine_dir(cache: Path, tree: str) -> Path:
    """Export target + draft + demo heads with ``tree`` once into ``cache`` (the heads graph holds
    heads 1..depth only, so each tree size gets its own engine dir)."""
    from ...export.onnx_export import ExportConfig, export_engine
    from ...trees import load_tree

    out = cache / f"demo-{tree}"
    if not (out / "manifest.json").is_file():
        export_engine(DEMO / "target", out, draft_dir=DEMO / "draft", cfg=ExportConfig(gamma=4, max_len=1024),
                      medusa_dir=DEMO / "medusa", tree=load_tree(tree))
    return out


def run(rt, prompts, max_new: int, method: str, temperature: float) -> dict:
    tokens = seconds = passes = rounds = accepted = 0
    depth, verify, outputs = [], [], []
    for i, prompt in enumerate(prompts):
        out = rt.generate(prompt, max_new_tokens=max_new, method=method, temperature=temperature, seed=i)
        s = out.stats
        tokens, seconds, passes = tokens + s["new_tokens"], seconds + s["seconds"], passes + s["target_passes"]
        outputs.append(out.token_ids)
        if method != "none":
            rounds, accepted = rounds + s["rounds"], accepted + s["accepted"]
            verify.append(s["verify_ratio"])
        if method == "medusa":
            depth.append(np.array(s["per_depth_acceptance"]) * s["rounds"])
    res = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 1),
           "target_passes": passes, "outputs": outputs}
    if method != "none":
        res.update(tokens_per_pass=round((accepted + rounds) / max(rounds, 1), 3),
                   verify_ratio=round(float(np.median(verify)), 2))
    if method == "medusa":
        res["per_depth_acceptance"] = (np.sum(depth, 0) / max(rounds, 1)).round(3).tolist()
    return res


def bench_methods(runtimes: dict, prompts, max_new: int) -> dict:
    """runtimes: tree name -> Runtime of that tree's engine dir (plain and draft run on the first)."""
    results = {}
    base_rt = next(iter(runtimes.values()))
    for temperature in (0.0, 0.8):
        rows = {}
        base_rt.generate(prompts[0], max_new_tokens=16, method="draft")  # warm-up + chain calibration
        rows["plain"] = run(base_rt, prompts, max_new, "none", temperature)
        rows["draft"] = run(base_rt, prompts, max_new, "draft", temperature)
        for tree, rt in runtimes.items():
            rt.generate(prompts[0], max_new_tokens=16, method="medusa")  # warm-up + tree calibration
            rows[tree] = run(rt, prompts, max_new, "medusa", temperature)
            rows[tree].update(tree_nodes=rt.tree.size, heads=rt.manifest.medusa.num_heads)
        base = rows["plain"]["tokens_per_second"]
        for name, row in rows.items():
            row["ratio_to_plain"] = round(row["tokens_per_second"] / base, 3)
            if temperature == 0 and name != "plain":
                row["same_tokens_as_plain"] = row["outputs"] == rows["plain"]["outputs"]
        for row in rows.values():
            del row["outputs"]
        results[f"T={temperature}"] = rows
    return results


def measure_fusion(engines: dict, target_dir: Path = DEMO / "target", heads_dir: Path = DEMO / "medusa",
                   threads: int = 1, past: int = 256, reps: int = 20) -> dict:
    """Per tree (name -> engine dir): median seconds of one tree pass done separately (target graph, then
    the heads graph on the accepted position) vs fused (the heads inside the target graph, on every node)."""
    import torch

    from ...contract import io_names
    from ...engines.manifest import load_manifest
    from ...engines.ort import OrtEngine
    from ...export.hf_checkpoint import load_hf
    from ...export.medusa_heads import load_heads
    from ...export.onnx_export import random_feeds
    from ...engines.wrapper import DecoderWrapper, geometry

    class Fused(torch.nn.Module):
        def __init__(self, wrapper, heads):
            super().__init__()
            self.wrapper, self.heads = wrapper, heads

        def forward(self, *inputs):
            out = self.wrapper(*inputs)
            return (*out, self.heads(out[-1]).float())  # ..., hidden, medusa_logits [B, Q, K, V]

    model = load_hf(target_dir)
    geo = geometry(model)
    heads, _ = load_heads(heads_dir)
    wrapper = DecoderWrapper(model, with_hidden=True)
    inputs, outputs = io_names(geo.num_layers, True)
    axes = {n: {0: "batch", 1: "query"} for n in ("input_ids", "position_ids", "logits", "hidden", "medusa_logits")}
    axes["attention_mask"] = {0: "batch", 2: "query", 3: "total"}
    axes.update({n: {0: "past", 1: "batch"} for n in inputs[3:]})
    axes.update({n: {0: "query", 1: "batch"} for n in outputs[1:-1]})
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        fused_graphs = {}
        for name, engine in engines.items():
            m = load_manifest(engine)
            depth = m.medusa.num_heads
            if depth not in fused_graphs:
                path = Path(tmp) / f"fused{depth}.onnx"
                with torch.no_grad():
                    torch.onnx.export(Fused(wrapper, heads.first(depth)), tuple(random_feeds(geo, torch.float32, 3, 2)),
                                      str(path), input_names=inputs, output_names=[*outputs, "medusa_logits"],
                                      dynamic_axes=axes, opset_version=17, dynamo=False)
                fused_graphs[depth] = OrtEngine(path, threads=threads)
            fused = fused_graphs[depth]
            target = OrtEngine(engine / m.target.file, threads=threads)
            heads_graph = OrtEngine(engine / m.medusa.file, threads=threads)
            mask = torch.from_numpy(np.array(compile_mask(m.medusa.tree["choices"])))
            q = len(mask)
            feeds = {n: t.numpy() for n, t in zip(inputs, random_feeds(geo, torch.float32, past, q, mask))}

            def separate():
                out = target.run(feeds)
                heads_graph.run({"hidden": out["hidden"][:, -1]})

            def together():
                fused.run(feeds)

            times = {}
            for label, fn in (("separate", separate), ("fused", together)):
                fn()
                samples = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                times[label] = float(np.median(samples))
            result[name] = {"q": q, "heads": depth, "separate_ms": round(1e3 * times["separate"], 3),
                            "fused_ms": round(1e3 * times["fused"], 3), "faster": min(times, key=times.get)}
    return result


def compile_mask(choices):
    from ...trees import compile_tree

    return compile_tree(choices).mask


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "specrt-bench-medusa")
    ap.add_argument("--out", type=Path, default=Path("bench_results") / "medusa.json")
    ap.add_argument("--skip-fusion", action="store_true")
    a = ap.parse_args(argv)
    import specrt

    engines = {tree: engine_dir(a.cache, tree) for tree in TREES}
    runtimes = {tree: specrt.load(e, threads=a.threads) for tree, e in engines.items()}
    t0 = time.time()
    results = {"methods": bench_methods(runtimes, CODE[: a.prompts], a.max_new)}
    if not a.skip_fusion:
        results["fusion"] = measure_fusion(engines, threads=a.threads)
    meta = {"machine": platform.platform(), "processor": platform.processor(), "threads": a.threads,
            "max_new_tokens": a.max_new, "prompts": a.prompts, "seconds": round(time.time() - t0, 1),
            "heads": json.loads((DEMO / "medusa" / "config.json").read_text()).get("accuracy")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    for temp, rows in results["methods"].items():
        print(f"\n{temp}")
        for name, r in rows.items():
            print(f"  {name:10s} {r['tokens_per_second']:7.1f} tok/s  x{r['ratio_to_plain']:.2f}  "
                  f"tokens/pass {r.get('tokens_per_pass', 1):.2f}  T(verify)/T(1) {r.get('verify_ratio', 1):.2f}")
    for name, r in results.get("fusion", {}).items():
        print(f"  fusion {name:10s} Q={r['q']:3d} separate {r['separate_ms']:.2f} ms, fused {r['fused_ms']:.2f} ms")
    print(f"results written to {a.out}")


if __name__ == "__main__":
    main()
