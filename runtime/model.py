"""One graph and its KV cache: feed tokens at the next positions, get their logits."""
from __future__ import annotations

import statistics
import time
from collections import deque

import numpy as np

from ..engines.manifest import GraphSpec
from .kv_cache import KVCache

MASK_MIN = -65504.0  # additive mask value for masked positions (matches export/wrapper.py)
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}


class CachedModel:
    """An ``Engine`` plus the runtime-owned cache of one sequence (batch 1).

    ``latency[q]`` is the median measured seconds of the last 16 calls with q new tokens (a
    median, so one slow call on a busy machine does not swing the adaptive-γ controller).
    """

    def __init__(self, engine, spec: GraphSpec, max_len: int):
        g = spec.geometry
        self.engine = engine
        self.spec = spec
        self.dtype = NP_DTYPES[spec.dtype]
        self.cache = KVCache(g.num_layers, g.num_kv_heads, g.head_dim, max_len, dtype=self.dtype)
        self.prefill_chunk = int(spec.shapes.get("prefill", 128))
        self.latency: dict[int, float] = {}  # q -> median seconds of recent calls
        self._recent: dict[int, deque] = {}  # q -> last 16 call times
        self.calls = 0
        self.engine_seconds = 0.0

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, ids, tree_mask: np.ndarray | None = None, depths: np.ndarray | None = None) -> np.ndarray:
        """Run ``ids`` [Q] after the cached tokens; returns logits float32 [Q, V].

        Chain by default; with ``tree_mask`` (bool [Q, Q], node attends to ancestors and itself)
        and ``depths`` [Q] the Q tokens form a tree whose positions are past_len + depth.
        """
        ids = np.asarray(ids, dtype=np.int64)
        q, past = len(ids), self.cache.length
        mask = np.zeros((1, 1, q, past + q), dtype=self.dtype)  # [1, 1, Q, P+Q]
        if q > 1 or tree_mask is not None:
            block = tree_mask if tree_mask is not None else np.tri(q, dtype=bool)  # [Q, Q] attend
            mask[0, 0, :, past:] = np.where(block, 0, MASK_MIN)
        offsets = depths if depths is not None else np.arange(q)
        feeds = {"input_ids": ids[None], "position_ids": (past + np.asarray(offsets, dtype=np.int64))[None],
                 "attention_mask": mask, **self.cache.feeds()}
        t0 = time.perf_counter()
        out = self.engine.run(feeds)
        dt = time.perf_counter() - t0
        self.engine_seconds += dt
        self.calls += 1
        recent = self._recent.setdefault(q, deque(maxlen=16))
        recent.append(dt)
        self.latency[q] = statistics.median(recent)
        self.cache.append(out)
        self.last_outputs = out
        return out["logits"][0]

    def prefill(self, ids) -> np.ndarray:
        """Feed a prompt in chunks of the exported prefill shape; returns the last position's logits [V]."""
        ids = list(ids)
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            logits = self.forward(ids[i : i + self.prefill_chunk])
        return logits[-1]

    def clear_latency(self) -> None:
        self.latency.clear()
        self._recent.clear()

    def prefill_calls(self, n_tokens: int) -> int:
        return -(-n_tokens // self.prefill_chunk)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def reset(self) -> None:
        self.cache.reset()
