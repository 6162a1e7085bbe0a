"""Streaming text: incremental detokenization and stop strings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamEvent:
    token_id: int | None  # the token produced; None for a final text-only flush event
    text: str  # text this token made final ("" while a multi-byte char or possible stop string is held)
    logprob: float | None = None  # the token's log-probability (SamplingParams.logprobs set), see sampling.log_probs
    top_logprobs: tuple | None = None  # ((id, logprob), ...) the most probable tokens at that position, best first


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (prefix_offset..end) and emits what extends the already-emitted
    part, so multi-byte characters split across tokens are held until complete ("\\ufffd").
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""  # decode(ids[prefix_offset:read_offset]), kept to decode once per token

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(self.prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(self.prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held (e.g. an incomplete character at the end)."""
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(self.prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.prefix_text = ""
        return delta


class StopMatcher:
    """Holds back text that could be the start of a stop string; ``hit`` once one appears.

    ``feed`` returns the text that is safe to emit (never any part of a stop string).
    """

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.hit = False

    def feed(self, delta: str) -> str:
        if not self.stops:
            return delta
        self.buffer += delta
        cut = min((i for i in (self.buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.buffer = self.buffer[:cut], ""
            return out
        safe = max(0, len(self.buffer) - self.hold)
        out, self.buffer = self.buffer[:safe], self.buffer[safe:]
        return out

    def flush(self, delta: str = "") -> str:
        if self.hit:
            return ""
        out = self.feed(delta)
        if self.hit:
            return out
        out, self.buffer = out + self.buffer, ""
        return out
