"""The prefix cache's host-memory tier: copies of kept slots' caches, for when every slot is busy.

``PrefixCache`` (runtime/prefix_cache.py) keeps finished sequences' K/V in free slots only, so a server
whose slots are all busy reuses nothing: a finished row's slot is claimed by the next queued prompt at
once. A ``PrefixStore`` keeps a COPY (numpy arrays it owns) of what such a slot held, the moment the
slot is about to be overwritten: the target's entries and the entries of the proposer cache that served
it (the draft model's, the EAGLE head's), with the tokens they cover. A later prompt starting with those
tokens gets them copied back into its slot and prefills only the rest, as from a kept slot.

Bounded by bytes (``budget_bytes``), least recently used first out. A prefix is stored once: an entry
whose tokens and entries another one covers is dropped (or not stored) in its favour.

    store = PrefixStore(2 << 20, [target, draft_runner])      # a 2 MB store over the caches, slot for slot
    store.save(kept, slot=3, counts=[kept.target, 0])          # copies the target's first kept.target entries
    item, c = store.search(prompt_ids)[0]                     # an entry and the tokens it shares with the prompt
    store.load(item, slot=0, counts=[c - 1, 0])               # writes c - 1 entries back into slot 0

Exact for the same reason as a kept slot: a stored entry is the K/V the target computed for the same
tokens at the same positions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(eq=False)
class Stored:
    """One stored prefix: what it holds (a ``Retained``: tokens, target entries, proposer and its count) and
    per runner the copy of its entries."""

    kept: object  # a prefix_cache.Retained; its tokens cut to what the entries cover
    ids: np.ndarray  # int64 [T] the same tokens (for the lookup)
    arrays: list  # per runner: a copy of ``runner.entries(slot, n)`` (None: nothing for that runner)
    nbytes: int


class PrefixStore:
    """Host copies of kept caches, keyed by their tokens, at most ``budget_bytes`` in all.

    ``runners``: the caches a slot spans (``PrefixCache.runners``: the target's first); ``counts`` arguments
    give per runner how many leading entries of the slot to copy. ``hits`` / ``hit_tokens``: the prompts that
    took a prefix from here and the prompt tokens they did not prefill (the prefix cache counts them too).
    """

    def __init__(self, budget_bytes: int, runners: list):
        self.budget = int(budget_bytes)
        self.runners = runners
        self.items: list[Stored] = []  # least recently used first
        self.nbytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self.items)

    def save(self, kept, slot: int, counts: list) -> bool:
        """Copy ``counts[i]`` leading entries of ``slot`` in each runner, the prefix ``kept`` describes; False:
        not stored (an entry already covers it, or it is larger than the budget). Entries it covers go."""
        n = max(kept.target, kept.proposer)
        if not n:
            return False
        kept = replace(kept, tokens=list(kept.tokens[:n]))
        ids = np.asarray(kept.tokens, dtype=np.int64)
        for item in self.items:
            if covers(item, kept, ids):
                self._touch(item)
                return False
        nbytes = sum(runner.entries(slot, k).nbytes for runner, k in zip(self.runners, counts) if k)
        if nbytes > self.budget:
            return False
        arrays = [np.array(runner.entries(slot, k)) if k else None for runner, k in zip(self.runners, counts)]
        item = Stored(kept, ids, arrays, nbytes)
        for old in [old for old in self.items if covers(item, old.kept, old.ids)]:
            self._drop(old)
        self.items.append(item)
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self._drop(self.items[0])
        return True

    def search(self, ids: list, least: int = 1) -> list[tuple[Stored, int]]:
        """(entry, tokens it shares with ``ids``) for every entry sharing at least ``least``, least recently
        used first."""
        query = np.asarray(ids, dtype=np.int64)
        found = []
        for item in self.items:
            c = common_prefix(item.ids, query)
            if c >= least:
                found.append((item, c))
        return found

    def load(self, item: Stored, slot: int, counts: list) -> None:
        """Write ``counts[i]`` leading entries of ``item`` back into ``slot`` of each runner (lengths unchanged);
        ``item`` becomes the most recently used (if a save since the search has not evicted it)."""
        for runner, array, k in zip(self.runners, item.arrays, counts):
            if k:
                axis = runner.entries(slot, 0).shape.index(0)  # the entries' axis (layouts differ by runner)
                runner.entries(slot, k)[...] = array[(slice(None),) * axis + (slice(0, k),)]
        if any(it is item for it in self.items):
            self._touch(item)

    def _touch(self, item: Stored) -> None:
        self.items.remove(item)
        self.items.append(item)

    def _drop(self, item: Stored) -> None:
        self.items.remove(item)
        self.nbytes -= item.nbytes


def covers(item: Stored, kept, ids: np.ndarray) -> bool:
    """Whether ``item`` holds everything ``kept`` (tokens ``ids``) does: its tokens start with them, the target
    covers as many, and so does the same proposer's cache (if ``kept`` has proposer entries)."""
    a = item.kept
    return (len(item.ids) >= len(ids) and common_prefix(item.ids, ids) == len(ids) and a.target >= kept.target
            and (kept.proposer == 0 or (a.owner is kept.owner and a.proposer >= kept.proposer)))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens int arrays ``a`` and ``b`` share: common_prefix([1, 2, 3], [1, 2, 4]) == 2."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m
