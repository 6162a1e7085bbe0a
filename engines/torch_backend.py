"""`torch` backend: the export wrapper itself (``specrt.export.wrapper.DecoderWrapper``) over the
HF weights that `specrt export --torch-weights` copies into the engine dir, on CPU or CUDA.

Two ways to use it:

* ``TorchEngine`` implements the Engine protocol (numpy in, numpy out), so
  ``specrt.load(engine_dir, backend="torch", device="cpu"|"cuda")`` runs the unchanged runtime
  on it. The runtime owns a host KV cache, so on CUDA every call uploads the past: correct, eager,
  and no CUDA graphs (the past length changes every call).
* ``load_device_runtime(engine_dir, device="cuda")`` builds the same ``Runtime`` over
  ``cuda_graphs.DeviceModel``s: the KV cache lives in device memory, inputs and outputs are
  static buffers, and one CUDA graph per fixed shape (query length x past bucket) is captured
  and replayed. Each call still returns the logits to the host, because the runtime's
  acceptance decision reads them (one synchronisation per model call);
  ``cuda_graphs.greedy_speculative_device`` decides acceptance on the device instead and
  synchronises once per round.

torch and transformers are imported lazily: ``specrt.engines`` stays importable without them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .base import EngineError
from .manifest import io_names, load_manifest

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
        from ..export.wrapper import DecoderWrapper

        entry = entry or {}
        self.device = resolve_device(device)
        self.dtype = compute_dtype(dtype, entry)
        self.model = load_model(Path(weights_dir), self.device, self.dtype)
        with_hidden = bool(entry.get("has_hidden", False)) if with_hidden is None else with_hidden
        self.wrapper = DecoderWrapper(self.model, with_hidden=with_hidden)
        self.with_hidden = with_hidden
        self.num_layers = self.wrapper.num_layers

    @classmethod
    def from_model(cls, model, with_hidden: bool = False) -> "TorchCore":
        """A core over an already loaded HF model (benchmarks of random-weight models)."""
        from ..export.wrapper import DecoderWrapper

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
        self.input_names, self.output_names = io_names(self.core.num_layers, self.core.with_hidden)
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


# ---- the device-resident runtime -------------------------------------------------------------


def load_device_runtime(engine_dir, device: str = "cuda", dtype: str | None = None, cuda_graphs: bool | None = None,
                        backend: str = "torch", buckets=None, pad: bool | None = None, tree_sizes=(), **core_options):
    """``specrt.runtime.Runtime`` over an engine dir with every KV cache in device memory.

    backend: "torch" (HF weights of the engine dir), "trt" (TensorRT plans written by
    ``specrt export --trt``) or "ort" (ONNX Runtime CUDA EP with IO binding; its own CUDA graphs
    with ``cuda_graph=True``). cuda_graphs (torch/trt): capture one CUDA graph per (query length,
    past bucket) and replay it; default: on for CUDA. buckets: past capacities (default: powers of
    two up to max_len). pad: run a query of Q tokens in the smallest captured shape >= Q (exact:
    padded tokens come after the real ones, so causal masking hides them). tree_sizes: extra
    query lengths to capture (tree verify). Fixed shapes: 1..gamma+1 (decode, every chain verify
    and draft catch-up) and the prefill chunk.
    """
    from tokenizers import Tokenizer

    from ..runtime.model import CachedModel
    from ..runtime.runtime import Runtime
    from .cuda_graphs import DeviceEngine, DeviceKVCache, DeviceModel, default_buckets

    m = load_manifest(engine_dir)
    dev = resolve_device(device)
    graphs = (dev.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
    if graphs and dev.type != "cuda":
        raise EngineError("cuda_graphs=True needs device='cuda'")
    models = {}
    for role, spec in m.graphs.items():
        shapes = sorted({*range(1, m.gamma + 2), *map(int, spec.shapes.values()), *map(int, tree_sizes)})
        torch_graphs = graphs
        if backend == "torch":
            weights, entry = find_weights(m.root / spec.file)
            core = TorchCore(weights, dev, dtype, entry=entry)
            cache_dtype = core.dtype
        elif backend == "trt":
            from .trt_backend import TrtCore, plan_path

            core = TrtCore(plan_path(m.root, role), dev, context_per_shape=graphs, **core_options)
            cache_dtype = core.io_dtype
        elif backend == "ort":
            from .cuda_graphs import OrtCudaCore

            core = OrtCudaCore(m.root / spec.file, spec, dev, **core_options)
            cache_dtype = core.io_dtype
            torch_graphs = False  # ORT captures its own graphs (cuda_graph=True), per gpu_graph_id
        else:
            raise EngineError(f"unknown device backend {backend!r}; available: torch, trt, ort")
        fixed = graphs or (backend == "ort" and core_options.get("cuda_graph", False))
        dm = DeviceModel(core, spec.geometry, m.max_len, device=dev, dtype=cache_dtype, q_shapes=shapes,
                         buckets=buckets if buckets is not None else (default_buckets(m.max_len) if fixed else None),
                         cuda_graphs=torch_graphs, pad=fixed if pad is None else pad, has_hidden=spec.has_hidden)
        model = CachedModel(DeviceEngine(dm, spec), spec, m.max_len)
        model.cache = DeviceKVCache(dm)  # the host cache CachedModel made is dropped: K/V stay on the device
        models[role] = model
    tok = Tokenizer.from_file(str(m.tokenizer_dir / "tokenizer.json"))
    extra = {}
    if getattr(m, "medusa", None) is not None:  # the small heads graph has no torch weights: ONNX Runtime, CPU
        from .ort import OrtEngine

        extra["medusa"] = OrtEngine(m.root / m.medusa.file)
    return Runtime(m, models["target"], models.get("draft"), tok, **extra)
