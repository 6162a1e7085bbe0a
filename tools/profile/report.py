"""`specrt profile` output: rich tables, matplotlib PNGs, and ONNX Runtime's per-operator profile."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from .measure import ProfileConfig, role_models, time_forward, timing_past_len

TOP_OPS = 8  # operators listed per graph in the ONNX Runtime profile summary


def ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def print_report(report: dict, console) -> None:
    """Every section of the report as rich tables, in the order of the issue's items."""
    from rich.table import Table

    s = report["settings"]
    t = Table(title=f"1. Latency of one call (batch 1, median and p90 of {s['repeats']} calls after {s['warmup']} "
                    "warm-up)")
    for col in ("graph", "shape", "Q", "past P", "median ms", "p90 ms"):
        t.add_column(col, justify="left" if col in ("graph", "shape") else "right")
    for role, shapes in report["graphs"].items():
        for shape, r in shapes.items():
            t.add_row(role, shape, str(r["q"]), str(r["past_len"]), ms(r["median_s"]), ms(r["p90_s"]))
    console.print(t)

    curves, exported = report["verify_cost"], report.get("export_curve")
    t = Table(title=f"2. Verification cost T(Q)/T(1) (target, past P={curves[0]['past_len']})")
    t.add_column("Q", justify="right")
    for c in curves:
        t.add_column(f"batch {c['batch']}", justify="right")
    at_export = dict(zip(exported["q"], exported["ratio"])) if exported else {}
    if exported:
        t.add_column(f"at export (P={exported['past']})", justify="right")
    for i, q in enumerate(curves[0]["q"]):
        t.add_row(str(q), *(f"{c['ratio'][i]:.2f}" for c in curves),
                  *([f"{at_export[q]:.2f}" if q in at_export else "-"] if exported else []))
    t.add_row("ridge Q", *("> " + str(c["q"][-1]) if c["ridge_q"] is None else str(c["ridge_q"]) for c in curves),
              *([""] if exported else []))
    console.print(t)
    if exported:
        kernels = ", ".join(f"{g} {k}" for g, k in (exported.get("kernels") or {}).items())
        console.print(f"   at export: {exported.get('quantize') or 'unquantized'}" + (f" ({kernels})" if kernels else "")
                      + f", T(1) {exported['seconds'][0] * 1e3:.3f} ms on {exported.get('cpu', '?')}"
                      + "".join(f", {op} {who}'s" for op, who in (exported.get("ran_on") or {}).items()) + ", ONNX Runtime "
                      f"{exported.get('onnxruntime', '?')} (manifest models.target.latency)", highlight=False)

    methods = report["methods"]
    t = Table(title=f"3-4. Methods on {s['prompts']} prompts, γ={s['gamma_run']}, temperature {s['temperature']}")
    for col in ("method", "α", "accepted share", "tokens/pass", "c", "tok/s", "measured speedup"):
        t.add_column(col, justify="left" if col == "method" else "right")
    t.add_row("none", "-", "-", "1.00", "-", f"{report['plain']['tokens_per_second']:.1f}", "1.00x")
    for name, m in methods.items():
        if m["available"]:
            alpha = "-" if m["alpha"] is None else f"{m['alpha']:.2f}"
            t.add_row(name, alpha, f"{m['acceptance_rate']:.2f}", f"{m['tokens_per_pass']:.2f}", f"{m['c']:.3f}",
                      f"{m['tokens_per_second']:.1f}", x(m["measured_speedup"]))
    console.print(t)
    for name, m in methods.items():
        if not m["available"]:
            console.print(f"{name}: {m['reason']}", highlight=False)

    ran = {n: m for n, m in methods.items() if m["available"] and m["prediction"]["gammas"]}
    for name, m in methods.items():
        if m["available"] and not m["prediction"]["gammas"]:
            console.print(f"{name}: a tree of {m['tree_size']} nodes (no γ): predicted "
                          f"{x(m['prediction']['tree_predicted'])} = tokens/pass / (c + T(N)/T(1)), measured "
                          f"{x(m['measured_speedup'])}", highlight=False)
    if ran:
        t = Table(title="5. Predicted speedup by γ (reference formula with measured α, c, T(γ+1)/T(1)); "
                        "[bold]measured[/] at the γ run; * = needs a re-export with a larger --gamma")
        t.add_column("γ", justify="right")
        t.add_column("T(γ+1)/T(1)", justify="right")
        for name in ran:
            t.add_column(name, justify="right")
        first = next(iter(ran.values()))["prediction"]
        for i, g in enumerate(first["gammas"]):
            cells = []
            for name, m in ran.items():
                cell = x(m["prediction"]["predicted"][i])
                if g == s["gamma_run"]:
                    cell += f" [bold](measured {x(m['measured_speedup'])})[/]"
                cells.append(cell + ("*" if g > s["gamma_max"] else ""))
            t.add_row(str(g), f"{first['verify_ratio'][i]:.2f}", *cells)
        t.add_row("break-even γ", "", *(str(m["prediction"]["break_even_gamma"] or "none pays")
                                        for m in ran.values()))
        t.add_row("break-even α", "", *("-" if m["prediction"]["break_even_alpha"] is None else
                                        f"{m['prediction']['break_even_alpha']:.2f}" for m in ran.values()))
        console.print(t)

    rec = report["recommendation"]
    if rec["method"] == "none":
        head = "[bold]no speculation[/] (method none)"
    else:
        gamma = "a tree, no γ" if rec["gamma"] is None else f"γ={rec['gamma']}"
        top = rec["speculation_max_batch"]
        batch = (f"paid at every batch profiled (up to {top})" if rec["max_batch_is_lower_bound"]
                 else f"switch it off above batch {top}")
        head = f"[bold]{rec['method']}, {gamma}[/]: {x(rec['predicted_speedup'])} predicted; {batch}"
    console.print("Recommendation: " + head)
    for reason in rec["reasons"]:
        console.print(f"  - {reason}", highlight=False)


def write_plots(report: dict, out: Path) -> dict:
    """verify_cost.png (T(Q)/T(1) per batch) and speedup.png (predicted vs measured over γ); name -> path."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state (renders with Agg)

    paths = {"verify_cost": out / "verify_cost.png", "speedup": out / "speedup.png"}
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for c in report["verify_cost"]:
        (line,) = ax.plot(c["q"], c["ratio"], marker="o", label=f"batch {c['batch']}")
        if c["ridge_q"] is not None:
            ax.axvline(c["ridge_q"], color=line.get_color(), linestyle=":", linewidth=1)
    exported = report.get("export_curve")
    if exported:
        ax.plot(exported["q"], exported["ratio"], marker="x", linestyle="-.", color="black",
                label="batch 1 at export (manifest)")
    qs = np.array(report["verify_cost"][0]["q"])
    ax.plot(qs, qs, color="grey", linestyle="--", linewidth=1, label="proportional (T(Q) = Q T(1))")
    ax.set(xscale="log", yscale="log", xlabel="positions verified per call Q", ylabel="T(Q) / T(1)",
           title="Verification cost (dotted: ridge)")
    ax.set_xticks(qs, [str(q) for q in qs], minor=False)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["verify_cost"], dpi=110)

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for name, m in report["methods"].items():
        if not m["available"]:
            continue
        p = m["prediction"]
        if not p["gammas"]:  # a tree method: no γ axis
            ax.axhline(m["measured_speedup"], linestyle="-.", linewidth=1, label=f"{name} (tree): measured")
            continue
        (line,) = ax.plot(p["gammas"], p["predicted"], marker="o", label=f"{name}: predicted")
        ax.plot(p["gammas"], p["calibrated"], linestyle=":", color=line.get_color(), label=f"{name}: calibrated")
        ax.plot([m["gamma_run"]], [m["measured_speedup"]], marker="*", markersize=14, color=line.get_color(),
                linestyle="", label=f"{name}: measured")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    g_max = report["settings"]["gamma_max"]
    if g_max < 8:
        ax.axvspan(g_max + 0.5, 8.5, color="grey", alpha=0.12, label=f"γ > {g_max}: needs a re-export")
    ax.set(xlabel="draft length γ", ylabel="speedup over plain decoding", title="Predicted vs measured speedup")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["speedup"], dpi=110)
    return {k: str(v) for k, v in paths.items()}


def onnx_operator_profile(rt, cfg: ProfileConfig, out: Path, threads: int | None = None) -> dict:
    """ONNX Runtime's per-operator profile of every graph over its exported shapes; role -> summary.

    Each graph is opened in a second session with profiling on and run ``cfg.repeats`` times per
    shape; the trace (Chrome trace JSON) is kept in ``out`` and its kernel times summed by operator.
    """
    from ...engines.ort import OrtEngine
    from ...runtime.api import runner_for_graph

    out.mkdir(parents=True, exist_ok=True)
    past, _ = timing_past_len(rt, cfg)
    rng = np.random.default_rng(cfg.seed)
    summary = {}
    for role, model in role_models(rt).items():
        serving = getattr(model.engine, "session", None)  # the runtime's own session: same providers
        engine = OrtEngine(rt.manifest.root / model.spec.file, threads=threads, profile_prefix=str(out / role),
                           providers=serving.get_providers() if serving else None,
                           attention=getattr(model.engine, "attention", None),  # the runtime's kernels too
                           matmul=getattr(model.engine, "matmul", None))
        runner = runner_for_graph(engine, model.spec, rt.manifest.max_len)
        for shape, q in model.spec.shapes.items():
            p = 0 if shape == "prefill" else min(past, rt.manifest.max_len - int(q))
            time_forward(runner, 1, int(q), p, rng, 0, cfg.repeats, shape.startswith("tree"),
                         model.spec.geometry.vocab_size)
        trace = Path(engine.session.end_profiling())
        summary[role] = {"trace_file": str(trace), **top_operators(json.loads(trace.read_text()))}
    return summary


def top_operators(events: list) -> dict:
    """Sum kernel time by operator type over a Chrome-trace event list."""
    total_us, calls = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            total_us[op] += e.get("dur", 0)
            calls[op] += 1
    all_us = sum(total_us.values()) or 1.0
    ranked = sorted(total_us, key=total_us.get, reverse=True)
    return {"kernel_ms": all_us / 1e3,
            "top_ops": [{"op": op, "total_ms": total_us[op] / 1e3, "share": total_us[op] / all_us,
                         "calls": calls[op]} for op in ranked[:TOP_OPS]]}


def print_operator_profile(summary: dict, console) -> None:
    from rich.table import Table

    for role, s in summary.items():
        t = Table(title=f"ONNX Runtime operators, {role} graph ({s['kernel_ms']:.1f} ms of kernels; "
                        f"trace {Path(s['trace_file']).name})")
        for col in ("operator", "total ms", "share", "calls"):
            t.add_column(col, justify="left" if col == "operator" else "right")
        for op in s["top_ops"]:
            t.add_row(op["op"], f"{op['total_ms']:.2f}", f"{op['share']:.0%}", str(op["calls"]))
        console.print(t)
