"""Calls of a fused graph (kv_layout in_place) at export time: one sequence, its cache bound once.

The export's own small runner, for what it measures before the engine dir exists (the runtime's
``InPlaceRunner`` is the runtime's: export may not import it): the verify cost curve recorded in the
manifest (export/latency.py) and the activation statistics of export/smooth.py.

Example::

    call = FusedCall(OrtEngine(path), max_len=2048)
    logits = call.run(ids, past=0)["logits"]            # [1, Q, V]: a prefill of ids [Q] at positions 0..Q-1
"""
from __future__ import annotations

import numpy as np

from ..contract import chain_inputs


class FusedCall:
    """One slot of a fused graph: its head-major cache buffers, bound once as past and present."""

    def __init__(self, engine, max_len: int):
        from ..engines.ort import Binding

        self.engine, self.max_len = engine, max_len
        self.binding = Binding(engine)
        for meta in engine.session.get_inputs():
            if meta.name.startswith("past_"):
                _, kv_heads, _, head_dim = meta.shape
                buf = np.zeros((1, kv_heads, max_len, head_dim), np.float32)
                self.binding.cache(meta.name, meta.name.replace("past_", "present_"), buf)
        self.widths = {o.name: o.shape[-1] for o in engine.session.get_outputs() if not o.name.startswith("present_")}

    def run(self, ids, past: int, outputs=("logits",), logit_rows: int | None = None) -> dict:
        """``ids`` [Q] after ``past`` cached entries (stale or not: timing does not care), causal;
        returns the named outputs [1, Q, width] (views the next call overwrites); ``logit_rows``: the
        positions the graph's logits hold, if not Q (a prefill graph's: 1)."""
        q = len(ids)
        if past + q > self.max_len:
            raise ValueError(f"{past} + {q} tokens exceed the cache ({self.max_len})")
        self.binding.inputs(**chain_inputs(ids, past))
        rows = {"logits": logit_rows or q}
        out = {name: self.binding.output(name, (1, rows.get(name, q), self.widths[name])) for name in outputs}
        self.binding.run()
        return out


def graph_max_len(proto) -> int:
    """The KV capacity a fused graph was built for: the rows of its rotary cache."""
    return next(int(i.dims[0]) for i in proto.graph.initializer if i.name == "cos_cache")
