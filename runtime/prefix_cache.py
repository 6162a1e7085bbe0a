"""Automatic prefix caching: a finished sequence's caches stay in its slot, and a new prompt that starts
with tokens such a slot holds reuses their K/V instead of prefilling them.

The decode core (runtime/core.py) keeps its active sequences in slots 0..B-1. Here the free slots
B..max_batch-1 keep what the sequences that left them held (``Retained``: the tokens, and how many of
them the target's cache and the proposer's own cache hold), least recently used first out. Nothing
is allocated in the slots: memory is the ``max_batch`` slots the runners already have. A slot is reused
as soon as it is free, so a server whose slots are all busy keeps nothing there; the host-memory tier
(``PrefixStore``, runtime/prefix_store.py, ``host_mb`` MB) keeps a copy of a kept slot's caches the
moment the slot is overwritten (its sequence dropped, or a hit whose prompt then differs from what it kept:
``rewrites``), and a claim takes the longer prefix of the two tiers (a kept slot on a tie: no copy).

    a row leaves      ``retain`` (what its slot holds), ``move_row`` (the last active row takes its
                      place: the two slots SWAP, so the leaving row's caches land at the free end),
                      ``release`` (the freed slot keeps them)
    a prompt arrives  ``claim``: the free slot sharing the longest prefix with the prompt (at least
                      ``min_hit`` tokens, or the whole prompt but its last token) swaps into slot B,
                      its lengths are cut to the shared prefix, and the core prefills only the rest
                      (or a stored copy sharing more is written into slot B).
                      The last prompt token always runs: its logits give the first token.

Worked example: a slot kept [5, 6, 7, 8, 9] (prompt [5, 6, 7] + output [8, 9]; the target's cache holds
the first 4, the last token never ran). The prompt [5, 6, 7, 8, 3] shares 4 tokens: the target keeps 4
entries, the prefill runs [3] alone at position 4. The prompt [5, 6, 7] shares 3: the target keeps 2
entries and runs [7] (``cached_tokens`` = 2).

Exact: a kept entry is the K/V the target computed for the same tokens at the same positions, so the
output is a cold run's (greedy token for token; seeded sampling the same draws) up to the float rounding
between pass shapes that speculation already has (a kept entry may come from a decode step or a verify
pass, a cold run's from a prefill chunk). A target with a prefill graph of its own (export/prefill_graph.py:
prompts on another kernel, not float rounding apart) keeps only the prompt's entries: a multi-turn
chat reuses the earlier prompt and prefills the earlier answer again.

Proposers with a cache of their own (``proposer.runner``) keep theirs slot for slot with the target:
they say, as a row leaves, how many leading tokens of its sequence their cache covers (``cached(row)``)
and how many tokens their entries lag behind them (``cache_lag``: the EAGLE head's row t needs token
t + 1); ``start`` then continues from the entries the claim left in the slot (``runner.lengths[slot]``).
A proposer that reads the target's features (EAGLE) needs them at every entry it has not got, so the
target reuses exactly as many entries as the proposer's cache. A proposer with a cache but no
``cached`` turns prefix caching off. In a core serving several methods, a kept slot's proposer cache
serves only a prompt of the method that left it (another method's own cache starts cold: for the EAGLE
head that means a cold target prefill too); the target's K/V serve any other method.
"""
from __future__ import annotations

from dataclasses import dataclass

from .prefix_store import PrefixStore

MIN_HIT = 16  # shortest shared prefix worth a slot swap, unless it is the whole prompt (but its last token)


@dataclass
class Retained:
    """What a free slot's caches hold."""

    tokens: list  # the sequence that left: prompt + output (its last token never ran)
    target: int  # leading tokens of ``tokens`` whose K/V the target's slot holds
    owner: object  # the proposer that served it (only its own cache, if any, holds anything for it)
    proposer: int  # leading tokens whose state ``owner``'s cache slot covers (0: none, or no such cache)
    used: int  # when it was kept (the least recent is evicted first)


def shared_prefix(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` share: shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    """The free slots' kept caches for one decode core, and the slot moves that keep them.

    ``target``: the target's runner; ``proposers``: the core's proposer, or its proposers (a dict by method,
    or a list): the caches of those with a ``runner`` move slot for slot with the target's. ``enabled``
    False: a slot is emptied when its row leaves (no reuse). ``host_mb``: the host-memory tier's budget
    (``store``; 0: none). ``hits`` / ``hit_tokens`` count the prompts that reused a prefix (from a slot or
    the store) and the prompt tokens they did not prefill.
    """

    def __init__(self, target, proposers, max_batch: int, enabled: bool = True, min_hit: int = MIN_HIT,
                 host_mb: float = 0):
        if isinstance(proposers, dict):
            proposers = proposers.values()
        elif not isinstance(proposers, (list, tuple)):
            proposers = [proposers]
        self.target = target
        self.proposers = list({id(p): p for p in proposers}.values())
        self.proposer = self.proposers[0]  # the rows' proposer when a caller names none (a one-method core's)
        own = [p for p in self.proposers if p.runner is not None]
        self.runners = [target, *{id(p.runner): p.runner for p in own}.values()]  # the caches, slot for slot
        self.enabled = bool(enabled) and all(hasattr(p, "cached") for p in own) and (
            max_batch == 1 or all(hasattr(r, "entries") for r in self.runners))
        self.min_hit = min_hit
        host = self.enabled and host_mb > 0 and all(hasattr(r, "entries") for r in self.runners)
        self.store = PrefixStore(int(host_mb * 2 ** 20), self.runners) if host else None  # the host tier
        self.kept: list[Retained | None] = [None] * max_batch  # per slot; only free slots keep anything
        self.clock = 0
        self.hits = 0  # prompts that reused a kept prefix
        self.hit_tokens = 0  # prompt tokens they did not prefill

    def clear(self) -> None:
        """Forget every kept slot (something else wrote the caches: calibration, another core on shared runners)."""
        self.kept = [None] * len(self.kept)

    def _entries(self, rec: Retained | None, runner) -> int:
        """Valid entries of ``rec`` in ``runner``'s slot."""
        if rec is None:
            return 0
        if runner is self.target:
            return rec.target
        return max(0, rec.proposer - lag(rec.owner)) if rec.owner.runner is runner else 0

    # ---- a row leaves ------------------------------------------------------------------------------
    def retain(self, row) -> Retained | None:
        """What ``row``'s slot holds (ask before the proposer forgets the row); None: nothing to keep."""
        if not self.enabled:
            return None
        target = min(int(self.target.lengths[row.slot]), len(row.seq))  # a stop string may cut seq short of the cache
        if self.target.prefill_graph is not None:  # only the prompt's entries are what a cold prefill would write
            target = min(target, row.prompt_len)
        if not target:
            return None
        owner = getattr(row, "proposer", None) or self.proposer
        proposer = min(owner.cached(row), len(row.seq)) if owner.runner is not None else 0
        self.clock += 1
        return Retained(list(row.seq), target, owner, proposer, self.clock)

    def move_row(self, src: int, dst: int, kept: Retained | None) -> None:
        """The active row in slot ``src`` takes the slot ``dst`` a row is leaving: the slots swap (what the
        leaving row's caches keep, ``kept``, goes to ``src``); without caching ``src`` is copied over ``dst``."""
        for runner in self.runners:
            if self.enabled:
                runner.swap(src, dst, int(runner.lengths[src]), self._entries(kept, runner))
            else:
                runner.move(src, dst)

    def release(self, slot: int, kept: Retained | None) -> None:
        """``slot`` is free: its lengths go to 0, its entries stay for ``kept`` (None: nothing kept)."""
        for runner in self.runners:
            runner.release(slot)
        self.kept[slot] = kept

    # ---- a prompt arrives ----------------------------------------------------------------------------
    def claim(self, ids: list, slot: int, count: int, proposer=None) -> int:
        """Make slots [slot, slot + count) ready for ``count`` sequences of prompt ``ids`` served by ``proposer``
        (None: the first), ``slot`` the first free one. The best kept prefix (if any) goes to ``slot`` with the
        target's and the proposer's lengths set to what stays valid; what the other claimed slots kept moves to
        free slots beyond that keep nothing or something older (else it is dropped). Returns the prompt tokens
        the target's slot holds: the prefill runs ``ids[returned:]``."""
        proposer = proposer or self.proposer
        need = max(1, min(self.min_hit, len(ids) - 1))  # a hit reuses min_hit tokens, or all it can
        best = self._best(ids, slot, proposer, need) if self.enabled else None
        stored = self._best_stored(ids, proposer, need) if self.store is not None else None
        n = entries = 0
        if stored is not None and (best is None or stored[1] > best[1]):
            item, n, entries = stored
            self._evacuate(range(slot, slot + count), slot + count)
            self.store.load(item, slot, self._counts(n, entries, proposer))
            self.store.hits += 1
            self.store.hit_tokens += n
        elif best is not None:
            j, n, entries = best
            self._swap(j, slot)
            if not rewrites(self.kept[slot], ids, proposer):  # the new sequence overwrites entries of other tokens:
                self._spill(self.kept[slot], slot)  # copy them first
            self.kept[slot] = None  # consumed: the new sequence writes past the shared prefix
        if n:
            self.hits += 1
            self.hit_tokens += n
        self._evacuate(range(slot, slot + count), slot + count)
        for s in range(slot, slot + count):
            for runner in self.runners:
                runner.release(s)
        self.target.set_length(slot, n)
        if proposer.runner is not None:
            proposer.runner.set_length(slot, entries)
        return n

    def _reusable(self, rec: Retained, ids: list, proposer, c: int | None = None) -> tuple[int, int]:
        """(target entries, proposer entries) of ``rec`` valid for prompt ``ids`` served by ``proposer``
        (``c``: the tokens they share, if known)."""
        c = shared_prefix(rec.tokens, ids) if c is None else c
        n = min(c, rec.target, len(ids) - 1)  # the last prompt token runs: its logits give the first token
        if proposer.runner is None:
            return n, 0
        entries = max(0, min(c, rec.proposer) - lag(proposer)) if rec.owner is proposer else 0
        if proposer.feature is not None:  # it needs the target's features at every entry it lacks
            n = entries = min(n, entries)
        return n, entries

    def _best(self, ids: list, first: int, proposer, need: int) -> tuple[int, int, int] | None:
        """(slot, target entries, proposer entries) of the free slot reusing the most of ``ids`` (ties: the
        most recent), if it reuses at least ``need`` tokens."""
        best, best_key = None, None
        for j in range(first, len(self.kept)):
            rec = self.kept[j]
            if rec is None:
                continue
            n, entries = self._reusable(rec, ids, proposer)
            if n >= need and (best_key is None or (n, rec.used) > best_key):
                best, best_key = (j, n, entries), (n, rec.used)
        return best

    def _best_stored(self, ids: list, proposer, need: int) -> tuple[object, int, int] | None:
        """(stored entry, target entries, proposer entries) of the store's entry reusing the most of ``ids``
        (ties: the most recently used), if it reuses at least ``need`` tokens."""
        best = None
        for item, c in self.store.search(ids, need):
            n, entries = self._reusable(item.kept, ids, proposer, c)
            if n >= need and (best is None or n >= best[1]):
                best = (item, n, entries)
        return best

    def _counts(self, n: int, entries: int, proposer) -> list[int]:
        """Per runner, how many entries a claim by ``proposer`` reuses: the target ``n``, the proposer's
        runner ``entries``, the others none."""
        return [n if r is self.target else entries if r is proposer.runner else 0 for r in self.runners]

    def _spill(self, rec: Retained | None, slot: int) -> None:
        """Copy ``rec``, what ``slot`` holds, into the host tier (if any) before the slot is overwritten."""
        if self.store is not None and rec is not None:
            self.store.save(rec, slot, [self._entries(rec, r) for r in self.runners])

    def _swap(self, a: int, b: int) -> None:
        """Two free slots trade their kept caches."""
        if a == b:
            return
        ra, rb = self.kept[a], self.kept[b]
        for runner in self.runners:
            runner.swap(a, b, self._entries(ra, runner), self._entries(rb, runner))
        self.kept[a], self.kept[b] = rb, ra

    def _evacuate(self, slots: range, first: int) -> None:
        """Move what ``slots`` keep to free slots from ``first`` on that keep nothing or older (else drop it)."""
        for s in slots:
            rec = self.kept[s]
            if rec is None:
                continue
            self.kept[s] = None
            free = [d for d in range(first, len(self.kept)) if self.kept[d] is None]
            older = [d for d in range(first, len(self.kept)) if d not in free and self.kept[d].used < rec.used]
            dest = free[0] if free else min(older, key=lambda d: self.kept[d].used) if older else None
            if dest is None:
                self._spill(rec, s)  # dropped from the slots: the host tier keeps a copy
                continue
            self._spill(self.kept[dest], dest)  # the older sequence it replaces (if any) goes to the host tier
            for runner in self.runners:
                runner.copy_entries(s, dest, self._entries(rec, runner))
            self.kept[dest] = rec


def rewrites(rec: Retained, ids: list, proposer) -> bool:
    """Whether a prompt ``ids`` served by ``proposer`` writes every entry ``rec`` keeps again, for the same tokens
    at the same positions (it starts with all of them): its slot will hold all ``rec`` held, and a host copy of
    ``rec`` would keep nothing more. A repeated prompt whose slot kept only the prompt's entries (a prefill graph)
    or a chat's next turn rewrite theirs; a prompt that shares a system prompt and then differs does not.

        >>> rec = Retained([5, 6, 7, 8], target=3, owner=None, proposer=0, used=1)
        >>> rewrites(rec, [5, 6, 7], None), rewrites(rec, [5, 6, 7, 8, 3], None), rewrites(rec, [5, 6, 9], None)
        (True, True, False)
    """
    c = shared_prefix(rec.tokens, ids)
    return c >= rec.target and (rec.proposer == 0 or (rec.owner is proposer and c >= rec.proposer))


def lag(proposer) -> int:
    """How many tokens a proposer's cache covers beyond its entries (``cache_lag``: the EAGLE head's 1)."""
    return int(getattr(proposer, "cache_lag", 0))
