"""Backends that run one graph: named numpy arrays in, named arrays out."""
from .base import Engine, EngineError
from .ort import OrtEngine

__all__ = ["Engine", "EngineError", "OrtEngine", "open_engine"]


def open_engine(path, backend: str = "ort", **options) -> Engine:
    """Open one graph file with the named backend."""
    if backend == "ort":
        return OrtEngine(path, **options)
    raise EngineError(f"unknown backend {backend!r}; available: ort")
