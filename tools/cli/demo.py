"""`specrt demo`: export the committed demo pair (once, into a cache dir) and generate code."""
from __future__ import annotations

from pathlib import Path

import click

from ..demo_engines import demo_engine_dir
from ..prompts import CODE
from .options import load_runtime

def demo_engine(gamma: int = 4, max_len: int = 1024) -> Path:
    """The demo engine dir (exported once); a clear error where the export dependencies are missing."""
    try:
        return demo_engine_dir(gamma, max_len, log=click.echo)
    except ImportError as e:
        raise click.ClickException(f"the demo exports its models first, which needs torch, transformers and "
                                   f"onnx: pip install 'specrt[export]' ({e})")


@click.command()
@click.option("--max-new-tokens", default=96, show_default=True, type=int)
@click.option("--prompts", "n_prompts", default=3, show_default=True, type=click.IntRange(1, len(CODE)))
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--threads", default=None, type=click.IntRange(1), help="ONNX Runtime intra-op threads (default: ORT's).")
def demo(max_new_tokens, n_prompts, temperature, threads):
    """Run the demo model pair: plain vs speculative (draft model, n-gram) decoding on code prompts."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rt = load_runtime(demo_engine(), **({"threads": threads} if threads else {}))
    table = Table(title="specrt demo (ONNX Runtime, CPU)")
    for col in ("prompt", "method", "tokens", "tok/s", "speedup", "alpha", "tok/pass", "= plain"):  # fits 80 columns
        table.add_column(col, no_wrap=True)
    rt.generate(CODE[0], max_new_tokens=8, method="draft")  # warm-up and cost calibration
    for i, prompt in enumerate(CODE[:n_prompts]):
        plain = rt.generate(prompt, max_new_tokens=max_new_tokens, method="none", temperature=temperature, seed=i)
        console.rule(f"prompt {i + 1}")
        console.print(prompt + "[bold green]" + rich_escape(plain.text) + "[/]", highlight=False)
        for method in ("none", "draft", "ngram"):
            out = plain if method == "none" else rt.generate(
                prompt, max_new_tokens=max_new_tokens, method=method, temperature=temperature, seed=i)
            s = out.stats
            table.add_row(str(i + 1), method, str(s["new_tokens"]), f"{s['tokens_per_second']:.0f}",
                          f"{s['tokens_per_second'] / plain.stats['tokens_per_second']:.2f}x",
                          f"{s.get('alpha', 0):.2f}" if method != "none" else "-",
                          f"{s.get('tokens_per_pass', 1):.2f}",
                          "-" if method == "none" else ("yes" if out.token_ids == plain.token_ids else "no"))
    console.print(table)
    if temperature > 0:
        console.print("At temperature > 0 outputs differ between methods (different random streams); "
                      "each follows the target's distribution exactly.")


def rich_escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
