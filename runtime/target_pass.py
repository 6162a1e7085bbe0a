"""The decode core's target pass: its inputs for a batch of rows (``pack``), and its timing (``time_passes``)."""
from __future__ import annotations

import time

import numpy as np


def time_passes(runner, shapes: list[tuple[int, int]], past: int, reps: int) -> dict[tuple[int, int], float]:
    """(batch, q) -> the fastest of ``reps`` calls (after a warm-up) of [batch, q] tokens after ``past`` stale
    entries, the shapes' calls interleaved: a burst of other load slows one call of several shapes, not every
    call of one (calibrated one shape at a time, a server started beside another priced some 1.5-2x)."""
    for slot in range(max((b for b, _ in shapes), default=0)):
        runner.set_length(slot, past)
    feeds = {(b, q): (np.arange(b), np.zeros((b, q), np.int64)) for b, q in shapes}  # made once, outside the timing
    times = {shape: [] for shape in shapes}
    for i in range(reps + 1):
        for shape, (slots, ids) in feeds.items():
            t0 = time.perf_counter()
            runner.forward(slots, ids, record=False)
            if i:
                times[shape].append(time.perf_counter() - t0)
    return {shape: min(t) for shape, t in times.items()}


def pack(rows: list, proposals: list):
    """The target pass's inputs for the core's rows and their ``Proposal``s: (slots [B], ids [B, Q], blocks, depths)
    for ``HostRunner.forward``."""
    if len(rows) == 1 and proposals[0].tree is None:  # one chain: no padding
        return [rows[0].slot], [[rows[0].seq[-1], *proposals[0].tokens.tolist()]]
    q = max(p.positions for p in proposals)
    ids = np.zeros((len(rows), q), dtype=np.int64)  # [B, Q]: last token, proposal, padding (id 0)
    for b, (row, p) in enumerate(zip(rows, proposals)):
        ids[b, 0] = row.seq[-1]
        ids[b, 1 : p.positions] = p.tokens
    slots = np.array([row.slot for row in rows], dtype=np.int64)
    if all(p.tree is None for p in proposals):
        return slots, ids
    blocks = [p.tree.mask if p.tree is not None else None for p in proposals]
    depths = [p.tree.depths if p.tree is not None else None for p in proposals]
    return slots, ids, blocks, depths
