"""`specrt profile`: is speculation paying off on this machine? (tools/profile*.py, docs/profiling.md)"""
from __future__ import annotations

import json
from pathlib import Path

import click

from .options import attention_option


def int_list(ctx, param, value: str) -> tuple:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}")
    if not out or min(out) < 1:
        raise click.BadParameter(f"expected integers >= 1, got {value!r}")
    return out


def method_list(ctx, param, value: str | None) -> tuple:
    from ..profile.measure import KNOWN_METHODS

    if value is None:
        return ()
    out = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [m for m in out if m not in KNOWN_METHODS]
    if unknown:
        raise click.BadParameter(f"unknown method(s) {unknown}; known: {', '.join(KNOWN_METHODS)}")
    return out


def read_prompts(path: str) -> tuple:
    """A .json list of strings, a .jsonl file (one string or {"prompt": ...} per line), or text:
    prompts separated by lines holding only ``---``, else one prompt per non-empty line.

    In text files a prompt's final line break is not kept; use .json(l) for exact whitespace."""
    text = Path(path).read_text()
    try:
        if path.endswith(".json"):
            items = json.loads(text)
        elif path.endswith(".jsonl"):
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
            items = [i["prompt"] if isinstance(i, dict) else i for i in items]
        elif any(line.strip() == "---" for line in text.splitlines()):
            items = text.removesuffix("\n").split("\n---\n")  # a prompt's last line break is not kept
        else:
            items = [line for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise click.ClickException(f"cannot read prompts from {path}: {e}")
    if not isinstance(items, list) or not items or not all(isinstance(i, str) and i for i in items):
        raise click.ClickException(f"{path}: expected a non-empty list of non-empty prompt strings")
    return tuple(items)


@click.command()
@click.argument("engine_dir", type=click.Path())
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              help="Prompt file (.json list, .jsonl, or text: '---' separated or one per line). "
                   "Default: built-in code and prose prompts.")
@click.option("--methods", callback=method_list, help="Comma-separated: draft, ngram, suffix, medusa, eagle "
              "(default: every speculative method this runtime implements).")
@click.option("--batch", "batches", default="1,4,16", show_default=True, callback=int_list,
              help="Batch sizes of the verification cost curve.")
@click.option("--out", default="specrt-profile", show_default=True, type=click.Path(file_okay=False),
              help="Folder for profile.json and the PNG plots.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--gamma", default=None, type=click.IntRange(1),
              help="γ every chain method runs at (default: the exported γ).")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--min-p", default=0.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int, help="Prompt i is sampled with seed + i.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(0), help="Untimed calls per shape.")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(1), help="Timed calls per shape.")
@click.option("--past-len", default=128, show_default=True, type=click.IntRange(0),
              help="Cached tokens during timed decode/verify calls (capped to fit max_len).")
@click.option("--threads", default=None, type=click.IntRange(1), help="ONNX Runtime intra-op threads.")
@attention_option
@click.option("--onnx-profile", is_flag=True, help="Also write ONNX Runtime's per-operator profile of each graph.")
@click.option("--write-defaults", is_flag=True,
              help="Write the recommended method, γ and max batch into the engine dir's manifest.json.")
def profile(engine_dir, prompts_file, methods, batches, out, threads, attention, onnx_profile, write_defaults,
            **settings):
    """Measure ENGINE_DIR on this machine: latencies, verification cost, α and c per method,
    predicted vs measured speedup, and a recommended method and γ."""
    from rich.console import Console

    from .options import load_runtime
    from ..profile.measure import ProfileConfig, profile_engine, write_defaults as write_manifest_defaults
    from ..profile.report import onnx_operator_profile, print_operator_profile, print_report, write_plots

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.ClickException("specrt profile draws its plots with matplotlib: pip install 'specrt[profile]'")
    rt = load_runtime(engine_dir, **({"threads": threads} if threads else {}),
                      **({"attention": attention} if attention else {}))
    cfg = ProfileConfig(methods=methods, batches=batches, prompts=read_prompts(prompts_file) if prompts_file else (),
                        **settings)
    console = Console()
    log = lambda msg: console.print(f"[dim]{msg}[/]", highlight=False)  # noqa: E731
    try:
        report = profile_engine(rt, cfg, log=log)
    except ValueError as e:
        raise click.ClickException(str(e))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report["files"] = {"json": str(out / "profile.json"), **write_plots(report, out)}
    if onnx_profile:
        log("ONNX Runtime operator profile ...")
        report["onnx_profile"] = onnx_operator_profile(rt, cfg, out / "onnx_profile", threads)
    print_report(report, console)
    if onnx_profile:
        print_operator_profile(report["onnx_profile"], console)
    if write_defaults:
        report["written_defaults"] = write_manifest_defaults(engine_dir, report["recommendation"])
        console.print(f"wrote defaults {report['written_defaults']} to {Path(engine_dir) / 'manifest.json'}")
    Path(report["files"]["json"]).write_text(json.dumps(report, indent=1))
    console.print(f"wrote {report['files']['json']}, {report['files']['verify_cost']}, {report['files']['speedup']}")
