"""GGUF files in: a llama.cpp / Ollama checkpoint turned into a local Hugging Face dir once, then exported.

transformers reads GGUF files (the ``gguf`` package): its config and tokenizer (with the chat template) come
from the file's metadata, and each tensor is DEQUANTIZED to fp32 (a Q4_1 file becomes fp32 weights) and
renamed / reshaped by transformers' per-architecture tensor processor. ``hf_dir_from_gguf`` writes them, one
tensor at a time, as an ordinary HF dir (safetensors shards) in a cache keyed by the file's content, so a
second export of the same file converts nothing and the conversion never holds the model; the export then
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
    """Dequantize GGUF ``path`` into the HF dir ``out`` (safetensors shards, tokenizer, chat template) one tensor
    at a time; returns what the file was: {"format": "gguf", "file", "architecture", "file_type"}."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # the parameter names, and nothing else
        write_tensors(path, model, out)
    except ImportError as e:
        raise ExportError(f"reading GGUF files needs the gguf package: pip install gguf accelerate ({e})") from None
    except (ValueError, KeyError, RuntimeError) as e:  # an architecture transformers cannot read from GGUF, ...
        raise ExportError(f"{path}: transformers could not read this GGUF file: {e}") from None
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the dir holds plain fp32 weights
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)  # bos / eos / pad, as save_pretrained writes
    tokenizer.save_pretrained(out)
    return {"format": "gguf", "file": path.name, "architecture": type(model).__name__,
            "file_type": file_type(path), "dequantized_to": "fp32"}


SHARD_BYTES = 256 << 20  # the converted dir's safetensors shards: about what the conversion holds at a time


def write_tensors(path: Path, model, out: Path) -> None:
    """The GGUF file's tensors, dequantized to fp32 one at a time and renamed / reshaped as transformers' GGUF
    loader does (its per-architecture TensorProcessor: Llama's q/k permutation, Gemma's norm offset, ...), written
    to ``out`` as safetensors shards of at most ``SHARD_BYTES`` with their index."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed.get("config", {}))
    names = get_gguf_hf_weights_map(model, processor)
    parsed["tensors"] = {}  # where a processor puts what it assembles itself (MoE experts)
    shard, size, weight_map, files = {}, 0, {}, []

    def flush():
        nonlocal shard, size
        if shard:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_safetensors(shard, out / files[-1])
            weight_map.update({name: files[-1] for name in shard})
            shard, size = {}, 0

    for t in reader.tensors:
        result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        ready = {names[result.name]: result.weights} if result.name in names else {}
        ready.update(parsed["tensors"])
        parsed["tensors"] = {}
        for name, w in ready.items():
            w = np.asarray(w, dtype=np.float32)
            if size and size + w.nbytes > SHARD_BYTES:
                flush()
            shard[name] = np.ascontiguousarray(w)
            size += w.nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def save_safetensors(tensors: dict, path: Path) -> None:
    """Write float32 numpy ``tensors`` as a safetensors file, each straight from its own memory (no copy)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for a in tensors.values():
            f.write(memoryview(a).cast("B"))


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
