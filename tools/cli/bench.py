"""`specrt bench plain|spec`: see tools/bench/spec.py (the other benchmarks: python -m specrt.tools.bench.NAME)."""
from __future__ import annotations

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.pass_context
def bench(ctx):
    """Benchmarks: `plain` (specrt vs HF transformers and optimum) or `spec` (every speculative method).

    `specrt bench --help` lists their options. Rows print as they finish, with an ETA."""
    from ..bench.spec import main as bench_main

    bench_main(ctx.args)
