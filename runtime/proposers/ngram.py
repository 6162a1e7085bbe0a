"""N-gram / prompt-lookup matching: propose what followed the current suffix last time."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import EMPTY, Proposal


def find_continuation(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The reference matcher: a pure function (O(len * max_n); the runtime uses ``NGramIndex``).

    For n from max_n down to min_n: take the last n tokens (the suffix); find its most recent
    EARLIER occurrence; return up to k tokens that followed it. No match: [].

    Worked example, tokens = [5, 1, 2, 3, 9, 1, 2], k = 3, max_n = 3:
        n=3: suffix [9, 1, 2] occurs nowhere earlier
        n=2: suffix [1, 2] occurred at positions 1..2; it was followed by [3, 9, 1]
        -> [3, 9, 1]
    >>> find_continuation([5, 1, 2, 3, 9, 1, 2], k=3, max_n=3)
    [3, 9, 1]
    """
    t = list(tokens)
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        suffix = t[-n:]
        for start in range(len(t) - n - 1, -1, -1):  # most recent earlier occurrence first
            if t[start : start + n] == suffix:
                return t[start + n : start + n + k]
    return []


class NGramIndex:
    """Incremental version of ``find_continuation``: O(max_n) work per appended token and per lookup.

    ``last_end[n][gram]`` is the end position (exclusive) of the most recent occurrence of
    ``gram`` among the n-grams that END BEFORE the last token, so the suffix itself is never
    its own match. Its proposals (``match``'s tokens) equal ``find_continuation`` on the same tokens (tested).
    """

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.last_end: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens and index the n-grams that now end before the last token, later ends overwriting earlier
        ones (the most recent occurrence). Many at once (a prompt): per n, ``zip`` over shifted slices (450 tokens:
        0.16 ms, not 0.36 ms a gram at a time); a step's few: a gram at a time (2-5 µs, not 6-11)."""
        self.tokens.extend(int(x) for x in new_tokens)
        t, stop = self.tokens, len(self.tokens)  # grams end at positions [.., stop - 1]: before the last token
        if stop - self.indexed > 16:
            for n in range(self.min_n, self.max_n + 1):
                start = max(self.indexed + 1, n)
                if start < stop:  # the gram ending at `end`: t[end - n : end]
                    grams = zip(*(t[start - n + j : stop - n + j] for j in range(n)))
                    self.last_end[n].update(zip(grams, range(start, stop)))
        else:
            for end in range(self.indexed + 1, stop):
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    self.last_end[n][tuple(t[end - n : end])] = end
        self.indexed = max(self.indexed, stop - 1)

    def match(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens, the length n of the suffix they continue); ([], 0) without a match."""
        t = self.tokens
        for n in range(min(self.max_n, len(t) - 1), self.min_n - 1, -1):
            end = self.last_end[n].get(tuple(t[-n:]))
            if end is not None:
                return t[end : end + k], n
        return [], 0


class NGramProposer:
    """Prompt lookup: per row, what followed the latest earlier occurrence of the current suffix.

    Deterministic (q is a point mass); no model cost. One ``NGramIndex`` per request, extended
    with the tokens each round emitted. Each proposal's ``kind`` is the length of its match: the core prices a chain
    by what that kind's guesses realized (a 4-token match's continuation is kept far more often than a 1-token
    one's). A ``Proposer`` (runtime/proposers/__init__.py).
    """

    name = "ngram"
    depth = 0
    tree, feature, runner, tree_name = False, None, None, None
    passes, passes_name, step_seconds = 0, "proposer_passes", 0.0
    shadow = True  # a lookup: scored while speculation is off (runtime/proposers/__init__.py)

    def __init__(self, max_n: int = 4, min_n: int = 1, max_gamma: int = 0):
        self.max_n, self.min_n = max_n, min_n
        self.max_nodes = max_gamma
        self.index: dict[str, NGramIndex] = {}  # request id -> its sequence's index

    def start(self, row, hidden) -> None:
        self.index[row.request.request_id] = NGramIndex(self.max_n, self.min_n)

    def propose(self, rows, ks) -> list[Proposal]:
        out = []
        for row, k in zip(rows, ks):
            if not k:
                out.append(EMPTY)
                continue
            index = self.index[row.request.request_id]
            index.extend(row.seq[len(index.tokens):])
            tokens, n = index.match(k)
            out.append(Proposal(np.array(tokens, np.int64), kind=n))  # a longer match is a better guess
        return out

    def observe(self, row, new, hidden) -> None:
        pass

    def finish(self, row) -> None:
        self.index.pop(row.request.request_id, None)
