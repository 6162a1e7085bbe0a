"""Options and output shared by the CLI commands."""
from __future__ import annotations

import functools

import click


def sampling_options(f):
    """--max-new-tokens, --temperature, --top-p, --top-k, --min-p, --seed, --method, --gamma, --stop, --acceptance."""
    opts = [
        click.option("--max-new-tokens", default=64, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy."),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 = off."),
        click.option("--min-p", default=0.0, show_default=True, type=float, help="0 = off."),
        click.option("--seed", default=None, type=int),
        click.option("--method", default=None, type=click.Choice(["none", "draft", "ngram", "suffix", "medusa", "eagle"]),
                     help="Proposer (default: the engine dir's default)."),
        click.option("--gamma", default=None, type=int, help="Fixed draft length; default: the engine dir's defaults.gamma (adaptive if null)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--acceptance", default="exact", show_default=True, type=click.Choice(["exact", "typical"]),
                     help="Medusa tree verification: exact (the target's distribution), or typical "
                          "(Medusa-2's posterior threshold: LOSSY at temperature > 0)."),
    ]
    for opt in reversed(opts):
        f = opt(f)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        kwargs["stop"] = tuple(kwargs.get("stop") or ())
        return f(*args, **kwargs)

    return wrapper


ATTENTION_HELP = ("Who computes the graphs' attention: specrt (specrt's CPU kernel, built on first use with g++: see "
                  "docs/runtime.md), ort (ONNX Runtime's GroupQueryAttention) or auto (specrt's where it builds and "
                  "the graphs run on a CPU with AVX-512 or AVX2, else ort's). Default: $SPECRT_ATTENTION, else auto.")
attention_option = click.option("--attention", default=None, type=click.Choice(["auto", "ort", "specrt"]),
                                help=ATTENTION_HELP)


def load_runtime(engine_dir, **options):
    import specrt
    from ...engines import EngineError

    try:
        return specrt.load(engine_dir, **options)
    except EngineError as e:
        raise click.ClickException(str(e))


def summary_line(stats: dict, finish_reason: str) -> str:
    runtime = " C++" if stats.get("runtime") == "cpp" else ""
    s = (f"[{stats['method']}{runtime}] {stats['new_tokens']} tokens in {stats['seconds']:.3f} s "
         f"({stats['tokens_per_second']:.1f} tok/s), {stats['target_passes']} target passes, finish: {finish_reason}")
    if stats["method"] != "none":
        s += (f"; alpha {stats['alpha']:.2f} ({stats['accepted']} of {stats['proposed']} proposed tokens accepted), "
              f"{stats['tokens_per_pass']:.2f} tokens/pass")
        if "c" in stats:  # the Python runtime's cost model (libspecrt does not report it)
            s += f", c {stats['c']:.3f}, predicted speedup {stats['predicted_speedup']:.2f}x"
    if stats["method"] == "medusa":
        s += (f"; tree {stats['tree']} ({stats['tree_size']} nodes), per-depth acceptance "
              f"{stats['per_depth_acceptance']}")
        if stats["lossy"]:
            s += "; LOSSY: typical acceptance, output does not follow the target's distribution"
    return s
