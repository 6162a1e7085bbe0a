"""The `specrt` command: one thin module per subcommand (tools/cmd_*.py)."""
from __future__ import annotations

import click

from .. import __version__
from .cmd_bench import bench
from .cmd_demo import demo
from .cmd_export import export
from .cmd_generate import generate
from .cmd_profile import profile
from .cmd_serve import serve
from .cmd_train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specrt")
def cli():
    """specrt: export HF causal LMs to ONNX and run exact speculative decoding."""


for command in (export, generate, demo, bench, profile, train, serve):
    cli.add_command(command)


def main():
    cli()
