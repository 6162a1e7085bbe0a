"""`specrt bench`: see tools/bench/spec.py."""
from __future__ import annotations

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def bench(ctx):
    """Benchmarks (plain decode vs peers; speculative methods). See `specrt bench --help-bench`."""
    from ..bench.spec import main as bench_main

    bench_main(ctx.args)
