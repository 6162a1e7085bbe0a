"""`torch` backend: the export wrapper itself (``specrt.engines.wrapper.DecoderWrapper``) over the
HF weights that `specrt export --torch-weights` copies into the engine dir, on CPU or CUDA.

Two ways to use it:

* ``TorchEngine`` implements the Engine protocol (numpy in, numpy out), so
  ``specrt.load(engine_dir, backend="torch", device="cpu"|"cuda")`` runs the unchanged runtime
  on it. The runtime owns a host KV cache, so on CUDA every call uploads the past: correct, eager,
  and no CUDA graphs (the past length changes every call).
* ``specrt.runtime.device.load_device_runtime(engine_dir, device="cuda")`` runs the decode core over
  ``cuda_graphs.DeviceModel``s (through ``DeviceRunner``s): the KV cache lives in device memory, inputs and outputs are
  static buffers, and one CUDA graph per fixed shape (query length x past bucket) is captured
  and replayed. Each call still returns the logits to the host, because the decode core's
  acceptance decision reads them (one synchronisation per model call).

torch and transformers are imported lazily: ``specrt.engines`` stays importable without them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .base import EngineError
from ..contract import io_names

TORCH_WEIGHTS_DIR = "torch"  # ENGINE_DIR/torch/<role>/: config.json + model.safetensors (HF layout)
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # compute dtype names -> torch


def find_weights(path) -> tuple[Path, dict]:
    """The HF weights dir for a graph and its manifest entry.

    ``path`` is what the runtime passes to ``open_engine``: ``ENGINE_DIR/<role>.onnx``; or a
    weights dir (config.json inside) directly, with an empty entry.
    """
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path, {}
    manifest = path.parent / "manifest.json"
    if not manifest.is_file():
        raise EngineError(f"torch backend: {path} is neither an HF weights dir nor a graph of an engine dir "
                          f"(no {manifest})")
    try:
        raw = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{manifest} is not valid JSON: {e}") from None
    for role, entry in (raw.get("models") or {}).items():
        if entry.get("file") == path.name:
            rel = entry.get("torch_weights")
            if not rel:
                raise EngineError(f"engine dir {path.parent} has no torch weights for its {role} graph: re-export "
                                  "with `specrt export --torch-weights` (the torch backend runs HF weights, not ONNX)")
            weights = path.parent / rel
            if not (weights / "config.json").is_file():
                raise EngineError(f"engine dir {path.parent}: torch weights {rel!r} of the {role} graph are missing "
                                  f"({weights / 'config.json'} not found)")
            return weights, entry
    raise EngineError(f"{path.name} is not a graph listed in {manifest}")


def is_decoder_graph(path) -> bool:
    """False only for a graph of an engine dir that is not one of its target/draft models (e.g. the
    Medusa heads): those have no torch weights and run in ONNX Runtime instead."""
    path = Path(path)
    manifest = path.parent / "manifest.json"
    if path.is_dir() or not manifest.is_file():
        return True
    try:
        models = json.loads(manifest.read_text()).get("models") or {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True  # let find_weights report the broken manifest
    return any(m.get("file") == path.name for m in models.values())


def resolve_device(device: str):
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} requested but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise EngineError(f"torch backend supports devices cpu and cuda, got {device!r}")
    return dev


def compute_dtype(dtype: str | None, entry: dict):
    """torch dtype to compute in: ``dtype`` (fp32|fp16|bf16) or the exported graph's dtype."""
    import torch

    name = dtype or entry.get("dtype") or "fp32"
    if name not in DTYPES:
        raise EngineError(f"torch backend dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return getattr(torch, DTYPES[name])


def load_model(weights_dir: Path, device, dtype):
    """The HF causal LM from a local dir (never the hub), in ``dtype`` on ``device``, eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise EngineError(f"torch backend cannot load weights from {weights_dir}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval()


class TorchCore:
    """``DecoderWrapper`` over loaded weights: the callable a ``DeviceModel`` runs (torch in, torch out)."""

    def __init__(self, weights_dir, device="cpu", dtype=None, with_hidden: bool | None = None, entry=None):
        from .wrapper import DecoderWrapper

        entry = entry or {}
        self.device = resolve_device(device)
        self.dtype = compute_dtype(dtype, entry)
        self.model = load_model(Path(weights_dir), self.device, self.dtype)
        with_hidden = bool(entry.get("has_hidden", False)) if with_hidden is None else with_hidden
        self.wrapper = DecoderWrapper(self.model, with_hidden=with_hidden, aux_layers=entry.get("aux_hidden_layers"))
        self.with_hidden = with_hidden
        self.num_layers = self.wrapper.num_layers

    @classmethod
    def from_model(cls, model, with_hidden: bool = False) -> "TorchCore":
        """A core over an already loaded HF model (benchmarks of random-weight models)."""
        from .wrapper import DecoderWrapper

        core = cls.__new__(cls)
        p = next(model.parameters())
        core.device, core.dtype, core.model = p.device, p.dtype, model.eval()
        core.wrapper = DecoderWrapper(core.model, with_hidden=with_hidden)
        core.with_hidden, core.num_layers = with_hidden, core.wrapper.num_layers
        return core

    def __call__(self, input_ids, position_ids, attention_mask, *past):
        return self.wrapper(input_ids, position_ids, attention_mask, *past)


class TorchEngine:
    """One graph's function in PyTorch, behind the Engine protocol (numpy in/out).

    path: ``ENGINE_DIR/<role>.onnx`` (weights found through the manifest's ``torch_weights``)
    or an HF weights dir. device: "cpu" | "cuda" | "cuda:N". dtype: compute dtype fp32 | fp16 |
    bf16 (default: the exported graph's); outputs keep the graph's I/O dtypes (logits float32,
    K/V the dtype of the past fed). threads: torch intra-op threads (process-wide).
    """

    def __init__(self, path, device: str = "cpu", dtype: str | None = None, threads: int | None = None,
                 cuda_graphs: bool = False, with_hidden: bool | None = None):
        import torch

        if cuda_graphs:
            raise EngineError("cuda_graphs needs a device-resident KV cache, which the numpy Engine protocol does not "
                              "have (the runtime feeds a host past of a new length every call): use "
                              "specrt.engines.torch_backend.load_device_runtime(engine_dir, device='cuda')")
        if threads:
            torch.set_num_threads(int(threads))
        weights, entry = find_weights(path)
        self.core = TorchCore(weights, device, dtype, with_hidden, entry)
        self.torch = torch
        self.device, self.dtype = self.core.device, self.core.dtype
        self.input_names, self.output_names = io_names(self.core.num_layers, self.core.with_hidden,
                                                       has_aux=self.core.wrapper.aux_layers is not None)
        self.path = Path(path)

    def _tensor(self, name: str, a: np.ndarray):
        a = np.ascontiguousarray(a)
        if not a.flags.writeable:
            a = a.copy()
        t = self.torch.from_numpy(a)
        if t.is_floating_point():
            return t.to(self.device, self.dtype)
        return t.to(self.device)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise EngineError(f"torch backend: missing inputs {missing[:4]}")
        torch = self.torch
        args = [self._tensor(n, feeds[n]) for n in self.input_names]
        past_np = feeds[self.input_names[3]].dtype if len(self.input_names) > 3 else np.dtype(np.float32)
        io_dtype = torch.from_numpy(np.zeros(0, past_np)).dtype
        with torch.no_grad():
            outs = self.core(*args)
        return {name: t.to(torch.float32 if name == "logits" else io_dtype).cpu().numpy()
                for name, t in zip(self.output_names, outs)}
