"""GGUF files in: a llama.cpp / Ollama checkpoint turned into a local Hugging Face dir once, then exported.

transformers reads GGUF files itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package):
the weights are DEQUANTIZED to float (a Q4_1 file becomes fp32 weights), the tokenizer and its chat
template come from the file's metadata. ``hf_dir_from_gguf`` saves that model as an ordinary HF dir in a
cache keyed by the file's content, so a second export of the same file converts nothing; the export then
quantizes again as asked (``--quantize``), from the dequantized weights. Every family transformers reads
from GGUF works (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, ..., its ``GGUF_SUPPORTED_ARCHITECTURES``).

    hf_dir_from_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))  # -> ~/.cache/specrt/gguf/<sha256[:16]>/
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ExportError

SOURCE_FILE = "specrt_source.json"  # written into the converted dir: where it came from (the manifest records it)


def is_gguf(path: str | Path) -> bool:
    """A GGUF file: by its magic bytes, whatever its name."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_cache() -> Path:
    return Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt")) / "gguf"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hf_dir_from_gguf(path: str | Path, cache: Path | None = None, log=print) -> Path:
    """The HF dir of GGUF file ``path`` (converted on first use, atomically, into ``cache``)."""
    path = Path(path)
    digest = file_sha256(path)
    out = (cache or gguf_cache()) / digest[:16]
    if (out / SOURCE_FILE).is_file():
        return out
    log(f"reading GGUF {path.name} through transformers (weights dequantized to fp32) ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        source = convert(path, staging)
        (staging / SOURCE_FILE).write_text(json.dumps({**source, "sha256": digest}, indent=1))
        if out.exists():  # another process converted it meanwhile
            shutil.rmtree(staging)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def convert(path: Path, out: Path) -> dict:
    """Dequantize GGUF ``path`` into the HF dir ``out`` (model, tokenizer, chat template); returns what the
    file was: {"format": "gguf", "file", "architecture", "file_type"}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     local_files_only=True)
    except ImportError as e:
        raise ExportError(f"reading GGUF files needs the gguf package: pip install gguf accelerate ({e})") from None
    except (ValueError, KeyError, RuntimeError) as e:  # an architecture transformers cannot read from GGUF, ...
        raise ExportError(f"{path}: transformers could not read this GGUF file: {e}") from None
    del model.config.quantization_config  # "quantized with gguf" models refuse save_pretrained: save a plain copy
    plain = type(model)(model.config)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"format": "gguf", "file": path.name, "architecture": type(model).__name__,
            "file_type": file_type(path), "dequantized_to": "fp32"}


def file_type(path: Path) -> str | None:
    """The GGUF file's quantization as llama.cpp names it (``general.file_type``: "Q4_1", "Q4_K_M", ...)."""
    import gguf

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return None
    value = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)


def source_of(model_dir: Path) -> dict | None:
    """What ``hf_dir_from_gguf`` recorded about a converted dir (None: an ordinary HF dir)."""
    f = Path(model_dir) / SOURCE_FILE
    return json.loads(f.read_text()) if f.is_file() else None
