"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's method "suffix"): model-free proposals
from the continuations of the current context, counted over this request AND earlier requests.

Per slot, a ``SuffixIndex`` of the request's own sequence (prompt + output); one global
``SuffixIndex`` of recent finished sequences (bounded in tokens, oldest evicted first); optionally a
fixed corpus index (``corpus_index``: text the model wrote before, e.g. ``specrt train data``'s; a
retrieval datastore as in REST, arXiv 2311.08252). A proposal
walks the most frequent continuation of the longest context any index has seen, one token at
a time, and stops when the walk's probability (the product of each step's count share) drops
below ``min_prob`` or the proposal reaches ``factor`` times the length of the first match: a long
match (a repeated file, an earlier answer being re-emitted) proposes long chains, a short one
little. Deterministic (q = point masses), so the chain is verified exactly.

The classes and ``propose`` below are the rule and its reference implementation; the proposer runs the same
rule in native code where it builds (custom_ops/suffix.py, the file libspecrt compiles too: ~10x less host time
to index a request and to merge it into the global cache), the index's contexts as 64-bit hashes (a collision
could only change a proposal).

Worked example, depth 3, one earlier sequence [7, 1, 2, 3, 4] in the global index, this request's
sequence [9, 1, 2]: the longest context with counts is [1, 2] (n = 2) -> next 3 (count 1 of 1);
then [1, 2, 3] -> 4; then [2, 3, 4] -> nothing: proposal [3, 4] (factor 1: at most 2 tokens).
"""
from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import EMPTY, Proposal


class SuffixIndex:
    """For every context of 1..``depth`` tokens seen in the added sequences: how often each next token followed it."""

    def __init__(self, depth: int):
        self.depth = depth
        self.next: dict[tuple, dict[int, int]] = {}  # context -> {next token: count}

    def add(self, seq: Sequence[int], start: int, stop: int, sign: int = 1) -> None:
        """Count (sign -1: uncount) the next tokens seq[start:stop] after their contexts."""
        for i in range(max(1, start), stop):
            tok = seq[i]
            for n in range(1, min(self.depth, i) + 1):
                ctx = tuple(seq[i - n : i])
                counts = self.next.setdefault(ctx, {})
                c = counts.get(tok, 0) + sign
                if c > 0:
                    counts[tok] = c
                else:
                    counts.pop(tok, None)
                    if not counts:
                        del self.next[ctx]

    def __len__(self) -> int:
        """Contexts with counts."""
        return len(self.next)

    def merge(self, other: "SuffixIndex") -> None:
        """Count everything ``other`` (of the same depth) counted: the same as adding its sequences again,
        without rebuilding their contexts (a finished request's own index joining the global one)."""
        for ctx, counts in other.next.items():
            mine = self.next.get(ctx)
            if mine is None:
                self.next[ctx] = dict(counts)
            else:
                for tok, c in counts.items():
                    mine[tok] = mine.get(tok, 0) + c

    def longest(self, context: Sequence[int]) -> tuple[int, dict | None]:
        """(n, counts) for the longest suffix of ``context`` with counts; (0, None) if none.

        A binary search over n: every occurrence of an n-token context also counts its last n - 1 tokens
        (``add`` counts contexts 1..depth at each position, and uncounts them together), so the suffixes with
        counts are exactly those up to the longest one: ~log2(depth) lookups instead of up to depth."""
        lo, hi, found = 0, min(self.depth, len(context)), None  # the suffix of lo tokens has counts (lo 0: none)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            counts = self.next.get(tuple(context[-mid:]))
            if counts:
                lo, found = mid, counts
            else:
                hi = mid - 1
        return (lo, found) if lo else (0, None)


def native_available() -> bool:
    """Whether the native index builds here (custom_ops/suffix.py)."""
    from ...custom_ops.suffix import available

    return available()


def new_index(depth: int, native: bool | None = None):
    """An empty index: the native one (custom_ops/suffix.py) where it builds and ``native`` is not False, else
    ``SuffixIndex``; ``native=True`` raises KernelError where it cannot be built."""
    if native is False or (native is None and not native_available()):
        return SuffixIndex(depth)
    from ...custom_ops.suffix import NativeSuffixIndex

    return NativeSuffixIndex(depth)


class SuffixCache:
    """The global index: finished sequences, at most ``max_tokens`` tokens in all (oldest evicted)."""

    def __init__(self, depth: int, max_tokens: int, index=None):
        self.index = index if index is not None else SuffixIndex(depth)  # empty: a SuffixIndex or a native one
        self.max_tokens = max_tokens
        self.sequences: collections.deque = collections.deque()
        self.tokens = 0

    def add(self, seq: Sequence[int], counted: SuffixIndex | None = None) -> None:
        """Keep ``seq`` (its last ``max_tokens``), evicting the oldest sequences to make room. ``counted``: an
        index of exactly ``seq`` (the request's own), merged instead of counting ``seq`` again."""
        whole = len(seq) <= self.max_tokens
        seq = list(seq[-self.max_tokens:]) if self.max_tokens else []
        if not seq:
            return
        while self.sequences and self.tokens + len(seq) > self.max_tokens:
            old = self.sequences.popleft()
            self.index.add(old, 0, len(old), sign=-1)
            self.tokens -= len(old)
        if counted is not None and whole and counted.depth == self.index.depth:
            self.index.merge(counted)
        else:
            self.index.add(seq, 0, len(seq))
        self.sequences.append(seq)
        self.tokens += len(seq)


def read_corpus(path: Path) -> list[str]:
    """The texts of a corpus file: a .jsonl file's "text" fields (one JSON object a line: what
    ``specrt train data`` writes), any other file whole.
    Raises ValueError, naming the file, when it cannot be read or a line is not such an object."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"suffix corpus {path}: cannot read it ({e})") from None
    if Path(path).suffix != ".jsonl":
        return [raw]
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            try:
                texts.append(json.loads(line)["text"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"suffix corpus {path}, line {n}: not a JSON object with a \"text\" field") from None
            if not isinstance(texts[-1], str):
                raise ValueError(f"suffix corpus {path}, line {n}: \"text\" is not a string")
    return texts


def corpus_index(sequences: Iterable[Sequence[int]], depth: int = 24, native: bool | None = None):
    """A fixed index of ``sequences`` (token ids), for ``SuffixProposer(corpus=...)``: never evicted, shared by
    every cache scope (public text, not a user's outputs). Native where it builds (``new_index``)."""
    index = new_index(depth, native)
    for seq in sequences:
        index.add(seq, 0, len(seq))
    return index


def propose(local, others: Sequence, context: Sequence[int], k: int, factor: float, min_prob: float) -> list[int]:
    """Up to ``k`` tokens: the most frequent continuation of the longest matched context (ties: the
    request's own index, then ``others`` in order, then the lowest token id). Native indexes (all of them): the
    same walk in native code."""
    if not isinstance(local, SuffixIndex):
        from ...custom_ops.suffix import native_propose

        return native_propose(local, others, context, k, factor, min_prob)
    ctx, out, prob, limit = list(context[-local.depth:]), [], 1.0, k
    for _ in range(k):
        n, counts = local.longest(ctx)
        for other in others:
            n_other, other_counts = other.longest(ctx)
            if n_other > n:
                n, counts = n_other, other_counts
        if not n:
            break
        if not out:
            limit = min(k, max(1, int(factor * n)))
        tok, c = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        prob *= c / sum(counts.values())
        if prob < min_prob:
            break
        out.append(tok)
        ctx = (ctx + [tok])[-local.depth:]
        if len(out) >= limit:
            break
    return out


@dataclass
class SuffixState:
    """What the proposer keeps about one request."""

    local: object  # the request's own index (prompt + output so far): a SuffixIndex or a native one
    seq: list  # the row's sequence (a live reference)
    scope: str | None  # the request's cache scope: whose global cache it draws on and joins
    indexed: int = 0  # tokens of ``seq`` counted in ``local``


class SuffixProposer:
    """Suffix decoding for every row. One proposer per decode core, so the global cache spans the
    requests that core serves (one served model), one cache per ``cache_scope`` of the requests:
    `specrt serve` scopes each request to its API key, so no key's requests draw on another key's
    outputs. Per request: its own index, extended with what each round emitted; when it finishes,
    its sequence joins its scope's global cache. A ``Proposer`` (runtime/proposers/__init__.py)."""

    name = "suffix"
    depth = 0
    tree, feature, runner, tree_name = False, None, None, None
    passes, passes_name = 0, "proposer_passes"
    shadow = True  # a lookup: scored while speculation is off (runtime/proposers/__init__.py)

    def __init__(self, max_gamma: int, context_depth: int = 24, factor: float = 1.0, min_prob: float = 0.1,
                 cache_tokens: int = 1 << 16, corpus=None, native: bool | None = None):
        self.context_depth, self.factor, self.min_prob = context_depth, factor, min_prob  # longest context matched
        self.corpus = corpus  # a fixed index every scope draws on (``corpus_index``), or None
        # native indexes (custom_ops/suffix.py) where they build, unless asked not to or the corpus is a Python one
        self.native = native is not False and not isinstance(corpus, SuffixIndex) and (native or native_available())
        self.max_nodes = max_gamma
        self.cache_tokens = cache_tokens  # bound of each scope's global cache
        self.caches: dict[str | None, SuffixCache] = {}  # cache scope (API key) -> its global cache
        self.states: dict[str, SuffixState] = {}  # request id -> what is kept for it
        self.step_seconds = None  # EWMA seconds per proposed token

    def cache(self, scope: str | None = None) -> SuffixCache:
        """The global cache of ``scope`` (made on first use)."""
        if scope not in self.caches:
            self.caches[scope] = SuffixCache(self.context_depth, self.cache_tokens, self._index())
        return self.caches[scope]

    def _index(self):
        return new_index(self.context_depth, self.native)

    def start(self, row, hidden) -> None:
        self.states[row.request.request_id] = SuffixState(self._index(), row.seq, row.request.cache_scope)

    def propose(self, rows, ks) -> list[Proposal]:
        t0, out, proposed = time.perf_counter(), [], 0
        for row, k in zip(rows, ks):
            if not k:
                out.append(EMPTY)
                continue
            state, seq = self.states[row.request.request_id], row.seq
            state.local.add(seq, state.indexed, len(seq))
            state.indexed = len(seq)
            others = (self.cache(state.scope).index,) + ((self.corpus,) if self.corpus is not None else ())
            tokens = propose(state.local, others, seq, k, self.factor, self.min_prob)
            proposed += max(1, len(tokens))
            out.append(Proposal(np.array(tokens, np.int64)))
        if proposed:
            dt = (time.perf_counter() - t0) / proposed
            self.step_seconds = dt if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * dt
        return out

    def observe(self, row, new, hidden) -> None:
        pass

    def finish(self, row) -> None:
        """The sequence left (finished or cancelled): it joins its scope's global cache."""
        state = self.states.pop(row.request.request_id, None)
        if state is not None:
            state.local.add(state.seq, state.indexed, len(state.seq))  # the tokens since its last proposal
            self.cache(state.scope).add(state.seq, counted=state.local)
