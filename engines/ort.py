"""ONNX Runtime backend: CPU execution provider by default, any installed provider on request."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .base import EngineError


class OrtEngine:
    """One ONNX graph in an ``onnxruntime.InferenceSession``.

    providers: ORT execution providers in priority order (default: CPU). ``CUDAExecutionProvider``
    or ``TensorrtExecutionProvider`` work where onnxruntime-gpu / TensorRT are installed.
    threads: intra-op threads (default: ORT's choice, one per physical core).
    """

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise EngineError(f"graph file missing: {path}")
        available = ort.get_available_providers()
        providers = providers or ["CPUExecutionProvider"]
        missing = [p for p in providers if p not in available]
        if missing:
            raise EngineError(f"execution provider(s) {missing} not available in this onnxruntime "
                              f"(available: {available}); install onnxruntime-gpu for CUDA/TensorRT")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as e:  # ORT raises its own Fail/InvalidGraph types
            raise EngineError(f"ONNX Runtime cannot load {path.name}: {str(e).splitlines()[0]}") from None
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.path = path

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(None, feeds)
        return dict(zip(self.output_names, outs))
