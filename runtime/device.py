"""The device runner: the decode core over a ``DeviceModel`` (engines/cuda_graphs.py), whose KV cache
lives in device memory and whose fixed shapes replay captured CUDA graphs.

``load_device_runtime(engine_dir, device="cuda")`` returns a ``Runtime`` whose target and draft run
through ``DeviceRunner``s: the same core, proposers, verifier and stops as the host path; only the
cache and the graph calls differ. A ``DeviceModel`` holds one sequence, so a device runner has one
slot (``specrt serve`` on a device: ``--max-batch 1``; batched serving on a GPU goes through the host
runner with ``--backend torch --device cuda``). Heads (Medusa, EAGLE) run in ONNX Runtime on CPU.
"""
from __future__ import annotations

import numpy as np

from ..contract import NP_DTYPES
from ..engines import EngineError
from ..engines.manifest import load_manifest
from .runner import CacheFullError, Pass, Runner


class DeviceRunner(Runner):
    """The runner interface (runtime/runner.py) over one ``DeviceModel``: a single slot."""

    def __init__(self, dm, spec, max_batch: int = 1, on_call=None):
        if max_batch != 1:
            raise EngineError(f"the device runner holds one sequence (max_batch 1), got max_batch {max_batch}: "
                              f"serve a device runtime with --max-batch 1")
        self.dm = dm
        self.spec = spec
        self.max_batch = 1
        self.max_len = dm.max_len
        self.prefill_chunk = int(spec.shapes.get("prefill", 128))
        self.has_hidden = spec.has_hidden
        self.np_dtype = NP_DTYPES[spec.dtype]
        self.on_call = on_call
        self.engine_seconds = 0.0
        self.calls = 0

    @property
    def lengths(self) -> np.ndarray:
        return np.array([self.dm.length], dtype=np.int64)

    def forward(self, slots, ids, blocks=None, depths=None, record: bool = True, counts=None) -> Pass:
        """As ``HostRunner.forward`` for one row; the new K/V stay in the device cache until ``commit``."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.shape[0] != 1:
            raise EngineError("the device runner runs one chain or tree row of a target or draft graph")
        q = ids.shape[1]
        block = None if blocks is None else blocks[0]
        depth = None if depths is None else depths[0]

        def run() -> dict:
            logits = self.dm.forward(ids, block, depth, advance=False)
            out = {"logits": logits.float().cpu().numpy()}
            if self.has_hidden:
                out["hidden"] = self.dm.last_hidden(q).float().cpu().numpy().astype(self.np_dtype)
            return out

        out = self._timed(run, 1, q, record)
        return Pass(np.zeros(1, np.int64), out["logits"], out)

    def commit(self, p: Pass, keep=None) -> None:
        """Keep the pass's positions ``keep[0]`` (None: all): a prefix advances the length, a tree path is
        compacted on the device."""
        q = p.logits.shape[1]
        k = np.arange(q) if keep is None else np.asarray(keep[0], dtype=np.int64)
        start = self.dm.length
        if start + len(k) > self.max_len:
            raise CacheFullError(f"KV cache full: {start} + {len(k)} tokens > max_len {self.max_len}")
        if len(k) and k[-1] != len(k) - 1:  # not a prefix: a tree path
            self.dm.advance(q)
            self.dm.compact(start, start + k)
        else:
            self.dm.advance(len(k))

    def rollback(self, slot: int, length: int) -> None:
        self.dm.rollback(length)

    def set_length(self, slot: int, length: int) -> None:
        """Treat the first ``length`` cache entries as valid (calibration on stale entries)."""
        self.dm.rollback(length) if length <= self.dm.length else self.dm.advance(length - self.dm.length)

    def copy(self, src: int, dst: int) -> None:
        raise EngineError("the device runner has one slot: nothing to copy (n > 1 needs the host runner)")

    def move(self, src: int, dst: int) -> None:
        raise EngineError("the device runner has one slot: nothing to move")

    def release(self, slot: int) -> None:
        self.dm.reset()


def load_device_runtime(engine_dir, device: str = "cuda", dtype: str | None = None, cuda_graphs: bool | None = None,
                        backend: str = "torch", buckets=None, pad: bool | None = None, tree_sizes=(), **core_options):
    """A ``Runtime`` over an engine dir with the target's and draft's KV caches in device memory.

    backend: "torch" (HF weights of the engine dir), "trt" (TensorRT plans written by
    ``specrt export --trt``) or "ort" (ONNX Runtime CUDA EP with IO binding; its own CUDA graphs
    with ``cuda_graph=True``). cuda_graphs (torch/trt): capture one CUDA graph per (query length,
    past bucket) and replay it; default: on for CUDA. buckets: past capacities (default: powers of
    two up to max_len). pad: run a query of Q tokens in the smallest captured shape >= Q (exact:
    padded tokens come after the real ones, so causal masking hides them). tree_sizes: extra
    query lengths to capture (tree verify). Fixed shapes: 1..gamma+1 (decode, every chain verify
    and draft catch-up), the prefill chunk and the manifest's tree-verify shape.
    """
    from tokenizers import Tokenizer

    from ..engines.cuda_graphs import DeviceModel, default_buckets
    from ..engines.ort import OrtEngine
    from ..engines.torch_backend import TorchCore, find_weights, resolve_device
    from .api import Graph, Runtime

    m = load_manifest(engine_dir)
    dev = resolve_device(device)
    graphs = (dev.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
    if graphs and dev.type != "cuda":
        raise EngineError("cuda_graphs=True needs device='cuda'")
    models = {}
    for role, spec in m.graphs.items():
        shapes = sorted({*range(1, m.gamma + 2), *map(int, spec.shapes.values()), *map(int, tree_sizes)})
        torch_graphs = graphs
        if spec.sliding_window is not None:
            raise EngineError(f"{spec.file}: sliding-window attention (window {spec.sliding_window}) runs on the host "
                              "runners only (specrt.load), not yet in the device runtime")
        if backend != "torch" and spec.kv_layout == "in_place":
            raise EngineError(f"{spec.file} is a fused graph (kv_layout in_place: ONNX Runtime CPU); for the "
                              f"{backend} device backend re-export with `specrt export --graph traced`")
        if backend == "torch":
            weights, entry = find_weights(m.root / spec.file)
            core = TorchCore(weights, dev, dtype, entry=entry)
            cache_dtype = core.dtype
        elif backend == "trt":
            from ..engines.trt_backend import TrtCore, plan_path

            core = TrtCore(plan_path(m.root, role), dev, context_per_shape=graphs, **core_options)
            cache_dtype = core.io_dtype
        elif backend == "ort":
            from ..engines.cuda_graphs import OrtCudaCore

            core = OrtCudaCore(m.root / spec.file, spec, dev, **core_options)
            cache_dtype = core.io_dtype
            torch_graphs = False  # ORT captures its own graphs (cuda_graph=True), per gpu_graph_id
        else:
            raise EngineError(f"unknown device backend {backend!r}; available: torch, trt, ort")
        fixed = graphs or (backend == "ort" and core_options.get("cuda_graph", False))
        dm = DeviceModel(core, spec.geometry, m.max_len, device=dev, dtype=cache_dtype, q_shapes=shapes,
                         buckets=buckets if buckets is not None else (default_buckets(m.max_len) if fixed else None),
                         cuda_graphs=torch_graphs, pad=fixed if pad is None else pad, has_hidden=spec.has_hidden)
        models[role] = Graph(dm, spec)
    tok = Tokenizer.from_file(str(m.tokenizer_dir / "tokenizer.json"))
    heads = {name: OrtEngine(m.root / getattr(m, name).file) for name in ("medusa", "eagle") if getattr(m, name)}
    if m.eagle and m.eagle.fc_file:
        heads["eagle_fc"] = OrtEngine(m.root / m.eagle.fc_file)
    return Runtime(m, models["target"], models.get("draft"), tok,
                   runner_factory=lambda graph, max_batch, on_call: DeviceRunner(graph.engine, graph.spec, max_batch,
                                                                                 on_call), **heads)
