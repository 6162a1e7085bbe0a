"""A ``HostRunner`` owns one graph's engine and the KV cache of ``max_batch`` sequences (slots).

The cache is time-major, ``data`` [2 * layers, max_len, slots, Hkv, D], with ``lengths`` [slots]:
entries ``[0, lengths[s])`` of slot s are valid, everything after is stale and always masked.
A call runs rows (slots) of different lengths together: the past fed to the graph is
``data[:, :P, slots]`` with P = the longest selected row (a view when the slots are consecutive),
row r's columns >= lengths[r] are masked, and its new tokens sit at positions lengths[r] + depth.

``forward`` returns a ``Pass`` and writes nothing; ``commit(pass, keep)`` writes the kept new
positions of each row after its valid entries: a chain keeps its first n + 1 positions
(rollback is that and nothing else), a tree keeps the root and the accepted path (compaction
costs no copy inside the cache). Any ``Engine`` works (ort, torch): named numpy arrays in and out.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..contract import apply_sliding_window, batch_mask, chain_mask, new_names, past_names


class CacheFullError(RuntimeError):
    pass


def cache_zeros(shape: tuple, dtype=np.float32) -> np.ndarray:
    """A KV cache ``shape`` of zeros, its memory mapped now (preallocated, as llama.cpp's is), in pages
    advised for transparent huge pages where the OS has them. Left to map on first write, each slot's
    first request paid for it: on this project's VMs 0.25-0.45 s per 90 MB in 4 KB pages (SmolLM2-135M,
    2,048 entries per slot: a slot's first prompt 0.4-0.6 s instead of 0.05 s; a fresh server's first 16
    prompts ~4 s). Committing costs the same once, at load (1.4 GB for 16 such slots: 2.6-3.4 s).

        >>> cache_zeros((2, 3)).sum(), cache_zeros((2, 3)).flags.writeable
        (np.float32(0.0), True)
    """
    n = int(np.prod(shape))
    if not hasattr(mmap, "MAP_ANONYMOUS") or n == 0:
        data = np.empty(shape, dtype)
    else:
        buffer = mmap.mmap(-1, n * np.dtype(dtype).itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buffer.madvise(mmap.MADV_HUGEPAGE)
        data = np.frombuffer(buffer, dtype, count=n).reshape(shape)  # the array keeps the mapping alive
    data.fill(0)  # maps every page now
    return data


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next call instead of handing it back to the OS: blocks up to
    32 MB come from the heap (not a fresh mapping each), and up to 1 GB of free heap stays mapped. Process-wide, once
    (the runners call it); False where the C library is not glibc.

    Left to its defaults, glibc maps every block above a moving threshold afresh and trims the heap's free top, so
    a verify pass's logits and ONNX Runtime's buffers (megabytes at 16 rows) were page-faulted in again call after
    call, at ~5-10 µs a fault on this project's VMs: SmolLM2 int4, 150 passes of 16 rows x 1-5
    positions, 12,000 faults -> 280 and 1.7-2.7% less time (docs/runtime.md, "Host memory").
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


@functools.cache
def copy_thread() -> ThreadPoolExecutor:
    """One thread beside the caller for large cache copies between engine calls (``Runner.swap``), made once."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrt-copy")


@dataclass
class Pass:
    """One graph call over some rows, not yet committed to the cache."""

    slots: np.ndarray  # int64 [R] the cache slot of each row
    logits: np.ndarray  # float32 [R, Q, V]; a packed pass: [1, N, V]
    outputs: dict  # every graph output by name: new K/V [Q, R, Hkv, D], "hidden" [R, Q, H] where exported
    lengths: np.ndarray | None = None  # int64 [R] each row's length at forward time (InPlaceRunner's commit)
    offsets: np.ndarray | None = None  # int64 [R + 1] a packed pass's rows: row r = positions offsets[r]:offsets[r + 1]

    def row(self, r: int, name: str = "logits") -> np.ndarray:
        """Row r's positions of output ``name``: [Q, width] (a packed pass: [counts[r], width], no padding)."""
        out = self.outputs[name] if name != "logits" else self.logits
        return out[r] if self.offsets is None else out[0, self.offsets[r] : self.offsets[r + 1]]

    @property
    def positions(self) -> int:
        """Positions the pass computed: R·Q, or a packed pass's N."""
        return self.logits.shape[0] * self.logits.shape[1]


class Runner:
    """What every runner shares: prefill in the exported chunks (subclasses: forward, commit, lengths)."""

    prefill_chunk = 128  # tokens per prefill call (the graph's exported prefill shape)
    prefill_graph = None  # a graph of its own that prompts run through (export/prefill_graph.py); None: ``forward``'s
    packs = False  # whether ``forward(..., counts=)`` runs chains without their padding (one call of sum(counts))
    _swap_buffer = None  # ``swap``'s scratch: two planes (a layer's K or V) of a slot's entries (allocated on the first swap)

    def prefill(self, slot: int, ids, feature: str = "hidden") -> tuple[np.ndarray, np.ndarray | None]:
        """Feed a prompt into ``slot`` in chunks of the exported prefill shape.

        Returns (logits [V] of the last position, the graph output ``feature`` ("hidden" [P, H],
        "aux_hidden" [P, 3H]) of every position, or None where the graph has no such output).
        """
        ids = list(ids)
        last, hidden = None, []
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i : i + self.prefill_chunk]
            p = self.prefill_pass(slot, chunk)
            self.commit(p, [np.arange(len(chunk))])  # every position (a prefill graph's logits hold the last only)
            last = p.logits[0, -1]
            if feature in p.outputs:
                hidden.append(p.outputs[feature][0])
        return last, (np.concatenate(hidden) if hidden else None)

    def prefill_pass(self, slot: int, ids: list) -> "Pass":
        """One prompt chunk ``ids`` after ``slot``'s entries, not committed; its logits [1, Q or 1, V] end with
        the last position's (a runner with a prefill graph of its own runs it there: the last only)."""
        return self.forward([slot], [ids], record=False)

    def prefill_calls(self, n_tokens: int) -> int:
        return -(-n_tokens // self.prefill_chunk)

    def _timed(self, call, rows: int, positions: int, record: bool, *args):
        """``call(*args)`` over ``rows`` rows and ``positions`` positions in all, counted in ``engine_seconds`` /
        ``calls`` and, if ``record``, reported to ``on_call``."""
        t0 = time.perf_counter()
        out = call(*args)
        dt = time.perf_counter() - t0
        self.engine_seconds += dt
        self.calls += 1
        if record and self.on_call is not None:
            self.on_call(rows, positions, dt)
        return out

    def positions(self, lengths: np.ndarray, q: int, depths=None) -> np.ndarray:
        """int64 [R, Q] positions of a call's new tokens: a batch-1 chain's lengths + 0..Q-1; else
        lengths + depth (trees) or + index, clipped to the cache (padding positions may run past it;
        their outputs are never used)."""
        r = len(lengths)
        if r == 1 and depths is None:
            return np.arange(lengths[0], lengths[0] + q, dtype=np.int64)[None]
        offsets = np.broadcast_to(np.arange(q), (r, q)).copy()  # [R, Q]
        for b, d in enumerate(depths or ()):
            if d is not None:
                offsets[b, : len(d)] = d
        return np.minimum(lengths[:, None] + offsets, self.max_len - 1).astype(np.int64)

    def room(self, slot: int) -> int:
        """Free cache entries of ``slot``."""
        return self.max_len - int(self.lengths[slot])

    # ---- slots (``lengths`` [slots]: valid entries per slot; what is past them is stale) ---------------
    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` entries of ``slot``."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll back slot {slot} to {length}: it holds {self.lengths[slot]}")
        self.lengths[slot] = length

    def set_length(self, slot: int, length: int) -> None:
        """Treat the first ``length`` entries of ``slot`` as valid (calibration on stale entries)."""
        self.lengths[slot] = length

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s valid entries into slot ``dst`` and free ``src``."""
        self.copy(src, dst)
        self.release(src)

    def swap(self, a: int, b: int, n_a: int, n_b: int) -> None:
        """Exchange slots ``a`` and ``b``: ``a``'s first ``n_a`` entries go to ``b`` and ``b``'s first ``n_b`` to
        ``a``, and their lengths (runtime/prefix_cache.py: a leaving row's cache goes to the free end instead of
        being overwritten; only what is worth keeping of it is copied). Needs ``entries``. Plane by plane (a layer's
        K or V), so ``b``'s saved plane is still in cache when it is written to ``a``: 6.9 -> 3.9 ms a swap of
        300 and 400 entries on SmolLM2, against whole slots through the buffer; half the planes on a second thread
        (the engine's threads idle between calls, numpy's copies release the GIL): 3.2 -> 2.2 ms a swap in 16-row
        batches of code-edit chats (SmolLM2 int4, ~490 entries a swap, 53-57 swaps)."""
        if a != b and (n_a or n_b):
            a_from, b_from = self.entries(a, n_a), self.entries(b, n_b)  # [planes, ...] each
            a_to, b_to = self.entries(b, n_a), self.entries(a, n_b)
            buffers = self._swap_space(b_from[0])  # every plane has one shape

            def swap_planes(planes: range, kept: np.ndarray) -> None:
                for plane in planes:
                    np.copyto(kept, b_from[plane])
                    a_to[plane] = a_from[plane]
                    b_to[plane] = kept

            half = len(a_from) // 2
            helper = copy_thread().submit(swap_planes, range(half, len(a_from)), buffers[1])
            swap_planes(range(half), buffers[0])
            helper.result()
        self.lengths[[a, b]] = self.lengths[[b, a]]

    def _swap_space(self, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Two buffers shaped like ``like`` (a plane of a slot's entries; one for each thread), a whole slot's plane
        each, allocated once: a fresh array per swap cost its first-touch page faults (SmolLM2, 500 entries: 22-50 ms
        a swap instead of 9-10 ms)."""
        if self._swap_buffer is None or self._swap_buffer[0].size < like.size or self._swap_buffer[0].dtype != like.dtype:
            size = self.entries(0, self.max_len)[0].size
            self._swap_buffer = (np.empty(size, like.dtype), np.empty(size, like.dtype))
        return tuple(buffer[: like.size].reshape(like.shape) for buffer in self._swap_buffer)

    def copy_entries(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` entries of slot ``src`` into slot ``dst``, whatever the lengths say (a free
        slot that keeps a cache has length 0); lengths unchanged. Needs ``entries``."""
        if src != dst and n:
            self.entries(dst, n)[...] = self.entries(src, n)


class HostRunner(Runner):
    """One graph and its batched cache in host memory.

    ``on_call(rows, positions, seconds)`` (optional) receives the time of every recorded call: the
    policy's T(B, n) costs (``PassCost``). ``engine_seconds`` / ``calls`` add up every call.
    """

    def __init__(self, engine, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 max_batch: int = 1, dtype=np.float32, prefill_chunk: int = 128,
                 on_call: Callable[[int, int, float], None] | None = None, sliding_window: int | None = None):
        self.engine = engine
        self.dtype = dtype
        self.max_len = max_len
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        keep_freed_memory()
        self.data = cache_zeros((2 * num_layers, max_len, max_batch, num_kv_heads, head_dim), dtype)
        self.lengths = np.zeros(max_batch, dtype=np.int64)  # [slots] valid entries per slot
        self.past_names, self.new_names = past_names(num_layers), new_names(num_layers)
        self.on_call = on_call
        # an engine dir's uniform `sliding_window` (exported before per-layer windows, which graphs apply
        # themselves): keys this many positions before a query are masked here (None: none)
        self.sliding_window = sliding_window
        self.engine_seconds = 0.0
        self.calls = 0

    # ---- running ----------------------------------------------------------------------------
    def forward(self, slots, ids, blocks=None, depths=None, record: bool = True, counts=None) -> Pass:
        """Run ``ids`` [R, Q] after each slot's valid entries. Writes nothing (see ``commit``).

        blocks: per row a bool [n_r, n_r] attend block over its new tokens (a tree), or None (chain);
        depths: per row int [n_r] (a tree's depths; positions are lengths + depth) or None;
        counts: per row its own tokens (the rest padding); here every row runs all Q (``packs`` False).
        """
        slots = np.asarray(slots, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        r, q = ids.shape
        lengths = self.lengths[slots]  # [R]
        if r == 1 and blocks is None:  # the batch-1 chain: the fast path
            mask = chain_mask(int(lengths[0]), q, self.dtype)
        else:
            mask = batch_mask(lengths, q, blocks, None, self.dtype)  # [R, 1, Q, P+Q]
        return self.run(slots, ids, self.positions(lengths, q, depths), mask, record=record)

    def run(self, slots: np.ndarray, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
            feeds: dict | None = None, record: bool = True) -> Pass:
        """One graph call: ids / positions int64 [R, Q] over the first P entries of the slots, where
        mask [R, 1, Q, P+Q] says what each new token sees (the sliding window applied here); feeds:
        extra graph inputs (the EAGLE head's "hidden")."""
        r, q = ids.shape
        if self.sliding_window is not None and int(positions.max()) >= self.sliding_window:
            mask = apply_sliding_window(mask, positions, self.sliding_window)
        feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask,
                 **(feeds or {}), **self._past(slots, mask.shape[-1] - q)}
        out = self._timed(lambda: self.engine.run(feeds), r, r * q, record)
        return Pass(slots, out["logits"], out)

    def _past(self, slots: np.ndarray, past: int) -> dict[str, np.ndarray]:
        """The first ``past`` entries of the selected slots: name -> [past, R, Hkv, D] (a view if consecutive)."""
        s0, s1 = int(slots[0]), int(slots[-1]) + 1
        if s1 - s0 == len(slots) and (len(slots) == 1 or np.array_equal(slots, np.arange(s0, s1))):
            return {name: self.data[j, :past, s0:s1] for j, name in enumerate(self.past_names)}
        return {name: self.data[j, :past][:, slots] for j, name in enumerate(self.past_names)}

    def commit(self, p: Pass, keep=None) -> None:
        """Append row r's new positions ``keep[r]`` (int indices into Q, ascending; None: all Q) to its slot."""
        q, out = p.logits.shape[1], p.outputs  # new K/V: out[name] [Q, R, Hkv, D]
        if len(p.slots) == 1:  # one row: slices where the kept positions are a prefix
            s = int(p.slots[0])
            k = np.arange(q) if keep is None else np.asarray(keep[0], dtype=np.int64)
            n, start = len(k), int(self.lengths[s])
            if start + n > self.max_len:
                raise CacheFullError(f"KV cache full: {start} + {n} tokens > max_len {self.max_len}")
            k = slice(0, n) if n == 0 or k[-1] == n - 1 else k
            for j, name in enumerate(self.new_names):
                self.data[j, start : start + n, s] = out[name][k, 0]
            self.lengths[s] = start + n
            return
        keeps = [np.arange(q)] * len(p.slots) if keep is None else [np.asarray(k, dtype=np.int64) for k in keep]
        start = self.lengths[p.slots]  # [R]
        counts = np.array([len(k) for k in keeps], dtype=np.int64)
        if np.any(start + counts > self.max_len):
            raise CacheFullError(f"KV cache full: lengths {start.tolist()} + {counts.tolist()} > max_len {self.max_len}")
        r_idx = np.repeat(np.arange(len(keeps)), counts)  # [K] which row each kept entry is from
        q_idx = np.concatenate(keeps)  # [K] its index among the row's new positions
        t_idx = start[r_idx] + np.concatenate([np.arange(n) for n in counts])  # [K] destination time
        s_idx = p.slots[r_idx]  # [K] destination slot
        for j, name in enumerate(self.new_names):
            self.data[j, t_idx, s_idx] = out[name][q_idx, r_idx]
        self.lengths[p.slots] = start + counts

    # ---- slots --------------------------------------------------------------------------------
    def copy(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s valid entries into slot ``dst`` (a fork: n sequences of one prompt)."""
        n = int(self.lengths[src])
        self.data[:, :n, dst] = self.data[:, :n, src]
        self.lengths[dst] = n

    def entries(self, slot: int, n: int) -> np.ndarray:
        """A view of the first ``n`` entries of ``slot``: [2 * layers, n, Hkv, D]."""
        return self.data[:, :n, slot]

