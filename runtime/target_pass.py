"""The decode core's target pass: its inputs for a batch of rows (``pack``), and its timing (``time_pass``)."""
from __future__ import annotations

import time

import numpy as np


def time_pass(runner, batch: int, q: int, past: int, reps: int) -> float:
    """The fastest of ``reps`` calls (after a warm-up) of [batch, q] tokens after ``past`` stale entries."""
    slots, ids = np.arange(batch), np.zeros((batch, q), np.int64)
    for slot in slots:
        runner.set_length(slot, past)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        runner.forward(slots, ids, record=False)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


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
