"""Reference computations for the tests: a target's logits recomputed from scratch on a new cache."""
from __future__ import annotations

import numpy as np

from specrt.runtime.runner import HostRunner


def fresh_runner(graph, max_len: int = 64, max_batch: int = 1) -> HostRunner:
    """A new batch-1 runner (empty cache) over a ``Runtime`` graph (``rt.target`` / ``rt.draft``)."""
    return HostRunner.for_graph(graph.engine, graph.spec, max_len, max_batch)


def fresh_logits(graph, seq, max_len: int = 64) -> np.ndarray:
    """The graph's next-token logits [V] after ``seq``, from scratch."""
    return fresh_runner(graph, max_len).prefill(0, seq)[0]


def tree_logits(runner: HostRunner, prefix, tokens, tree) -> np.ndarray:
    """Prefill ``prefix`` into slot 0 of an empty ``runner``, then ONE pass over ``tokens`` [N] laid on
    ``tree`` (node 0 = root); returns logits [N, V] (nothing of the tree is committed)."""
    runner.release(0)
    runner.prefill(0, prefix)
    return runner.forward([0], [tokens], blocks=[tree.mask], depths=[tree.depths]).logits[0]
