"""Device-resident models: the KV cache in device memory, static buffers, one CUDA graph per shape.

``DeviceModel`` runs a *core* (any callable computing the graph contract of
docs/engine-format.md on torch tensors: ``TorchCore`` = the export wrapper, ``TrtCore`` = a
TensorRT plan, ``OrtCudaCore`` = ONNX Runtime's CUDA EP) over a cache it owns:

    cache   [2 * layers, max_len + max_q, B, Hkv, D]   time-major, like the runtime's host cache

A call with Q new tokens after P cached ones runs the fixed shape (qp, bucket): qp is the
smallest captured query length >= Q (the Q real tokens come first; padded tokens come after
them, so causal masking hides them from the real ones: the real rows compute exactly the
function of an unpadded call), bucket is the smallest past capacity >= P; the core sees the
past ``cache[:, :bucket]`` (a fixed address) and a mask hiding columns P..bucket. Everything
the host changes per call is a static buffer (ids, depths, tree block) or the device scalar
``past_len``; the mask, positions and the cache write ``cache[P:P+qp] = new K/V`` are computed
on the device inside the captured region, so one ``CUDAGraph.replay()`` runs the whole step.

Written against ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` as documented (warm-up on a side
stream, capture, replay). On CPU (or with ``cuda_graphs=False``) the same step runs eagerly on
the same static buffers, which is what the CPU tests check.

This module runs graphs and nothing else: the one decode loop over a ``DeviceModel`` is the
runtime's decode core, through ``runtime/device.py``'s ``DeviceRunner`` (``load_device_runtime``).
"""
from __future__ import annotations

import numpy as np

from ..contract import MASK_MIN, io_names
from .base import EngineError


def default_buckets(max_len: int, smallest: int = 64) -> list[int]:
    """Past capacities: powers of two from ``smallest`` below max_len, then max_len itself."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


class _Shape:
    """Static buffers (and the captured graph) of one (batch, qp, bucket) shape."""

    def __init__(self, torch, dev, dtype, batch, q, bucket, vocab, hidden_size, mask_min):
        self.q, self.bucket = q, bucket
        self.ids = torch.zeros(batch, q, dtype=torch.int64, device=dev)
        self.depth = torch.arange(q, dtype=torch.int64, device=dev)  # position offsets of the q tokens
        tri = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
        self.block = torch.zeros(q, q, dtype=dtype, device=dev).masked_fill(~tri, mask_min)  # additive [q, q]
        self.chain = True  # depth/block hold the plain causal chain of q tokens
        self.cols = torch.arange(bucket, dtype=torch.int64, device=dev)
        self.offs = torch.arange(q, dtype=torch.int64, device=dev)
        self.mask = torch.zeros(batch, 1, q, bucket + q, dtype=dtype, device=dev)
        self.pos = torch.zeros(batch, q, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(batch, q, vocab, dtype=torch.float32, device=dev)
        self.hidden = torch.zeros(batch, q, hidden_size, dtype=dtype, device=dev) if hidden_size else None
        self.graph = None


class DeviceModel:
    """A core plus its device-resident KV cache (see the module docstring).

    q_shapes: the fixed query lengths (decode 1, chain verify 2..γ+1, prefill chunk, tree sizes).
    buckets: past capacities, or None for the exact past length (eager only: no reuse).
    cuda_graphs: capture a CUDA graph per (q in q_shapes, bucket) on first use and replay it.
    pad: run Q in the smallest q_shape >= Q (needed for replay; default: = cuda_graphs).
    Query lengths above every q_shape (or with pad off) run eagerly at their exact length.
    """

    def __init__(self, core, geometry, max_len: int, *, device="cpu", dtype=None, batch: int = 1,
                 q_shapes=(1,), buckets=None, cuda_graphs: bool = False, pad: bool | None = None,
                 has_hidden: bool = False, warmup: int = 2):
        import torch

        self.torch = torch
        self.core = core
        self.geometry = g = geometry
        self.device = torch.device(device)
        self.dtype = dtype or torch.float32
        if cuda_graphs and self.device.type != "cuda":
            raise EngineError("cuda_graphs=True needs a CUDA device")
        if cuda_graphs and buckets is None:
            raise EngineError("cuda_graphs=True needs past buckets (fixed shapes)")
        self.batch = batch
        self.max_len = max_len
        self.q_shapes = sorted({int(q) for q in q_shapes if int(q) >= 1})
        self.buckets = sorted({min(int(b), max_len) for b in buckets}) if buckets is not None else None
        if self.buckets is not None and self.buckets[-1] < max_len:
            self.buckets.append(max_len)
        self.cuda_graphs = cuda_graphs
        self.pad = cuda_graphs if pad is None else pad
        self.has_hidden = has_hidden
        self.warmup = warmup
        self.mask_min = MASK_MIN
        self.num_kv = 2 * g.num_layers
        capacity = max_len + (max(self.q_shapes) if self.q_shapes else 0)  # room for padded tokens' K/V
        self.cache = torch.zeros(self.num_kv, capacity, batch, g.num_kv_heads, g.head_dim, dtype=self.dtype,
                                 device=self.device)
        self.past_len = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.length = 0
        self.shapes: dict = {}  # (qp, bucket) -> _Shape
        self.replays = 0  # graph replays so far
        self.eager_calls = 0  # calls run without a graph
        self._last = None  # the _Shape of the last call

    # ---- cache bookkeeping (the runtime's KVCache semantics) ------------------------------------
    @property
    def room(self) -> int:
        return self.max_len - self.length

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def compact(self, start: int, keep) -> None:
        """Keep [0, start) then the entries at absolute positions ``keep`` (ascending), moved to start, ..."""
        keep = np.asarray(keep, dtype=np.int64)
        if keep.size and (keep.min() < start or keep.max() >= self.length):
            raise ValueError(f"compact: positions {keep.tolist()} outside [{start}, {self.length})")
        if keep.size:
            idx = self.torch.from_numpy(keep).to(self.device)
            self.cache[:, start : start + keep.size] = self.cache.index_select(1, idx)
        self.length = start + int(keep.size)

    # ---- one step --------------------------------------------------------------------------------
    def _pick(self, q: int, past: int) -> tuple[int, int]:
        qp = q
        if q not in self.q_shapes and self.pad:
            bigger = [s for s in self.q_shapes if s >= q]
            qp = bigger[0] if bigger else q
        if self.buckets is None:
            return qp, past
        return qp, next(b for b in self.buckets if b >= past)

    def _shape(self, qp: int, bucket: int) -> _Shape:
        key = (qp, bucket)
        s = self.shapes.get(key)
        if s is None:
            g = self.geometry
            s = _Shape(self.torch, self.device, self.dtype, self.batch, qp, bucket, g.vocab_size,
                       g.hidden_size if self.has_hidden else 0, self.mask_min)
            if self.buckets is not None:  # bounded number of shapes: keep them
                self.shapes[key] = s
        return s

    def _body(self, s: _Shape) -> None:
        """The captured region: mask, positions, core, cache write, outputs: device ops only."""
        p = self.past_len
        past_cols = s.mask[:, 0, :, : s.bucket]  # [B, q, bucket]
        past_cols.copy_(self.torch.zeros_like(s.cols, dtype=self.dtype).masked_fill(s.cols >= p, self.mask_min))
        s.mask[:, 0, :, s.bucket :].copy_(s.block)
        s.pos.copy_(s.depth + p)
        outs = self.core(s.ids, s.pos, s.mask, *[self.cache[j, : s.bucket] for j in range(self.num_kv)])
        idx = s.offs + p
        for j in range(self.num_kv):
            self.cache[j].index_copy_(0, idx, outs[1 + j].to(self.dtype))
        s.logits.copy_(outs[0])
        if s.hidden is not None:
            s.hidden.copy_(outs[1 + self.num_kv])

    def _capture(self, s: _Shape) -> None:
        torch = self.torch
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up outside capture (lazy inits, cuBLAS workspaces, TRT shapes)
            for _ in range(self.warmup):
                self._body(s)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a private memory pool per graph
            self._body(s)
        s.graph = graph

    def _set_pattern(self, s: _Shape, q: int, tree_mask, depths) -> None:
        """Write depth/block for q real tokens (chain, or a tree) padded to s.q."""
        chain = tree_mask is None and depths is None
        if chain and q == s.q and s.chain:
            return
        qp = s.q
        depth = np.arange(qp, dtype=np.int64)
        attend = np.tri(qp, dtype=bool)  # padded rows: causal over everything before them
        if depths is not None:
            depth[:q] = np.asarray(depths, dtype=np.int64)
        if tree_mask is not None:
            attend[:q, :q] = np.asarray(tree_mask, dtype=bool)
        depth[q:] = depth[q - 1] if q else 0  # padded positions repeat the last real one (stay < max positions)
        torch = self.torch
        s.depth.copy_(torch.from_numpy(depth))
        block = torch.from_numpy(np.where(attend, 0.0, self.mask_min).astype(np.float32))
        s.block.copy_(block.to(self.dtype))
        s.chain = chain and q == qp

    def forward(self, ids, tree_mask=None, depths=None, advance: bool = True):
        """Run Q new tokens after the cached ones; returns device logits [B, Q, V] (float32).

        ids: [Q] or [B, Q], numpy/list (host) or a torch tensor (device: no host round trip).
        tree_mask: bool [Q, Q] (node attends to ancestors and itself); depths: [Q] position offsets.
        The returned tensor is a view of a static buffer: read it before the next call.
        """
        torch = self.torch
        if isinstance(ids, torch.Tensor):
            src = ids.reshape(-1, ids.shape[-1])
        else:
            src = torch.from_numpy(np.ascontiguousarray(np.asarray(ids, dtype=np.int64)).reshape(-1, np.shape(ids)[-1]))
        q, p = int(src.shape[-1]), self.length
        if q < 1:
            raise ValueError("forward needs at least one token")
        if p + q > self.max_len:
            raise EngineError(f"KV cache full: {p} + {q} tokens > max_len {self.max_len}")
        qp, bucket = self._pick(q, p)
        s = self._shape(qp, bucket)
        with torch.no_grad():
            s.ids[:, :q].copy_(src)
            self._set_pattern(s, q, tree_mask, depths)
            self.past_len.fill_(p)
            graph_ok = self.cuda_graphs and qp in self.q_shapes
            if graph_ok and s.graph is None:
                self._capture(s)
            if s.graph is not None:
                s.graph.replay()
                self.replays += 1
            else:
                self._body(s)
                self.eager_calls += 1
        self._last = s
        if advance:
            self.length = p + q
        return s.logits[:, :q]

    def last_hidden(self, q: int):
        """Device hidden states [B, q, H] of the last call (has_hidden models only)."""
        if self._last is None or self._last.hidden is None:
            raise EngineError("no hidden state: the model was built without has_hidden, or has not run")
        return self._last.hidden[:, :q]

    def advance(self, q: int) -> None:
        if self.length + q > self.max_len:
            raise EngineError(f"KV cache full: {self.length} + {q} tokens > max_len {self.max_len}")
        self.length += q

    def drop_shapes(self) -> None:
        """Free every static buffer and captured graph (memory comes back to torch's allocator)."""
        self.shapes.clear()


# ---- ONNX Runtime CUDA EP as a DeviceModel core ----------------------------------------------


class OrtCudaCore:
    """An ONNX graph in ONNX Runtime's CUDA EP, bound to torch device buffers with IO binding.

    cuda_graph=True turns on ORT's ``enable_cuda_graph``: ORT captures one graph per
    ``gpu_graph_id`` (one id per DeviceModel shape, whose buffers keep fixed addresses) and replays
    it. ORT runs on torch's current stream (``user_compute_stream``), so the DeviceModel's mask and
    cache-write kernels stay ordered with it. provider: "CUDAExecutionProvider" or
    "TensorrtExecutionProvider" (CUDA EP as fallback).
    """

    def __init__(self, path, spec, device, cuda_graph: bool = False, provider: str = "CUDAExecutionProvider",
                 provider_options: dict | None = None):
        import onnxruntime as ort
        import torch

        from .ort import gpu_providers

        self.ort, self.torch = ort, torch
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise EngineError("the ort device core needs a CUDA device")
        index = self.device.index or 0
        stream = str(torch.cuda.current_stream(self.device).cuda_stream)
        opts = {"device_id": str(index), "user_compute_stream": stream, **(provider_options or {})}
        if cuda_graph:
            opts["enable_cuda_graph"] = "1"
        providers = gpu_providers(provider, opts, index)
        try:
            self.session = ort.InferenceSession(str(path), providers=providers)
        except Exception as e:  # ORT raises its own types
            raise EngineError(f"ONNX Runtime cannot load {path} on CUDA: {str(e).splitlines()[0]}") from None
        self.cuda_graph = cuda_graph
        self.spec = spec
        g = spec.geometry
        self.io_dtype = {"fp32": torch.float32, "fp16": torch.float16}[spec.dtype]
        self.input_names, self.output_names = io_names(g.num_layers, spec.has_hidden)
        self.graph_ids: dict = {}  # input signature -> gpu_graph_id (>= 1; 0 is reserved, -1 = no graph)
        self.bound: dict = {}  # signature -> (io binding, output tensors, run options)
        self.index = index

    def _bind(self, sig, tensors):
        torch, ort = self.torch, self.ort
        g = self.spec.geometry
        b, q = tensors[0].shape
        shapes = {"logits": (b, q, g.vocab_size), "hidden": (b, q, g.hidden_size)}
        binding = self.session.io_binding()
        np_of = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}
        for name, t in zip(self.input_names, tensors):
            binding.bind_input(name, "cuda", self.index, np_of[t.dtype], tuple(t.shape), t.data_ptr())
        outs = []
        for name in self.output_names:
            shape = shapes.get(name, (q, b, g.num_kv_heads, g.head_dim))
            dtype = torch.float32 if name == "logits" else self.io_dtype
            t = torch.empty(shape, dtype=dtype, device=self.device)
            binding.bind_output(name, "cuda", self.index, np_of[dtype], shape, t.data_ptr())
            outs.append(t)
        ro = ort.RunOptions()
        ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if self.cuda_graph:
            ro.add_run_config_entry("gpu_graph_id", str(self.graph_ids.setdefault(sig, len(self.graph_ids) + 1)))
        self.bound[sig] = (binding, outs, ro, [t.data_ptr() for t in tensors])
        return self.bound[sig]

    def __call__(self, input_ids, position_ids, attention_mask, *past):
        tensors = [input_ids, position_ids, attention_mask, *past]
        sig = tuple(tuple(t.shape) for t in tensors[:3]) + (tuple(past[0].shape),)
        entry = self.bound.get(sig)
        if entry is None or entry[3] != [t.data_ptr() for t in tensors]:
            if entry is not None and self.cuda_graph:
                raise EngineError("ORT CUDA graph: a shape's buffers moved; the captured graph would read stale memory")
            entry = self._bind(sig, tensors)
            if not self.cuda_graph:  # without graphs nothing needs fixed addresses: keep no binding per shape
                del self.bound[sig]
        binding, outs, ro, _ = entry
        self.session.run_with_iobinding(binding, ro)
        return tuple(outs)
