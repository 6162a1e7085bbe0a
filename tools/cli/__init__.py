"""The `specrt` command: one thin module per subcommand (tools/cli/*.py)."""
from __future__ import annotations

import click

from ... import __version__
from .bench import bench
from .demo import demo
from .export import export
from .generate import generate
from .profile import profile
from .serve import serve
from .train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="specrt")
def cli():
    """specrt: export HF causal LMs to ONNX and run exact speculative decoding."""


for command in (export, generate, demo, bench, profile, train, serve):
    cli.add_command(command)


def main():
    """The console entry point: Ctrl-C ends any command with exit code 130 (the shell's convention)."""
    import sys

    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("specrt: interrupted", err=True)
        sys.exit(130)
