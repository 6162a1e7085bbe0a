"""Engine dirs of the real models, exported through the `specrt export` command and kept between runs.

An engine dir is cached under ``$SPECRT_CACHE/real-engines/<name>-<key>``, where the key hashes what the
export depends on: the GGUF file's sha256, the command's arguments, the source of everything the export
runs and the versions of the libraries it calls (``tools.demo_engines.export_fingerprint``). Any change to one of them exports again; a run with the same sources
reuses the dir (the export is atomic: a dir exists only if every graph passed its checks). A new export
removes the dirs of the same name under other keys, so the cache holds one engine per name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from specrt.tools.demo_engines import export_fingerprint



@dataclass
class Export:
    """What one `specrt export` gave: the engine dir (None if it failed), its output, whether it ran now."""

    engine_dir: Path | None
    output: str
    exported_now: bool
    seconds: float


def cache_root() -> Path:
    return Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt")) / "real-engines"


def export_key(gguf_sha256: str, args: list[str]) -> str:
    """The GGUF file, the export's arguments and everything else the export depends on (export_fingerprint)."""
    return hashlib.sha256(json.dumps([gguf_sha256, args, export_fingerprint()]).encode()).hexdigest()[:16]


def cached_export(name: str, gguf: Path, gguf_sha256: str, args: list[str]) -> Export:
    """`specrt export --target GGUF --out DIR *args` (click's runner, in-process), or the cached dir."""
    from click.testing import CliRunner

    from specrt.tools.cli import cli

    out = cache_root() / f"{name}-{export_key(gguf_sha256, args)}"
    if (out / "manifest.json").is_file():
        return Export(out, f"cached: {out}", False, 0.0)
    t0 = time.perf_counter()
    result = CliRunner().invoke(cli, ["export", "--target", str(gguf), "--out", str(out), *args])
    seconds = time.perf_counter() - t0
    ok = result.exit_code == 0 and (out / "manifest.json").is_file()
    if ok:
        for old in out.parent.glob(f"{name}-*"):
            if old != out and re.fullmatch(re.escape(name) + r"-[0-9a-f]{16}", old.name):
                shutil.rmtree(old, ignore_errors=True)
    output = result.output + (f"\n{type(result.exception).__name__}: {result.exception}"
                              if result.exception and not isinstance(result.exception, SystemExit) else "")
    return Export(out if ok else None, output, True, seconds)
