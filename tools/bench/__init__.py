"""Benchmarks: `specrt bench plain|spec` (spec.py) and the `python -m specrt.tools.bench.NAME` scripts."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def checkout_env(checkout) -> tuple[tempfile.TemporaryDirectory, dict]:
    """(a temp dir holding a `specrt` link to ``checkout``, an environment with it first on PYTHONPATH): a
    subprocess started with that environment imports that checkout's specrt (A/B runs of two commits).
    Clean up the temp dir when the subprocess is done."""
    links = tempfile.TemporaryDirectory()
    (Path(links.name) / "specrt").symlink_to(Path(checkout).resolve())
    return links, {**os.environ, "PYTHONPATH": links.name}
