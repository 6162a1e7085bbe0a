"""`specrt bench plain|spec|peers`: see tools/bench/spec.py and peers.py (the other benchmarks: python -m specrt.tools.bench.NAME)."""
from __future__ import annotations

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.pass_context
def bench(ctx):
    """Benchmarks: `plain` (specrt vs HF transformers and optimum), `spec` (every speculative method) or
    `peers` (specrt vs ONNX Runtime GenAI, llama.cpp, OpenVINO GenAI where installed; `peers --serve`: `specrt
    serve` vs llama-server through their OpenAI APIs).

    `specrt bench --help` / `specrt bench peers --help` list their options. Rows print as they finish."""
    if ctx.args[:1] == ["peers"]:
        from ..bench.peers import main as peers_main

        return peers_main(ctx.args[1:])
    from ..bench.spec import main as bench_main

    bench_main(ctx.args)
