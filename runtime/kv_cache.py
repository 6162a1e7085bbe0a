"""A preallocated KV cache owned by the runtime, written by position (rollback is free)."""
from __future__ import annotations

import numpy as np


class CacheFullError(RuntimeError):
    pass


class KVCache:
    """Per layer K and V, time-major: ``data`` [2 * layers, max_len, batch, kv_heads, head_dim].

    Entries [0, length) are valid. The past fed to a graph is the contiguous prefix view
    ``data[j, :length]``: no copy per step. ``rollback`` only moves ``length``;
    ``compact`` gathers kept tree positions into contiguous slots.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, batch: int = 1,
                 dtype=np.float32):
        self.data = np.zeros((2 * num_layers, max_len, batch, num_kv_heads, head_dim), dtype=dtype)
        self.max_len = max_len
        self.length = 0
        self.past_names = [f"past_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]
        self.new_names = [f"new_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]

    @property
    def room(self) -> int:
        """Free slots left."""
        return self.max_len - self.length

    def feeds(self) -> dict[str, np.ndarray]:
        """The valid past as graph inputs: name -> [length, B, Hkv, D] views."""
        return {name: self.data[j, : self.length] for j, name in enumerate(self.past_names)}

    def append(self, outputs: dict[str, np.ndarray]) -> None:
        """Write a graph's ``new_key.i``/``new_value.i`` [Q, B, Hkv, D] after the valid entries."""
        q = outputs[self.new_names[0]].shape[0]
        if self.length + q > self.max_len:
            raise CacheFullError(f"KV cache full: {self.length} + {q} tokens > max_len {self.max_len}")
        for j, name in enumerate(self.new_names):
            self.data[j, self.length : self.length + q] = outputs[name]
        self.length += q

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` entries."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length

    def compact(self, start: int, keep: np.ndarray) -> None:
        """Keep entries [0, start) and then the entries at absolute positions ``keep`` (ascending),
        moved into contiguous slots start, start+1, ...; everything else is dropped."""
        keep = np.asarray(keep, dtype=np.int64)
        if keep.size and (keep.min() < start or keep.max() >= self.length):
            raise ValueError(f"compact: positions {keep.tolist()} outside [{start}, {self.length})")
        self.data[:, start : start + keep.size] = self.data[:, keep]
        self.length = start + keep.size

    def reset(self) -> None:
        self.length = 0
