"""GPU device check (issue 8): `python tools/gpu_check.py` on one CUDA GPU, under 8 minutes.

Measures and checks, then prints a short table last and writes everything as JSON
(``--json PATH``; default ``$OUT/gpu_check.json`` when $OUT is set, else ./gpu_check.json):

1. T(Q): one target pass of a random-weight ~1.1B Llama (TinyLlama geometry: 22 layers, hidden
   2048, 32 heads, 4 KV heads, vocab 32000) in bf16, for Q = 1, 2, 4, 8, 16, 64, 256 new tokens
   at batch 1, 8, 64 over a past of 256 tokens, each shape a replayed CUDA graph; and T(Q)/T(1).
2. Decode step latency (B=1, Q=1): eager vs CUDA-graph replay, device only and with the logits
   copied to the host (what the runtime's acceptance reads).
3. The demo pair (tools/demo_models/{target,draft}, exported fp32 with torch weights): greedy
   output on the GPU (device-resident runtime with CUDA graphs; the torch backend eager) equals
   ONNX Runtime on the CPU, token for token, and the device runtime's greedy speculative output
   (fixed gamma) equals its plain greedy output.
4. Tokens/s on the demo pair with graphs on, through the device runtime's decode core
   (``rt.generate``, one sync per model call): plain vs speculative (fixed and adaptive gamma); and the tree methods
   (the demo target with the demo Medusa heads and the demo EAGLE head, trees every round) through
   the decode core on the device runtime: greedy output equal to the CPU, tokens/s against plain.
5. The exactness test of the core issue (tests/runtime/test_exactness.py) with every engine dir loaded
   as a device-resident runtime on the GPU (CUDA graphs on).

Needs torch with CUDA, transformers, tokenizers, onnx, onnxruntime (CPU is enough), pytest and
scipy; specrt need not be installed (the repo root is the package). ``--smoke`` runs the same
code with tiny sizes on the CPU to check the script itself: its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repo root is the `specrt` package
if __name__ == "__main__":  # `python tools/gpu_check.py` puts tools/ first on sys.path, where a module
    # named like a standard-library one (profile, imported by cProfile, which torch imports) would shadow it
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "tools"]
BUDGET_S = 450  # whole run; the exactness test gets what is left (the issue allows 8 minutes)


def ensure_importable() -> str | None:
    """Make `import specrt` work without an install (a temp dir with a `specrt` link to the repo root)."""
    try:
        import specrt  # noqa: F401

        return None
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="specrt_shim_"))
        (shim / "specrt").symlink_to(ROOT, target_is_directory=True)
        sys.path.insert(0, str(shim))
        return str(shim)


# ---- pytest plugin: `pytest -p specrt.tools.gpu_check` with SPECRT_GPU_CHECK_DEVICE set -------------


def pytest_configure(config):
    device = os.environ.get("SPECRT_GPU_CHECK_DEVICE")
    if device:
        install_device_runtime(device)


def install_device_runtime(device: str) -> None:
    """Route every `specrt.load` to the device-resident runtime, and export torch weights everywhere."""
    import specrt
    from specrt.runtime.device import load_device_runtime
    from specrt.export import onnx_export

    original = onnx_export.export_engine

    def export_with_torch_weights(*args, cfg=None, **kwargs):
        cfg = dataclasses.replace(cfg or onnx_export.ExportConfig(), torch_weights=True)
        return original(*args, cfg=cfg, **kwargs)

    def load(engine_dir, backend="ort", **_):
        return load_device_runtime(engine_dir, device=device, cuda_graphs=device.startswith("cuda"))

    onnx_export.export_engine = export_with_torch_weights
    specrt.load = load


# ---- timing -------------------------------------------------------------------------------------


class Timer:
    """Seconds per call of fn: CUDA events on a GPU (device time of the enqueued work), else wall time."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps


def wall(torch, device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# ---- 1 + 2: T(Q) of a ~1B Llama, decode latency eager vs graph ---------------------------------------


def llama_1b(torch, device, dtype, smoke: bool):
    import transformers as tf

    if smoke:
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    else:  # TinyLlama-1.1B geometry
        cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
                             tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg)
    model = model.to(dtype).eval()
    return model, cfg


def bench_tq(torch, device, smoke: bool, log) -> dict:
    from specrt.engines.cuda_graphs import DeviceModel
    from specrt.engines.manifest import ModelGeometry
    from specrt.engines.torch_backend import TorchCore

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    qs = (1, 2, 4) if smoke else (1, 2, 4, 8, 16, 64, 256)
    batches = (1, 2) if smoke else (1, 8, 64)
    past = 16 if smoke else 256
    t0 = time.time()
    model, cfg = llama_1b(torch, device, dtype, smoke)
    params = sum(p.numel() for p in model.parameters())
    log(f"[tq] model: {params / 1e6:.1f}M params, built in {time.time() - t0:.1f} s")
    core = TorchCore.from_model(model)
    geo = ModelGeometry("LlamaForCausalLM", cfg.num_hidden_layers, cfg.num_key_value_heads,
                        cfg.hidden_size // cfg.num_attention_heads, cfg.hidden_size, cfg.vocab_size)
    graphs = device.type == "cuda"
    timer = Timer(torch, device)
    table: dict = {}
    for b in batches:
        dm = DeviceModel(core, geo, past + max(qs), device=device, dtype=dtype, batch=b, q_shapes=qs,
                         buckets=[past], cuda_graphs=graphs, pad=False)
        for q in qs:
            dm.length = past
            ids = torch.randint(0, cfg.vocab_size, (b, q), device=device)
            dm.forward(ids, advance=False)  # captures the graph
            reps = 20 if b * q <= 512 else 8
            t = timer(lambda: dm.forward(ids, advance=False), reps)
            table[(b, q)] = t
            log(f"[tq] B={b} Q={q}: {t * 1e3:.3f} ms")
            dm.drop_shapes()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dm = None  # free the cache before the next batch size
    result = {"model": {"params": params, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                        "vocab": cfg.vocab_size, "dtype": str(dtype).replace("torch.", ""), "past": past,
                        "cuda_graphs": graphs},
              "t_ms": {f"B{b}_Q{q}": table[(b, q)] * 1e3 for b in batches for q in qs},
              "ratio": {f"B{b}_Q{q}": table[(b, q)] / table[(b, 1)] for b in batches for q in qs},
              "qs": list(qs), "batches": list(batches)}
    # decode step: eager vs graph replay, device only and with logits to the host
    decode = {}
    for name, use_graphs in (("eager", False), ("graph", True)):
        if use_graphs and not graphs:
            continue
        dm = DeviceModel(core, geo, past + 1, device=device, dtype=dtype, batch=1, q_shapes=(1,),
                         buckets=[past], cuda_graphs=use_graphs, pad=False)
        dm.length = past
        ids = torch.randint(0, cfg.vocab_size, (1, 1), device=device)
        dm.forward(ids, advance=False)
        decode[f"{name}_device_ms"] = timer(lambda: dm.forward(ids, advance=False), 30) * 1e3
        decode[f"{name}_to_host_ms"] = timer(lambda: dm.forward(ids, advance=False).cpu(), 30) * 1e3
        log(f"[decode] {name}: {decode[f'{name}_device_ms']:.3f} ms device, "
            f"{decode[f'{name}_to_host_ms']:.3f} ms with logits to host")
        dm = None
    result["decode"] = decode
    del model, core
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---- 3 + 4: the demo pair ---------------------------------------------------------------------------


def first_diff(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def demo_pair(torch, device, smoke: bool, workdir: Path, log) -> dict:
    import specrt
    from specrt.runtime.device import load_device_runtime
    from specrt.export.onnx_export import ExportConfig, export_engine
    from specrt.tools.prompts import CODE

    models = ROOT / "tools" / "demo_models"
    target, draft = models / "target", models / "draft"
    note = None
    if not (target / "config.json").is_file():
        if not smoke:
            return {"skipped": f"no demo target checkpoint at {target} (still training?)"}
        target, note = draft, "smoke: the draft stands in for the missing target"
    if not (target / "tokenizer.json").is_file():
        return {"skipped": f"{target} has no tokenizer.json"}
    gamma, max_len, new = 4, 512, (24 if smoke else 128)
    t0 = time.time()
    engine = export_engine(target, workdir / "demo_engine", draft_dir=draft, log=log,
                           cfg=ExportConfig(gamma=gamma, max_len=max_len, prefill_chunk=64, torch_weights=True))
    log(f"[demo] exported in {time.time() - t0:.0f} s")
    prompts = CODE[:2] if smoke else CODE[:4]
    cpu = specrt.load(engine)
    graphs = device.type == "cuda"
    gpu = load_device_runtime(engine, device=str(device), cuda_graphs=graphs)
    eager = specrt.load(engine, backend="torch", device=str(device))
    eq: dict = {"runtime_graphs_draft": [], "runtime_graphs_plain": [], "torch_eager_draft": [],
                "runtime_graphs_draft_vs_plain": []}
    for p in prompts:
        want_d = cpu.generate(p, max_new_tokens=new, method="draft", gamma=gamma).token_ids
        want_p = cpu.generate(p, max_new_tokens=new, method="none").token_ids
        gpu_d = gpu.generate(p, max_new_tokens=new, method="draft", gamma=gamma).token_ids
        gpu_p = gpu.generate(p, max_new_tokens=new, method="none").token_ids
        eager_d = eager.generate(p, max_new_tokens=new, method="draft", gamma=gamma).token_ids
        got = {"runtime_graphs_draft": (gpu_d, want_d), "runtime_graphs_plain": (gpu_p, want_p),
               "torch_eager_draft": (eager_d, want_d),
               "runtime_graphs_draft_vs_plain": (gpu_d, gpu_p)}  # speculative decoding = plain greedy of the target
        for k, (a, b) in got.items():
            eq[k].append({"equal": a == b, "first_diff": first_diff(a, b), "tokens": len(b)})
    equality = {k: {"equal": sum(r["equal"] for r in v), "of": len(v), "cases": v} for k, v in eq.items()}
    log("[demo] equal, token for token: " + ", ".join(f"{k} {v['equal']}/{v['of']}" for k, v in equality.items()))
    # tokens/s with graphs on, through the device runtime: warm-up (captures every shape), then timed runs
    rates: dict = {}
    runs = {
        "plain": lambda p: len(gpu.generate(p, max_new_tokens=new, method="none").token_ids),
        "spec_gamma4": lambda p: len(gpu.generate(p, max_new_tokens=new, method="draft", gamma=gamma).token_ids),
        "spec_adaptive": lambda p: len(gpu.generate(p, max_new_tokens=new, method="draft").token_ids),
    }
    for name, fn in runs.items():
        fn(prompts[0])  # warm-up
        n, secs = 0, 0.0
        for p in prompts:
            box = {}
            secs += wall(torch, device, lambda: box.setdefault("n", fn(p)))
            n += box["n"]
        rates[name] = n / secs
        log(f"[tok/s] {name}: {rates[name]:.0f} tokens/s ({n} tokens)")
    stats = gpu.generate(prompts[0], max_new_tokens=new, method="draft", gamma=gamma).stats
    return {"engine": str(engine), "note": note, "new_tokens": new, "gamma": gamma, "prompts": len(prompts),
            "equality": equality, "tokens_per_s": rates, "acceptance_rate_gamma4": stats.get("acceptance_rate"),
            "graph_replays_target": gpu.target.engine.replays}


def tree_methods(torch, device, smoke: bool, workdir: Path, log) -> dict:
    """Medusa and EAGLE through the decode core on the device runtime (trees every round: gamma=1):
    greedy output equal to ONNX Runtime on the CPU, and tokens/s against plain decoding on the device."""
    import specrt
    from specrt.export.onnx_export import ExportConfig, export_engine
    from specrt.runtime.device import load_device_runtime
    from specrt.tools.prompts import CODE
    from specrt.trees import load_tree

    models = ROOT / "tools" / "demo_models"
    new, prompts = (16 if smoke else 128), (CODE[:1] if smoke else CODE[:4])
    cfg = ExportConfig(gamma=4, max_len=512, prefill_chunk=64, torch_weights=True)
    heads = {"medusa": dict(medusa_dir=models / "medusa", tree=load_tree("medusa-8")),
             "eagle": dict(eagle_dir=models / "eagle", eagle_tree={"nodes": 32, "depth": 5, "topk": 8})}
    out: dict = {}
    for method, extra in heads.items():
        engine = export_engine(models / "target", workdir / f"{method}_engine", cfg=cfg, log=log, **extra)
        cpu = specrt.load(engine)
        gpu = load_device_runtime(engine, device=str(device), cuda_graphs=device.type == "cuda")
        equal = [gpu.generate(p, max_new_tokens=new, method=method, gamma=1).token_ids ==
                 cpu.generate(p, max_new_tokens=new, method=method, gamma=1).token_ids for p in prompts]
        rates = {}
        for name, m in (("plain", "none"), (method, method)):
            gpu.generate(prompts[0], max_new_tokens=8, method=m, gamma=1)  # warm-up (captures the shapes)
            n, secs = 0, 0.0
            for p in prompts:
                box = {}
                secs += wall(torch, device, lambda: box.setdefault("n", len(
                    gpu.generate(p, max_new_tokens=new, method=m, gamma=1).token_ids)))
                n += box["n"]
            rates[name] = n / secs
        stats = gpu.generate(prompts[0], max_new_tokens=new, method=method, gamma=1).stats
        out[method] = {"equal": sum(equal), "of": len(equal), "tokens_per_s": rates,
                       "tokens_per_pass": stats.get("tokens_per_pass"), "verify_ratio": stats.get("verify_ratio")}
        log(f"[{method}] device == CPU {sum(equal)}/{len(equal)}; tok/s plain {rates['plain']:.0f}, "
            f"{method} {rates[method]:.0f}; tokens/pass {stats.get('tokens_per_pass', 0):.2f}")
    return out


# ---- 5: the GPU-marked tests, and the exactness test on the device runtime ------------------------------


def run_pytest(args: list, timeout: float, shim: str | None, log, device: str | None = None) -> dict:
    """Run pytest in a subprocess; ``device`` routes specrt.load to the device runtime (the plugin above)."""
    if timeout < 30:
        return {"skipped": f"only {timeout:.0f} s of the budget left"}
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
    if device:
        env["SPECRT_GPU_CHECK_DEVICE"] = device
    if shim:
        env["PYTHONPATH"] = shim + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", *args, "-rs", "-p", "no:cacheprovider"]  # -q comes from pyproject
    if device:
        cmd += ["-p", "specrt.tools.gpu_check"]
    t0 = time.time()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"passed": False, "timed_out": True, "seconds": round(time.time() - t0),
                "output_tail": out[-1500:]}
    summary = next((line for line in reversed(res.stdout.strip().splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|error|deselected)", line)), out[-200:])
    log(f"[pytest {' '.join(args)}] rc={rc}: {summary}")
    return {"passed": rc == 0, "returncode": rc, "summary": summary.strip("= "), "seconds": round(time.time() - t0),
            "output_tail": out[-1500:] if rc else ""}


# ---- report -----------------------------------------------------------------------------------------


def table(r: dict) -> str:
    lines = [f"== specrt gpu_check: {r['env'].get('gpu') or r['env']['device']}, torch {r['env']['torch']}, "
             f"total {r['seconds']:.0f} s =="]
    tq = r.get("tq") or {}
    if "t_ms" in tq:
        m = tq["model"]
        lines.append(f"T(Q) ms [T(Q)/T(1)]: random Llama {m['params'] / 1e9:.2f}B {m['dtype']}, past {m['past']}, "
                     f"CUDA graphs {'on' if m['cuda_graphs'] else 'off'}")
        lines.append("  Q    " + "".join(f"{'B=' + str(b):>18}" for b in tq["batches"]))
        for q in tq["qs"]:
            cells = "".join(f"{tq['t_ms'][f'B{b}_Q{q}']:>10.3f} [{tq['ratio'][f'B{b}_Q{q}']:>5.2f}]"
                            for b in tq["batches"])
            lines.append(f"  {q:<5}{cells}")
        d = tq.get("decode", {})
        if d:
            lines.append("decode step B=1 Q=1: " + " | ".join(
                f"{k.replace('_ms', '')} {v:.3f} ms" for k, v in d.items()))
    elif tq:
        lines.append(f"T(Q): {tq.get('error') or tq.get('skipped')}")
    demo = r.get("demo") or {}
    if "equality" in demo:
        lines.append(f"demo pair greedy, equal ({r['env']['device']} vs CPU ORT; draft vs plain): " + ", ".join(
            f"{k} {v['equal']}/{v['of']}" for k, v in demo["equality"].items()))
        lines.append(f"tokens/s demo pair ({r['env']['device']}, graphs {'on' if r['env']['device'] != 'cpu' else 'off'}): " + " | ".join(
            f"{k} {v:.0f}" for k, v in demo["tokens_per_s"].items()) +
            f" | acceptance (γ=4) {demo['acceptance_rate_gamma4'] or 0:.2f}")
    else:
        lines.append(f"demo pair: {demo.get('error') or demo.get('skipped')}")
    for method, t in (r.get("trees") or {}).items():
        if isinstance(t, dict) and "equal" in t:
            lines.append(f"{method} (trees every round): device == CPU {t['equal']}/{t['of']}; tok/s plain "
                         f"{t['tokens_per_s']['plain']:.0f} vs {method} {t['tokens_per_s'][method]:.0f}; "
                         f"tokens/pass {t['tokens_per_pass'] or 0:.2f}, T(N)/T(1) {t['verify_ratio'] or 0:.2f}")
    if (r.get("trees") or {}).get("error"):
        lines.append(f"trees: {r['trees']['error']}")
    for key, label in (("gpu_tests", "GPU tests (tests/engines/test_torch_backend.py)"),
                       ("exactness", "exactness (tests/runtime/test_exactness.py, device runtime)")):
        ex = r.get(key) or {}
        if "passed" in ex:
            state = "PASSED" if ex["passed"] else ("TIMED OUT" if ex.get("timed_out") else "FAILED")
            lines.append(f"{label}: {state} {ex.get('summary', '')} [{ex['seconds']} s]")
        else:
            lines.append(f"{label}: {ex.get('error') or ex.get('skipped')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="where to write the JSON results (default: $OUT/gpu_check.json or ./gpu_check.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script, measures nothing")
    ap.add_argument("--skip", action="append", default=[], choices=["tq", "demo", "trees", "gpu_tests", "exactness"])
    args = ap.parse_args(argv)
    t_start = time.time()
    shim = ensure_importable()
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False); use --smoke to check the script on CPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons against the CPU: no TF32
    torch.backends.cudnn.allow_tf32 = False
    import onnxruntime as ort

    env = {"device": str(device), "torch": torch.__version__, "onnxruntime": ort.__version__,
           "ort_providers": ort.get_available_providers(), "python": sys.version.split()[0]}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import tensorrt

        env["tensorrt"] = tensorrt.__version__
    except ImportError:
        env["tensorrt"] = None
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"[env] {env}")
    results: dict = {"env": env, "smoke": args.smoke}
    work = Path(tempfile.mkdtemp(prefix="specrt_gpu_check_"))
    sections = [("tq", lambda: bench_tq(torch, device, args.smoke, log)),
                ("demo", lambda: demo_pair(torch, device, args.smoke, work, log)),
                ("trees", lambda: tree_methods(torch, device, args.smoke, work, log))]
    for name, fn in sections:
        if name in args.skip:
            results[name] = {"skipped": "--skip"}
            continue
        try:
            results[name] = fn()
        except Exception as e:  # one failing section must not hide the others' numbers
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    left = lambda cap: min(cap, BUDGET_S - (time.time() - t_start))  # noqa: E731
    for name, args_, dev, cap in (("gpu_tests", ["tests/engines/test_torch_backend.py", "-k", "cuda or trt"], None, 150),
                                  ("exactness", ["tests/runtime/test_exactness.py"], str(device), 300)):
        if name in args.skip or args.smoke:
            results[name] = {"skipped": "--skip" if name in args.skip else "--smoke (the CPU tests are CI's)"}
        else:
            results[name] = run_pytest(args_, left(cap), shim, log, dev)
    results["seconds"] = time.time() - t_start
    out = Path(args.json) if args.json else Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\n(JSON: {out})")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
