"""Sliding-window attention in exported graphs: what the manifest records, and the fused graph's window masks.

Every graph applies each layer's window itself, from ``position_ids``: the runtime feeds the full
(causal / tree / batch) mask whatever the model, at any ``--max-len``. The traced graph gets its windows
from ``engines.wrapper.DecoderWrapper.layer_masks`` (torch, HF's per-layer-type masks); the fused graph
from ``window_masks`` here (ONNX ops). Both apply ``contract.window_hides``: key k is visible to query q
iff pos_k > pos_q - window.

The manifest records them per layer as ``windows`` (docs/engine-format.md): informational, a runtime
does nothing with it. Engine dirs exported before per-layer windows carry a uniform ``sliding_window``
instead, which the runtimes apply to the mask on the host (``contract.apply_sliding_window``, libspecrt).
"""
from __future__ import annotations

import numpy as np

from ..contract import MASK_MIN
from ..engines.wrapper import attention_windows


def layer_windows(config, max_len: int) -> list | None:
    """The manifest's ``windows``: per decoder layer the window that can hide a key within ``max_len``
    positions (None: full attention, or a window >= max_len, which never does), or None when no layer
    has one. E.g. Gemma 2 with 4 layers and sliding_window 8 at max_len 48 -> [8, None, 8, None]; at
    max_len 8 -> None; Llama -> None."""
    windows = [w if w is not None and w < max_len else None for w in attention_windows(config)]
    return windows if any(w is not None for w in windows) else None


def window_masks(g, windows) -> dict:
    """ONNX nodes (added to the fused graph builder ``g``) that make, per distinct window, the graph input
    ``attention_mask`` [B, 1, Q, T] with every key of that window or more positions before its query
    masked; returns {window: mask name, None: "attention_mask"} for the layers to take as attention bias.

    In the fused graph mask column t of row b is the row's cache entry t: an old entry (t < L_b, the row's
    length L_b = seqlens_k[b] + 1 - Q) holds position t, a new one (t = L_b + i) holds position_ids[b, i]
    (a tree node's position is L_b + its depth). Example, window 2, L = 3, one new token at position 3:
    columns hold positions [0, 1, 2, 3] and the mask row [0, 0, 0, 0] becomes [m, m, 0, 0].
    """
    names = {None: "attention_mask"}
    todo = sorted({w for w in windows if w is not None})
    if not todo:
        return names
    key_pos = _key_positions(g)  # [B, 1, T]
    ax2 = _const(g, "win.ax2", np.array([2], np.int64))
    masked = _const(g, "win.masked", np.array(MASK_MIN, np.float32))
    for w in todo:
        limit = g.node("Sub", ["position_ids", _const(g, f"win{w}.w", np.array(w, np.int64))], [f"win{w}.limit"])
        limit = g.node("Unsqueeze", [limit, ax2], [f"win{w}.limit3"])  # [B, Q, 1] the oldest hidden position
        hide = g.node("LessOrEqual", [key_pos, limit], [f"win{w}.hide3"])  # [B, Q, T]: contract.window_hides
        hide = g.node("Unsqueeze", [hide, "win.ax1"], [f"win{w}.hide"])
        names[w] = g.node("Where", [hide, masked, "attention_mask"], [f"attention_mask.window{w}"])
    return names


def _key_positions(g) -> str:
    """int64 [B, 1, T]: the position each mask column holds (see ``window_masks``); also makes the constants
    "win.zero", "win.one" and "win.ax1" ([1]) that ``window_masks`` reuses."""
    def i64(name, value):
        return _const(g, name, np.array(value, np.int64))

    total = g.node("Gather", [g.node("Shape", ["attention_mask"], ["win.mshape"]), i64("win.i3", 3)], ["win.T"])
    q = g.node("Gather", [g.node("Shape", ["position_ids"], ["win.pshape"]), i64("win.i1", 1)], ["win.Q"])
    cols = g.node("Range", [i64("win.zero", 0), total, i64("win.one", 1)], ["win.cols"])  # [T]
    lengths = g.node("Sub", [g.node("Add", [g.node("Cast", ["seqlens_k"], ["win.seqlens"], to=7), "win.one"],
                                    ["win.seqlens1"]), q], ["win.L"])  # [B] the rows' lengths before this call
    rel = g.node("Sub", [cols, g.node("Unsqueeze", [lengths, i64("win.ax1", [1])], ["win.L2"])], ["win.rel"])  # [B, T]
    idx = g.node("Min", [g.node("Max", [rel, "win.zero"], ["win.rel0"]), g.node("Sub", [q, "win.one"], ["win.qm1"])],
                 ["win.idx"])
    new_pos = g.node("GatherElements", ["position_ids", idx], ["win.newpos"], axis=1)  # [B, T]
    is_new = g.node("GreaterOrEqual", [rel, "win.zero"], ["win.isnew"])
    key_pos = g.node("Where", [is_new, new_pos, cols], ["win.keypos2"])
    return g.node("Unsqueeze", [key_pos, "win.ax1"], ["win.keypos"])


def _const(g, name: str, value: np.ndarray) -> str:
    """A Constant node of ``value`` (any dtype; the builder's initializers are fp32 weights)."""
    from onnx import numpy_helper

    return g.node("Constant", [], [name], value=numpy_helper.from_array(value, name))
