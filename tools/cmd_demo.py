"""`specrt demo`: export the committed demo pair (once, into a cache dir) and generate code."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import click

from .options import load_runtime
from .prompts import CODE

DEMO_MODELS = Path(__file__).parent / "demo_models"


def demo_engine_dir(gamma: int = 4, max_len: int = 1024) -> Path:
    """Export tools/demo_models/{target,draft} into the cache (keyed by their weights) unless present."""
    h = hashlib.sha256(f"{gamma}/{max_len}".encode())
    for role in ("target", "draft"):
        h.update((DEMO_MODELS / role / "model.safetensors").read_bytes())
    cache = Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt"))
    out = cache / f"demo-{h.hexdigest()[:12]}"
    if not (out / "manifest.json").is_file():
        try:
            from ..export.onnx_export import ExportConfig, export_engine
        except ImportError as e:
            raise click.ClickException(f"the demo exports its models first, which needs torch, transformers and "
                                       f"onnx: pip install 'specrt[export]' ({e})")
        click.echo(f"exporting the demo pair to {out} (once) ...")
        export_engine(DEMO_MODELS / "target", out, draft_dir=DEMO_MODELS / "draft",
                      cfg=ExportConfig(gamma=gamma, max_len=max_len), log=click.echo)
    return out


@click.command()
@click.option("--max-new-tokens", default=96, show_default=True, type=int)
@click.option("--prompts", "n_prompts", default=3, show_default=True, type=click.IntRange(1, len(CODE)))
@click.option("--temperature", default=0.0, show_default=True, type=float)
def demo(max_new_tokens, n_prompts, temperature):
    """Run the demo model pair: plain vs speculative (draft model, n-gram) decoding on code prompts."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rt = load_runtime(demo_engine_dir())
    table = Table(title="specrt demo (ONNX Runtime, CPU)")
    for col in ("prompt", "method", "tokens", "tok/s", "speedup", "alpha", "tokens/pass", "same as plain"):
        table.add_column(col)
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
