"""The draft-model proposer: a smaller model run autoregressively, batched over the rows."""
from __future__ import annotations

import time

import numpy as np

from ..prefix_cache import shared_prefix
from ..sampling import probs, process_logits, sample
from . import EMPTY, Proposal


class DraftProposer:
    """Chains from a draft model with its own cache (a ``HostRunner`` of ``max_batch`` slots).

    A ``Proposer`` (runtime/proposers/__init__.py) whose ``runner`` the core keeps slot for slot
    with the target's. A row's draft cache holds a prefix of its sequence. ``propose`` first feeds every row's
    tokens the draft has not seen (after a round: the accepted tail, the recovered or bonus
    token, and the last proposal when all were accepted) in ONE call, then one call per draft
    step for the rows that still need tokens. q comes from the same ``process_logits`` and ``probs()``
    as the target's p (penalties, logit_bias, min_tokens and the grammar's mask after the same
    prefix x_1..x_{i-1}: a sampled token is always one the grammar allows), and each row samples
    from its own generator, so a row's proposals do not depend on the rest of the batch. Worked example, γ = 3, two rows with k = (3, 1):

        call 1  [2, U]  each row's unseen tokens (padded)  -> x1 for both rows
        call 2  [1, 1]  row 0 feeds x1                     -> x2 for row 0
        call 3  [1, 1]  row 0 feeds x2                     -> x3 for row 0
    """

    name = "draft"
    tree, depth, feature, tree_name, passes_name = False, 0, None, None, "draft_passes"
    shadow = False  # its proposals cost draft passes: probe steps measure α

    def __init__(self, runner, max_gamma: int):
        self.runner = runner  # the draft graph's runner: its cache, slot for slot with the target's
        self.max_nodes = max_gamma
        self.seen: dict[str, list] = {}  # request id -> tokens in its draft cache slot, in order
        self.step_seconds = None  # EWMA seconds per proposed token (feed + sample)
        self.passes = 0  # draft graph calls made by propose

    def start(self, row, hidden) -> None:
        prompt = row.seq[:-1]
        kept = int(self.runner.lengths[row.slot])  # a cached prefix the core left in the slot (0: none)
        self.runner.prefill(row.slot, prompt[kept:])
        self.seen[row.request.request_id] = list(prompt)

    def cached(self, row) -> int:
        """Leading tokens of ``row.seq`` whose entries the draft's slot holds (runtime/prefix_cache.py)."""
        return shared_prefix(self.seen.get(row.request.request_id, ()), row.seq)

    def _unseen(self, row) -> list[int]:
        """Roll the row's draft cache back to its longest common prefix with row.seq; returns the rest."""
        seen, seq = self.seen[row.request.request_id], row.seq
        n = min(shared_prefix(seen, seq), len(seq) - 1)  # the draft must run on at least the last token to get its logits
        self.runner.rollback(row.slot, n)
        del seen[n:]
        return seq[n:]

    def propose(self, rows, ks) -> list[Proposal]:
        active = [b for b, k in enumerate(ks) if k > 0]
        if not active:
            return [EMPTY] * len(rows)
        t0 = time.perf_counter()
        slots = np.array([rows[b].slot for b in active], dtype=np.int64)
        unseen = [self._unseen(rows[b]) for b in active]
        lens = np.array([len(u) for u in unseen])
        ids = np.zeros((len(active), lens.max()), dtype=np.int64)  # [A, U] unseen tokens, padded
        for i, u in enumerate(unseen):
            ids[i, : len(u)] = u
        logits = self._feed(slots, ids, [np.arange(n) for n in lens])[np.arange(len(active)), lens - 1]  # [A, V]
        seen = [self.seen[rows[b].request.request_id] for b in active]  # per active row
        for s, u in zip(seen, unseen):
            s.extend(u)
        tokens = [[] for _ in active]  # per active row
        qs = [[] for _ in active]
        for i in range(max(ks)):
            for j, b in enumerate(active):
                if i < ks[b]:
                    row, params = rows[b], rows[b].params
                    x = process_logits(logits[j][None], row, [tokens[j]])  # the target's rule, at the same prefix
                    if params.greedy:
                        tokens[j].append(int(np.argmax(x[0])))
                    else:
                        q = probs(x, params)[0]  # [V]
                        tokens[j].append(int(sample(q[None], rows[b].rng)[0]))
                        qs[j].append(q)
            feed = [j for j, b in enumerate(active) if i < ks[b] - 1]  # rows that need another token
            if not feed:
                break
            step = self._feed(slots[feed], np.array([[tokens[j][-1]] for j in feed]))  # [F, 1, V]
            for f, j in enumerate(feed):
                logits[j] = step[f, 0]
                seen[j].append(tokens[j][-1])
        dt = (time.perf_counter() - t0) / max(ks)
        self.step_seconds = dt if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * dt
        out = [EMPTY] * len(rows)
        for j, b in enumerate(active):
            out[b] = Proposal(np.array(tokens[j], np.int64), np.stack(qs[j]) if qs[j] else None)
        return out

    def _feed(self, slots, ids, keep=None) -> np.ndarray:
        p = self.runner.forward(slots, ids)
        self.runner.commit(p, keep)
        self.passes += 1
        return p.logits

    def observe(self, row, new, hidden) -> None:
        pass

    def finish(self, row) -> None:
        self.seen.pop(row.request.request_id, None)
