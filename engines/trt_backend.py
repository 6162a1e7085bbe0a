"""`trt` backend: the TensorRT plans `specrt export --trt` builds (export/trt_build.py).

``TrtCore`` binds tensors by name (``set_input_shape`` / ``set_tensor_address``) and runs
``execute_async_v3`` on torch's current CUDA stream, so it serves as a ``DeviceModel`` core:
``load_device_runtime(engine_dir, backend="trt")`` keeps the KV cache on the device and
captures one CUDA graph per fixed shape around the enqueue (after a warm-up enqueue, as
TensorRT requires before capture). Each captured shape gets its own execution context, so no
two graphs share a context's shape state. ``TrtEngine`` is the Engine protocol (numpy in and
out, one context per optimization profile) for ``specrt.load(engine_dir, backend="trt")``.

Device buffers come from torch's CUDA allocator. Written against TensorRT's documented Python
API (10.x and later); nothing here runs without tensorrt, torch with CUDA and an NVIDIA GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .base import EngineError
from ..contract import io_names


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise EngineError("needs tensorrt (not installed): pip install 'specrt[tensorrt]'") from None
    return trt


def plan_path(engine_dir, role: str) -> Path:
    """The plan of ``role`` recorded in the manifest (``models.<role>.trt.plan``)."""
    root = Path(engine_dir)
    raw = json.loads((root / "manifest.json").read_text())
    rec = (raw.get("models", {}).get(role) or {}).get("trt")
    if not rec:
        raise EngineError(f"engine dir {root} has no TensorRT plan for its {role} graph: export with `--trt`")
    path = root / rec["plan"]
    if not path.is_file():
        raise EngineError(f"engine dir {root}: TensorRT plan {rec['plan']!r} is missing")
    return path


class TrtCore:
    """A deserialized plan, called like the graph: torch CUDA tensors in, torch CUDA tensors out.

    context_per_shape: one execution context per input-shape signature (for CUDA-graph capture);
    otherwise one per optimization profile. Outputs are static per output shape: read them before
    the next call.
    """

    def __init__(self, plan, device="cuda", context_per_shape: bool = True):
        import torch

        trt = import_tensorrt()
        self.trt, self.torch = trt, torch
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise EngineError("the trt backend needs a CUDA device (torch.cuda.is_available() is False)")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan).read_bytes())
        if self.engine is None:
            raise EngineError(f"TensorRT cannot deserialize {plan} (built by another TensorRT version or GPU?)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        # positional calls follow the graph contract's order, whatever order the plan lists its tensors in
        layers = sum(n.startswith("past_key.") for n in inputs)
        self.input_names, self.output_names = io_names(layers, "hidden" in outputs)
        if sorted(self.input_names) != sorted(inputs) or sorted(self.output_names) != sorted(outputs):
            raise EngineError(f"TensorRT plan {plan}: tensors {inputs + outputs} do not match the graph contract")
        to_torch = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64,
                    trt.int32: torch.int32}
        if hasattr(trt, "bfloat16"):
            to_torch[trt.bfloat16] = torch.bfloat16
        self.dtypes = {n: to_torch[self.engine.get_tensor_dtype(n)] for n in names}
        self.io_dtype = self.dtypes.get("past_key.0", torch.float32)
        self.context_per_shape = context_per_shape
        self.contexts: dict = {}  # key -> execution context
        self.outputs: dict = {}  # output shapes -> output tensors
        self._empty = torch.zeros(64, dtype=torch.uint8, device=self.device)  # a valid address for empty tensors

    def _profile(self, shapes: dict) -> int:
        """The optimization profile whose ranges contain every input shape."""
        for k in range(self.engine.num_optimization_profiles):
            ok = True
            for name, shape in shapes.items():
                lo, _, hi = self.engine.get_tensor_profile_shape(name, k)
                if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
                    ok = False
                    break
            if ok:
                return k
        q = shapes["input_ids"]
        raise EngineError(f"no TensorRT optimization profile covers batch {q[0]}, query {q[1]}, past "
                          f"{shapes['past_key.0'][0]}: rebuild the plans with that shape")

    def __call__(self, *inputs):
        torch = self.torch
        stream = torch.cuda.current_stream(self.device).cuda_stream
        shapes = {n: tuple(t.shape) for n, t in zip(self.input_names, inputs)}
        sig = tuple(shapes.values())
        profile = self._profile(shapes)
        key = sig if self.context_per_shape else profile
        ctx = self.contexts.get(key)
        if ctx is None:
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(profile, stream)
            self.contexts[key] = ctx
        for name, t in zip(self.input_names, inputs):
            if t.dtype != self.dtypes[name] or not t.is_contiguous():
                raise EngineError(f"TensorRT input {name}: needs a contiguous {self.dtypes[name]} tensor, got "
                                  f"{t.dtype} (contiguous={t.is_contiguous()})")
            ctx.set_input_shape(name, shapes[name])
            ctx.set_tensor_address(name, t.data_ptr() if t.numel() else self._empty.data_ptr())
        out_shapes = tuple(tuple(ctx.get_tensor_shape(n)) for n in self.output_names)
        outs = self.outputs.get(out_shapes)  # keyed by output shapes: independent of the past length
        if outs is None:
            outs = [torch.empty(shape, dtype=self.dtypes[n], device=self.device)
                    for n, shape in zip(self.output_names, out_shapes)]
            self.outputs[out_shapes] = outs
        for name, t in zip(self.output_names, outs):
            ctx.set_tensor_address(name, t.data_ptr())
        if not ctx.execute_async_v3(stream):
            raise EngineError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        return tuple(outs)


class TrtEngine:
    """Engine protocol (numpy in/out) over a plan: ``specrt.load(engine_dir, backend="trt")``.

    path: ``ENGINE_DIR/<role>.onnx`` as the runtime passes it (the plan comes from the manifest)
    or a ``.plan`` file. The runtime's host cache is uploaded each call (no CUDA graphs here:
    use ``load_device_runtime(engine_dir, backend="trt")`` for the device-resident path).
    """

    def __init__(self, path, device: str = "cuda"):
        path = Path(path)
        if path.suffix != ".plan":
            raw = json.loads((path.parent / "manifest.json").read_text()) if (path.parent / "manifest.json").is_file() else {}
            role = next((r for r, m in raw.get("models", {}).items() if m.get("file") == path.name), None)
            if role is None:
                raise EngineError(f"{path.name} is not a target/draft graph of an engine dir: no TensorRT plan for it")
            path = plan_path(path.parent, role)
        self.core = TrtCore(path, device, context_per_shape=False)
        self.input_names, self.output_names = self.core.input_names, self.core.output_names

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.core.torch
        dev = self.core.device
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n])).to(dev, self.core.dtypes[n]) for n in self.input_names]
        outs = self.core(*args)
        torch.cuda.current_stream(dev).synchronize()
        np_of = {torch.float16: np.float16}
        result = {}
        for name, t in zip(self.output_names, outs):
            dt = np_of.get(t.dtype, np.float32)
            result[name] = t.float().cpu().numpy().astype(dt, copy=False)
        return result
