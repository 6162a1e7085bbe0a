"""The demo engine dirs: the committed demo models, exported once into the cache (keyed by their weights)."""
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
