"""Backends that run one graph: named numpy arrays in, named arrays out."""
from .base import Engine, EngineError
from .ort import OrtEngine

__all__ = ["Engine", "EngineError", "OrtEngine", "open_engine", "BACKENDS"]

BACKENDS = ("ort", "torch", "trt")


def open_engine(path, backend: str = "ort", **options) -> Engine:
    """Open one graph file with the named backend.

    ort: ONNX Runtime (CPU by default; ``providers=["cuda"]`` etc. with onnxruntime-gpu).
    torch: the export wrapper over the engine dir's HF weights (``specrt export --torch-weights``);
    options device ("cpu" | "cuda"), dtype. Graphs that have no torch weights because they are
    not target/draft decoders (the Medusa heads graph) run in ONNX Runtime on CPU.
    trt: the TensorRT plan that ``specrt export --trt`` built for this graph; option device.
    torch and tensorrt are imported only here, so the runtime runs without them.
    """
    if backend == "ort":
        return OrtEngine(path, **options)
    if backend == "torch":
        from .torch_backend import TorchEngine, is_decoder_graph

        if not is_decoder_graph(path):
            return OrtEngine(path)
        return TorchEngine(path, **options)
    if backend == "trt":
        from .trt_backend import TrtEngine

        return TrtEngine(path, **options)
    raise EngineError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
