"""The graph contract shared by export/, engines/ and runtime/: names, dtypes, the mask constant and
the one builder of attention masks and positions (see docs/engine-format.md).

Every decoder graph takes ``input_ids`` [B, Q], ``position_ids`` [B, Q], an additive
``attention_mask`` [B, 1, Q, P+Q] (0 = attend, MASK_MIN = masked; the full causal / tree / batch mask:
a model's sliding windows are applied by the graph itself, by ``window_hides``) and the past K/V and
returns ``logits`` [B, Q, V] and, for graphs exported with hidden states, ``hidden`` [B, Q, H]
(the last hidden state, after the final norm) and/or ``aux_hidden`` [B, Q, k·H] (the hidden states
entering the k decoder layers listed in the manifest's ``aux_hidden_layers``, concatenated in that
order: EAGLE-3's fused features).
Two KV layouts (a graph's ``kv_layout`` in the manifest):

- ``time_major`` (traced graphs): past ``past_{key,value}.i`` [P, B, Hkv, D] in, only the new K/V
  ``new_{key,value}.i`` [Q, B, Hkv, D] out; the runtime appends them to its cache.
- ``in_place`` (fused graphs): ``past_{key,value}.i`` and ``present_{key,value}.i`` are the SAME
  head-major buffer [B, Hkv, max_len, D]; two more inputs, ``seqlens_k`` int32 [B] (= row length + Q - 1)
  and ``total_sequence_length`` int32 [] (= the mask's last dim), and the graph writes row b's Q new
  entries at [length_b, length_b + Q). Mask column t of row b is the row's cache entry t.
Nothing here imports the rest of specrt.
"""
from __future__ import annotations

import functools

import numpy as np

MASK_MIN = -65504.0  # additive value for masked positions: float16's most negative finite value, so the
# same mask works in fp16 and fp32 graphs (exp(-65504) is 0 in both)
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}  # manifest dtype -> numpy dtype
KV_LAYOUTS = ("time_major", "in_place")  # a graph's kv_layout (see the module docstring)


def past_names(num_layers: int) -> list[str]:
    """Graph inputs of the past K/V, in cache-plane order (layer-major, key before value)."""
    return [f"past_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]


def new_names(num_layers: int) -> list[str]:
    """Graph outputs of the new K/V, in the same order as ``past_names``."""
    return [f"new_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    """Outputs of an in-place graph's K/V buffers, in the same order as ``past_names``."""
    return [f"present_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]


def io_names(num_layers: int, has_hidden: bool, kv_layout: str = "time_major",
             has_aux: bool = False) -> tuple[list[str], list[str]]:
    """Graph input and output names of a decoder with ``num_layers`` layers."""
    features = (["hidden"] if has_hidden else []) + (["aux_hidden"] if has_aux else [])
    if kv_layout == "in_place":
        inputs = ["input_ids", "position_ids", "attention_mask", "seqlens_k", "total_sequence_length",
                  *past_names(num_layers)]
        return inputs, ["logits", *present_names(num_layers), *features]
    inputs = ["input_ids", "position_ids", "attention_mask", *past_names(num_layers)]
    return inputs, ["logits", *new_names(num_layers), *features]


def batch_mask(lengths: np.ndarray, q: int, blocks=None, past_visible: np.ndarray | None = None,
               dtype=np.float32) -> np.ndarray:
    """The additive attention mask of one batched call: float [R, 1, Q, P+Q] with P = max(lengths).

    lengths: int [R] valid past entries per row (columns >= lengths[r] of the past are stale: masked).
    blocks: per row a bool [n_r, n_r] block over the row's new tokens (node i attends to node j;
    a tree's ancestor mask), or None for a causal chain; rows shorter than Q are padded, and a
    padding position attends to itself only (its outputs are never read).
    past_visible: bool [R, Q, P] overrides the past columns (e.g. a draft tree over earlier draft rows).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    r, past = len(lengths), int(lengths.max()) if len(lengths) else 0
    mask = np.zeros((r, 1, q, past + q), dtype=dtype)  # 0 = attend; filled only where masked
    if past_visible is not None:
        mask[:, 0, :, :past] = np.where(past_visible, 0, MASK_MIN)
    else:
        for b in np.flatnonzero(lengths < past):  # a shorter row's stale columns
            mask[b, 0, :, lengths[b] : past] = MASK_MIN
    causal = np.where(np.tri(q, dtype=bool), 0, MASK_MIN)  # [Q, Q]
    if blocks is None:
        mask[:, 0, :, past:] = causal
        return mask
    for b, block in enumerate(blocks):
        if block is None:
            mask[b, 0, :, past:] = causal
            continue
        n = len(block)
        new = np.full((q, q), MASK_MIN, dtype=dtype)
        new[:n, :n] = np.where(block, 0, MASK_MIN)
        new[np.arange(n, q), np.arange(n, q)] = 0  # padding attends to itself only
        mask[b, 0, :, past:] = new
    return mask


def in_place_mask(lengths: np.ndarray, q: int, blocks=None, dtype=np.float32) -> np.ndarray:
    """The additive mask of one call on an ``in_place`` cache: float [R, 1, Q, T], T = max(lengths) + Q, where
    column t of row r is that row's cache entry t: its entries [0, L_r) visible, its new tokens at [L_r, L_r + Q)
    under ``batch_mask``'s block for the row (causal chain, tree block, padding attends to itself), the rest masked.

    Example (m = MASK_MIN): lengths [2, 0], Q = 2 -> row 0 [[0, 0, 0, m], [0, 0, 0, 0]], row 1 [[0, m, m, m],
    [0, 0, m, m]].
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    r = len(lengths)
    new = batch_mask(np.zeros(r, np.int64), q, blocks, dtype=dtype)[:, 0]  # [R, Q, Q] the rows' own blocks
    cols = np.arange(int(lengths.max()) + q)
    mask = np.where(cols < lengths[:, None], 0, MASK_MIN).astype(dtype)[:, None, None].repeat(q, axis=2)
    rows, queries = np.arange(r)[:, None, None], np.arange(q)[None, :, None]
    mask[rows, 0, queries, (lengths[:, None] + np.arange(q))[:, None, :]] = new
    return mask


def chain_mask(past: int, q: int, dtype=np.float32, out: np.ndarray | None = None) -> np.ndarray:
    """The mask of one unbatched causal call after ``past`` tokens: float [1, 1, Q, P+Q] (the fast path).

    out: a flat buffer of at least Q * (P+Q) elements of ``dtype`` to write it into (the result is a
    contiguous view of it); None: a new array."""
    if out is None:
        mask = np.zeros((1, 1, q, past + q), dtype=dtype)
    else:
        mask = out[: q * (past + q)].reshape(1, 1, q, past + q)
        mask[0, 0, :, :past] = 0
    mask[0, 0, :, past:] = _causal(q, np.dtype(dtype).str)
    return mask


def chain_inputs(ids, past: int) -> dict:
    """The per-call inputs of a fused graph (kv_layout in_place) for one row: ``ids`` [Q] after ``past``
    cached entries, causal. GroupQueryAttention's ``seqlens_k`` is the row's length after the call - 1.

        >>> {k: v.tolist() for k, v in chain_inputs([5, 6], past=1).items() if k != "attention_mask"}
        {'input_ids': [[5, 6]], 'position_ids': [[1, 2]], 'seqlens_k': [2], 'total_sequence_length': 3}
    """
    q = len(ids)
    total = past + q
    return {"input_ids": np.asarray(ids, np.int64).reshape(1, q),
            "position_ids": np.arange(past, total, dtype=np.int64)[None], "attention_mask": chain_mask(past, q),
            "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array(total, np.int32)}


@functools.lru_cache(maxsize=64)
def _causal(q: int, dtype: str) -> np.ndarray:
    """[Q, Q] 0 on and below the diagonal, MASK_MIN above (read-only: shared by every caller)."""
    block = np.where(np.tri(q, dtype=bool), 0, MASK_MIN).astype(dtype)
    block.flags.writeable = False
    return block


def window_hides(key_pos, query_pos, window: int):
    """HF's sliding-window rule, the one copy in Python (numpy arrays and torch tensors alike): key k is
    visible to query q iff pos_k > pos_q - window. Returns bool [..., Q, K], True where the key is hidden.

    key_pos [..., K] and query_pos [..., Q] are positions (same leading dims). Example, window 3, a
    query at position 5 over keys at 0..5: ``window_hides(np.arange(6), np.array([5]), 3)`` ->
    ``[[True, True, True, False, False, False]]`` (it sees itself and the 2 keys before it).
    """
    return key_pos[..., None, :] <= query_pos[..., :, None] - window


def apply_sliding_window(mask: np.ndarray, positions: np.ndarray, window: int) -> np.ndarray:
    """Mask, in place, every key ``window`` or more positions before its query (``window_hides``) in a
    time-major call's mask [R, 1, Q, P+Q]: what a runtime does for an engine dir of a uniform
    ``sliding_window`` (graphs exported since per-layer windows apply their windows themselves).

    positions: int [R, Q] of the new tokens; past column t of every row holds position t (a row's
    cache holds its positions 0..length-1 in order, also after a tree commit).
    """
    r, _, q, total = mask.shape
    key_pos = np.empty((r, total), dtype=np.int64)  # [R, P+Q]
    key_pos[:, : total - q] = np.arange(total - q)
    key_pos[:, total - q :] = positions
    mask[:, 0][window_hides(key_pos, positions, window)] = MASK_MIN
    return mask
