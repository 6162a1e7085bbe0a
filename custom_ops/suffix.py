"""Suffix decoding's index in native code (suffix_index.cpp through suffix_capi.cpp's C ABI, ctypes), with the
interface of the Python reference (runtime/proposers/suffix.py's ``SuffixIndex``) and the same proposals.

Why: the Python index counts each token after its 24 contexts in dicts keyed by tuples (~10 µs a token), merges a
finished request into the global cache context by context and uncounts evicted ones the same way: at 16 clients
on SmolLM2 that host work held suffix decoding at 0.96-0.99x of plain decoding. Here the contexts are 64-bit
hashes (a collision could only change a proposal, never what is emitted: verification is exact) in an
open-addressing table (suffix_index.h): ~10x less time to index a request and to merge it into the cache.

    index = NativeSuffixIndex(24)
    index.add([7, 1, 2, 3, 4], 0, 5)
    native_propose(NativeSuffixIndex(24), [index], [9, 1, 2], k=5, factor=1.0, min_prob=0.1)  # -> [3, 4]
"""
from __future__ import annotations

import ctypes
import functools
from array import array
from collections.abc import Sequence

from . import KernelError, suffix_library

_P = ctypes.c_void_p  # token arrays are passed as addresses (array('q') buffers: ~10x cheaper than numpy's ctypes)


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """libspecrt_suffix.so, built on first use; KernelError if it cannot be built or loaded."""
    try:
        lib = ctypes.CDLL(str(suffix_library()))
    except OSError as e:
        raise KernelError(f"suffix decoding's native index did not load: {e}") from None
    lib.specrt_suffix_new.restype = ctypes.c_void_p
    lib.specrt_suffix_new.argtypes = [ctypes.c_int]
    lib.specrt_suffix_free.argtypes = [ctypes.c_void_p]
    lib.specrt_suffix_add.argtypes = [ctypes.c_void_p, _P, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    lib.specrt_suffix_merge.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.specrt_suffix_contexts.restype = ctypes.c_size_t
    lib.specrt_suffix_contexts.argtypes = [ctypes.c_void_p]
    lib.specrt_suffix_longest.restype = ctypes.c_int
    lib.specrt_suffix_longest.argtypes = [ctypes.c_void_p, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t,
                                          ctypes.POINTER(ctypes.c_size_t)]
    lib.specrt_suffix_propose.restype = ctypes.c_size_t
    lib.specrt_suffix_propose.argtypes = [ctypes.c_void_p, _P, ctypes.c_size_t, _P, ctypes.c_size_t, ctypes.c_int,
                                          ctypes.c_double, ctypes.c_double, _P]
    return lib


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the native index builds and loads here (a C++17 compiler: g++ or $CXX); asked once per process
    (``library`` raising is not cached: a failed build would be tried again on every call)."""
    try:
        library()
        return True
    except KernelError:
        return False


def _tokens(seq: Sequence[int]) -> array:
    return array("q", seq)


def _ptr(a: array) -> int:
    return a.buffer_info()[0]


class NativeSuffixIndex:
    """For every context of 1..``depth`` tokens seen in the added sequences: how often each next token followed it
    (runtime/proposers/suffix.py's ``SuffixIndex``, in native code)."""

    def __init__(self, depth: int):
        self.depth = depth
        self._lib = library()
        self.handle = self._lib.specrt_suffix_new(depth)  # an address (int)

    def __del__(self):
        handle, self.handle = getattr(self, "handle", None), None
        if handle:
            self._lib.specrt_suffix_free(handle)

    def add(self, seq: Sequence[int], start: int, stop: int, sign: int = 1) -> None:
        """Count (sign -1: uncount) the next tokens seq[start:stop] after their contexts."""
        first = max(0, start - self.depth)  # the contexts reach back at most depth tokens
        window = _tokens(seq[first:stop])
        if len(window):
            self._lib.specrt_suffix_add(self.handle, _ptr(window), len(window), max(0, start - first), sign)

    def merge(self, other: "NativeSuffixIndex") -> None:
        """Count everything ``other`` (of the same depth) counted."""
        self._lib.specrt_suffix_merge(self.handle, other.handle)

    def __len__(self) -> int:
        """Contexts with counts."""
        return self._lib.specrt_suffix_contexts(self.handle)

    def longest(self, context: Sequence[int]) -> tuple[int, dict | None]:
        """(n, {next token: count}) for the longest suffix of ``context`` with counts; (0, None) if none."""
        ctx = _tokens(context[-self.depth:] if self.depth else ())
        cap = 1 << 12
        tokens, counts, size = array("q", bytes(8 * cap)), array("i", bytes(4 * cap)), ctypes.c_size_t()
        n = self._lib.specrt_suffix_longest(self.handle, _ptr(ctx), len(ctx), _ptr(tokens), _ptr(counts), cap,
                                            ctypes.byref(size))
        return (n, dict(zip(tokens[: size.value], counts[: size.value]))) if n else (0, None)


def native_propose(local: NativeSuffixIndex, others: Sequence[NativeSuffixIndex], context: Sequence[int], k: int,
                   factor: float, min_prob: float) -> list[int]:
    """runtime/proposers/suffix.py's ``propose`` over native indexes (the same walk, ties and stops)."""
    ctx, out = _tokens(context[-local.depth:]), array("q", bytes(8 * max(k, 1)))
    handles = array("Q", [o.handle for o in others] or [0])
    n = local._lib.specrt_suffix_propose(local.handle, _ptr(handles), len(others), _ptr(ctx), len(ctx), k, factor,
                                         min_prob, _ptr(out))
    return out[:n].tolist()
