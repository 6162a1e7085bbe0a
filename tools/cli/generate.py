"""`specrt generate`: stream a completion from an engine dir."""
from __future__ import annotations

import json
import sys

import click

from .options import attention_option, load_runtime, sampling_options, summary_line


@click.command()
@click.argument("engine_dir", type=click.Path())
@click.option("--prompt", default=None, help="Prompt text (or --prompt-file).")
@click.option("--prompt-file", type=click.File("r", encoding="utf-8"), default=None,
              help="Read the prompt from a file, or '-' for standard input.")
@click.option("--chat", is_flag=True, help="The prompt is a user message: render it with the tokenizer's chat template.")
@click.option("--system", default=None, help="With --chat: a system message before the user's.")
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (token_ids, text, stats) instead.")
@click.option("--backend", default="ort", show_default=True, type=click.Choice(["ort", "torch", "trt"]),
              help="ort: ONNX Runtime; torch: needs `export --torch-weights`; trt: needs `export --trt`.")
@click.option("--device", default=None, type=click.Choice(["cpu", "cuda"]),
              help="cpu | cuda (default: cpu; ort: cuda = the CUDA execution provider, needs onnxruntime-gpu).")
@click.option("--providers", default=None,
              help="ort: execution providers in priority order, comma-separated (cpu, cuda, tensorrt or full names).")
@click.option("--threads", default=None, type=click.IntRange(1), help="ONNX Runtime intra-op threads (default: ORT's).")
@attention_option
@click.option("--runtime", "runtime_kind", default="python", show_default=True, type=click.Choice(["python", "cpp"]),
              help="python: the decode core (every method and option); cpp: the decode loop in libspecrt, the "
                   "fastest batch-1 step on CPU (methods none/draft/ngram/suffix; build it once with "
                   "`python -m specrt.tools.libspecrt build`).")
@click.option("--cpp-lib", default=None, type=click.Path(), help="--runtime cpp: libspecrt.so to load "
              "(default: $SPECRT_CPP_BUILD/libspecrt.so, else the repository's build/cpp).")
def generate(engine_dir, prompt, prompt_file, chat, system, as_json, backend, device, providers, threads,
             attention, runtime_kind, cpp_lib, **sampling):
    """Generate a continuation of --prompt, streaming text, then a one-line summary.

    Ctrl-C stops it: the summary of what was produced, exit code 130."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if system is not None and not chat:
        raise click.UsageError("--system needs --chat")
    if attention == "specrt" and backend != "ort":
        raise click.UsageError("--attention specrt runs with --backend ort")
    text = prompt if prompt is not None else prompt_file.read()
    if runtime_kind == "cpp":
        return generate_cpp(engine_dir, text, chat, system, as_json, backend, device, providers, threads, cpp_lib,
                            attention, **sampling)
    options = {k: v for k, v in (("device", device), ("threads", threads)) if v}
    if attention and backend == "ort":  # auto elsewhere: nothing to choose
        options["attention"] = attention
    if providers:
        options["providers"] = [p.strip() for p in providers.split(",") if p.strip()]
    rt = load_runtime(engine_dir, backend=backend, **options)
    if chat:
        text = chat_prompt(rt, text, system)
    try:
        gen = rt.stream(text, **sampling)
        if as_json:
            out = gen.result()
            click.echo(json.dumps({"token_ids": out.token_ids, "text": out.text,
                                   "finish_reason": out.finish_reason, "stats": out.stats}))
            return
        for event in gen:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    except (ValueError, TypeError) as e:
        raise click.ClickException(str(e))
    except KeyboardInterrupt:
        click.echo()
        click.echo(f"interrupted after {len(gen.token_ids)} tokens", err=True)
        raise
    click.echo()
    click.echo(summary_line(gen.stats, gen.finish_reason), err=True)


def generate_cpp(engine_dir, text, chat, system, as_json, backend, device, providers, threads, cpp_lib,
                 attention, acceptance, **sampling):
    """--runtime cpp: libspecrt's decode loop (tools/cpp_generate.py), the same text and summary."""
    from ...engines import EngineError
    from ..cpp_generate import CppSetupError, CppTextEngine
    from ..libspecrt import CppError

    for flag, value, allowed in (("--backend", backend, "ort"), ("--device", device or "cpu", "cpu"),
                                 ("--acceptance", acceptance, "exact")):
        if value != allowed:
            raise click.UsageError(f"--runtime cpp runs ONNX Runtime on the CPU with exact acceptance; {flag} {value} "
                                   f"needs --runtime python")
    if providers:
        raise click.UsageError("--providers needs --runtime python (libspecrt runs ONNX Runtime's CPU provider)")
    try:
        engine = CppTextEngine(engine_dir, threads=threads or 0, library=cpp_lib, attention=attention)
        if chat:
            text = chat_prompt(engine, text, system)
        write = None if as_json else (lambda delta: (sys.stdout.write(delta), sys.stdout.flush()))
        out = engine.generate(text, write, **sampling)
    except (EngineError, CppSetupError, CppError, ValueError) as e:
        raise click.ClickException(str(e))
    except KeyboardInterrupt:
        click.echo()
        click.echo("interrupted", err=True)
        raise
    if as_json:
        click.echo(json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                               "stats": out.stats}))
        return
    click.echo()
    click.echo(summary_line(out.stats, out.finish_reason), err=True)


def chat_prompt(rt, user: str, system: str | None) -> str:
    """The prompt text for one user message (after an optional system message), as `specrt serve` builds it."""
    try:
        from ...runtime.serve.chat import ChatTemplate, TemplateInputError
    except ImportError as e:
        raise click.ClickException(f"--chat renders the tokenizer's chat template, which needs jinja2: "
                                   f"pip install 'specrt[serve]' ({e})")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}]
    try:
        return ChatTemplate(rt.manifest.tokenizer_dir).render(messages)
    except TemplateInputError as e:
        raise click.ClickException(f"the chat template rejected the messages: {e}")
