"""`specrt generate`: stream a completion from an engine dir."""
from __future__ import annotations

import json
import sys

import click

from .options import load_runtime, sampling_options, summary_line


@click.command()
@click.argument("engine_dir", type=click.Path())
@click.option("--prompt", required=True, help="Prompt text.")
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (token_ids, text, stats) instead.")
@click.option("--backend", default="ort", show_default=True, type=click.Choice(["ort", "torch", "trt"]),
              help="ort: ONNX Runtime; torch: needs `export --torch-weights`; trt: needs `export --trt`.")
@click.option("--device", default=None, type=click.Choice(["cpu", "cuda"]),
              help="cpu | cuda (default: cpu; ort: cuda = the CUDA execution provider, needs onnxruntime-gpu).")
@click.option("--threads", default=None, type=click.IntRange(1), help="ONNX Runtime intra-op threads (default: ORT's).")
def generate(engine_dir, prompt, as_json, backend, device, threads, **sampling):
    """Generate a continuation of --prompt, streaming text, then a one-line summary."""
    options = {k: v for k, v in (("device", device), ("threads", threads)) if v}
    rt = load_runtime(engine_dir, backend=backend, **options)
    try:
        gen = rt.stream(prompt, **sampling)
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
    click.echo()
    click.echo(summary_line(gen.stats, gen.finish_reason), err=True)
