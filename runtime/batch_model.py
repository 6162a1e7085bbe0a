"""One graph and a batched, time-major KV cache whose rows (slots) hold sequences of different lengths.

The graphs accept any batch B and take the past as ``[P, B, Hkv, D]``. A batched cache
``[max_len, slots, Hkv, D]`` per layer can therefore hold one sequence per slot, each with its
own length: a call feeds ``cache[:P, rows]`` with P = the longest selected row, masks row b's
columns ``>= length_b`` (stale or never-written slots), gives row b positions ``length_b + i``,
and afterwards writes row b's new K/V at ``cache[length_b : length_b + keep_b, b]``.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..engines.manifest import GraphSpec
from .model import MASK_MIN, NP_DTYPES


class BatchedKVCache:
    """Per layer K and V: ``data`` [2 * layers, max_len, slots, kv_heads, head_dim]; ``lengths`` [slots].

    Entries ``[0, lengths[s])`` of slot s are valid; everything after is stale and always masked.
    Rollback of a slot only moves its length.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, slots: int,
                 dtype=np.float32):
        self.data = np.zeros((2 * num_layers, max_len, slots, num_kv_heads, head_dim), dtype=dtype)
        self.lengths = np.zeros(slots, dtype=np.int64)  # [slots] valid entries per slot
        self.max_len = max_len
        self.past_names = [f"past_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]
        self.new_names = [f"new_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]

    def feeds(self, rows: np.ndarray, past: int) -> dict[str, np.ndarray]:
        """The first ``past`` entries of the selected slots: name -> [past, R, Hkv, D].

        A run of consecutive slots is a view (no copy); other selections are gathered.
        """
        r0, r1 = int(rows[0]), int(rows[-1]) + 1
        if r1 - r0 == len(rows) and np.array_equal(rows, np.arange(r0, r1)):
            return {name: self.data[j, :past, r0:r1] for j, name in enumerate(self.past_names)}
        return {name: self.data[j, :past][:, rows] for j, name in enumerate(self.past_names)}

    def write(self, rows: np.ndarray, outputs: dict[str, np.ndarray], keep: np.ndarray) -> None:
        """Append the first ``keep[i]`` new positions of row i (``new_*`` [Q, R, Hkv, D]) to slot ``rows[i]``."""
        keep = np.asarray(keep, dtype=np.int64)
        start = self.lengths[rows]  # [R]
        if np.any(start + keep > self.max_len):
            raise ValueError(f"KV cache full: lengths {start.tolist()} + {keep.tolist()} > max_len {self.max_len}")
        row_idx = np.repeat(np.arange(len(rows)), keep)  # [K] which input row each kept entry is from
        q_idx = np.concatenate([np.arange(k) for k in keep]) if keep.size else np.zeros(0, np.int64)  # [K]
        t_idx = start[row_idx] + q_idx  # [K] destination time index
        s_idx = rows[row_idx]  # [K] destination slot
        for j, name in enumerate(self.new_names):
            self.data[j, t_idx, s_idx] = outputs[name][q_idx, row_idx]
        self.lengths[rows] = start + keep

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s valid entries into slot ``dst`` (compaction when a sequence leaves)."""
        n = int(self.lengths[src])
        self.data[:, :n, dst] = self.data[:, :n, src]
        self.lengths[dst] = n
        self.lengths[src] = 0


class BatchedModel:
    """An ``Engine`` and a ``BatchedKVCache``; one call runs several slots, each at its own length.

    ``on_call(positions, seconds)`` (optional) receives the measured time of every call that
    is not a prefill, keyed by positions = R * Q: the batch policy's T(Q·B) curve.
    """

    def __init__(self, engine, spec: GraphSpec, max_len: int, slots: int,
                 on_call: Callable[[int, int, float], None] | None = None):
        g = spec.geometry
        self.engine = engine
        self.spec = spec
        self.dtype = NP_DTYPES[spec.dtype]
        self.cache = BatchedKVCache(g.num_layers, g.num_kv_heads, g.head_dim, max_len, slots, dtype=self.dtype)
        self.prefill_chunk = int(spec.shapes.get("prefill", 128))
        self.on_call = on_call
        self.calls = 0

    @property
    def lengths(self) -> np.ndarray:
        return self.cache.lengths

    def run(self, rows: np.ndarray, ids: np.ndarray, record: bool = True) -> tuple[np.ndarray, dict]:
        """Run ``ids`` [R, Q] after each selected slot's valid entries, as a causal chain per row.

        Returns (logits float32 [R, Q, V], outputs with ``new_*`` [Q, R, Hkv, D]). Nothing is
        written to the cache: call ``write`` with how many positions of each row to keep.
        Padding tokens at the end of a row are harmless: earlier positions never attend to them.
        """
        rows = np.asarray(rows, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        r, q = ids.shape
        lengths = self.cache.lengths[rows]  # [R]
        past = int(lengths.max())
        mask = np.full((r, 1, q, past + q), MASK_MIN, dtype=self.dtype)  # [R, 1, Q, P+Q]
        mask[:, 0, :, :past] = np.where(np.arange(past)[None, None, :] < lengths[:, None, None], 0, MASK_MIN)
        mask[:, 0, :, past:] = np.where(np.tri(q, dtype=bool), 0, MASK_MIN)[None]
        # [R, Q]; padding positions may run past the cache: clip them (their outputs are never used)
        positions = np.minimum(lengths[:, None] + np.arange(q)[None, :], self.cache.max_len - 1)
        feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask,
                 **self.cache.feeds(rows, past)}
        t0 = time.perf_counter()
        out = self.engine.run(feeds)
        dt = time.perf_counter() - t0
        self.calls += 1
        if record and self.on_call is not None:
            self.on_call(r, q, dt)
        return out["logits"], out

    def write(self, rows, outputs: dict, keep) -> None:
        self.cache.write(np.asarray(rows, dtype=np.int64), outputs, keep)

    def step(self, rows, ids, keep=None, record: bool = True) -> np.ndarray:
        """``run`` then write ``keep`` [R] positions per row (default: all Q). Returns logits [R, Q, V]."""
        rows = np.asarray(rows, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        logits, out = self.run(rows, ids, record=record)
        self.write(rows, out, np.full(len(rows), ids.shape[1]) if keep is None else keep)
        return logits

    def prefill(self, slot: int, ids) -> np.ndarray:
        """Feed a prompt into one slot in chunks of the exported prefill shape; returns the last logits [V]."""
        ids = list(ids)
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            logits = self.step([slot], [ids[i : i + self.prefill_chunk]], record=False)
        return logits[0, -1]

    def prefill_calls(self, n_tokens: int) -> int:
        return -(-n_tokens // self.prefill_chunk)
