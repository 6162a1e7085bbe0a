"""Streaming text: incremental detokenization and stop strings."""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream


@dataclass
class StreamEvent:
    token_id: int | None  # the token produced; None for a final text-only flush event
    text: str  # text this token made final ("" while a multi-byte char or possible stop string is held)
    logprob: float | None = None  # the token's log-probability (SamplingParams.logprobs set), see sampling.log_probs
    top_logprobs: tuple | None = None  # ((id, logprob), ...) the most probable tokens at that position, best first


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas: tokenizers' ``DecodeStream``, which holds
    a multi-byte character split across tokens until it is complete (one decode call per token)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.held: list[int] = []  # ids since the last delta: an incomplete character so far

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        delta = self.stream.step(self.tokenizer, token_id)
        if delta is None:
            self.held.append(token_id)
            return ""
        self.held.clear()
        return delta

    def flush(self) -> str:
        """Whatever is still held (e.g. an incomplete character at the end)."""
        tail = self.tokenizer.decode(self.held, skip_special_tokens=True) if self.held else ""
        self.held = []
        return tail


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
