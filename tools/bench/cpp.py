"""The C++ runtime (libspecrt) vs the Python runtime on the same engine dir, interleaved in one run.

Per method (none, draft, ngram, suffix) and temperature (greedy, 0.8): tokens/s over the prompts, and the
time outside ONNX Runtime's Run calls as a share of wall time (the loop's overhead: sampling,
verification, proposers, cache bookkeeping, and for Python the interpreter). Both runtimes open
the same graphs with the same session options (target: ORT's default threads, 20 µs spin; draft:
1 thread) and the same fixed γ (--gamma: the loops compared, not the γ policies). Rounds alternate C++ / Python per cell so load drift hits both alike.

    python -m specrt.tools.bench.cpp [ENGINE_DIR] [--rounds 3] [--max-new 128] [--out docs/bench/cpp.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def run(runtime, prompts, method, temperature, max_new, gamma) -> tuple[int, float, float]:
    """(tokens, wall seconds, seconds inside ONNX Runtime) over the prompts; ``runtime``: a ``Runtime`` or a
    ``CppEngine`` (the same ``generate`` and the same ``engine_seconds`` stat)."""
    tokens, wall, engine = 0, 0.0, 0.0
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        out = runtime.generate(ids, max_new_tokens=max_new, method=method, temperature=temperature, seed=i, gamma=gamma)
        wall += time.perf_counter() - t0  # for the C++ runtime the ctypes call included
        engine += out.stats["engine_seconds"]
        tokens += len(out.token_ids)
    return tokens, wall, engine


def main(argv=None) -> None:
    import specrt
    from ..demo_engines import demo_engine_dir
    from ..libspecrt import CppEngine, build, library_path, load_library
    from ..prompts import CODE

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", nargs="?", help="engine dir (default: the demo pair)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--methods", default="none,draft,ngram,suffix")
    ap.add_argument("--gamma", type=int, default=4, help="fixed γ for both (the loops compared, not the γ policies)")
    ap.add_argument("--out", default="docs/bench/cpp.json")
    args = ap.parse_args(argv)
    engine = Path(args.engine) if args.engine else demo_engine_dir()
    lib = load_library(library_path(build(log=lambda *_: None)))
    rt, cpp = specrt.load(engine), CppEngine(lib, engine)
    prompts = [rt.tokenizer.encode(p).ids for p in CODE]
    methods = [m for m in args.methods.split(",") if m != "draft" or rt.draft is not None]
    rt.generate(prompts[0], max_new_tokens=16)  # warm-up both
    cpp.generate(prompts[0], max_new_tokens=16)
    rows = []
    for temperature in (0.0, 0.8):
        for method in methods:
            cells = {"cpp": [], "python": []}
            for _ in range(args.rounds):
                for name, runtime in (("cpp", cpp), ("python", rt)):
                    cells[name].append(run(runtime, prompts, method, temperature, args.max_new, args.gamma))
            row = {"method": method, "temperature": temperature}
            for name, runs in cells.items():
                tps = [t / w for t, w, _ in runs]
                outside = [(w - e) / w for _, w, e in runs]
                row[name] = {"tok_s": float(np.median(tps)), "tok_s_runs": [round(x, 1) for x in tps],
                             "outside_ort_share": float(np.median(outside))}
            row["ratio_cpp_over_python"] = row["cpp"]["tok_s"] / row["python"]["tok_s"]
            rows.append(row)
            print(f"{method:6s} T={temperature}: C++ {row['cpp']['tok_s']:7.1f} tok/s ({row['cpp']['outside_ort_share']:.1%} "
                  f"outside ORT)  Python {row['python']['tok_s']:7.1f} ({row['python']['outside_ort_share']:.1%})  "
                  f"ratio {row['ratio_cpp_over_python']:.2f}", flush=True)
    result = {"engine": str(engine), "gamma": args.gamma, "prompts": len(prompts), "max_new_tokens": args.max_new, "rounds": args.rounds,
              "ort_version": lib.specrt_engine_ort_version(cpp.handle).decode(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
