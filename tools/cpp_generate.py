"""`specrt generate --runtime cpp`: the decode loop in libspecrt (C++), the text around it in Python.

The same split as TensorRT-LLM's run.py (its C++ runner unless ``--use_py_session``) or ONNX
Runtime GenAI (a C++ loop behind Python): per token, libspecrt runs the graph calls, sampling,
verification and the proposer; Python only turns the streamed ids into text. The tokenizer, the
incremental detokenizer and the stop-string matcher are the Python runtime's own classes, so the
text equals what ``--runtime python`` prints for the same tokens. libspecrt runs methods none,
draft, ngram and suffix at any temperature / top-k / top-p / min-p (exact, like the Python runtime;
tests/runtime/cpp); Medusa / EAGLE, penalties and logprobs need the Python runtime.

    specrt generate ENGINE_DIR --runtime cpp --prompt "def f(" --method ngram
"""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engines.manifest import load_manifest
from ..runtime.api import check_prompt_length
from ..runtime.text import IncrementalDetokenizer, StopMatcher
from . import libspecrt

BUILD_HINT = "python -m specrt.tools.libspecrt build   (needs CMake and a C++17 compiler)"


class CppSetupError(RuntimeError):
    """libspecrt is not built where it was looked for (the message says where, and how to build it)."""


def find_library(path: str | os.PathLike | None = None) -> Path:
    """libspecrt.so: ``path``, else $SPECRT_CPP_BUILD/libspecrt.so, else the default build dir's."""
    if path is None:
        path = libspecrt.library_path(os.environ.get("SPECRT_CPP_BUILD", libspecrt.DEFAULT_BUILD))
    path = Path(path)
    if not path.is_file():
        raise CppSetupError(f"--runtime cpp needs libspecrt, and {path} does not exist; build it with\n  {BUILD_HINT}\n"
                            f"(or point --cpp-lib / $SPECRT_CPP_BUILD at an existing build)")
    return path


@dataclass
class CppGeneration:
    token_ids: list  # generated ids (the token that completed a stop string included)
    text: str  # decoded text, stop string excluded
    finish_reason: str  # "stop" (EOS, stop token or stop string) | "length"
    stats: dict = field(default_factory=dict)  # libspecrt's stats, plus method, seconds, tokens_per_second


class CppTextEngine:
    """An engine dir opened by libspecrt, with the engine dir's tokenizer for text in and out."""

    def __init__(self, engine_dir: str | os.PathLike, threads: int = 0, library: str | os.PathLike | None = None,
                 attention: str | None = None):
        from tokenizers import Tokenizer

        self.manifest = load_manifest(engine_dir)  # a clear EngineError for a bad engine dir
        self.tokenizer = Tokenizer.from_file(str(self.manifest.tokenizer_dir / "tokenizer.json"))
        try:
            self.lib = libspecrt.load_library(find_library(library))
        except OSError as e:
            raise CppSetupError(f"libspecrt could not be loaded ({e}); rebuild it with\n  {BUILD_HINT}") from e
        self.engine = libspecrt.CppEngine(self.lib, self.manifest.root, threads=threads, attention=attention)

    def encode(self, prompt) -> list[int]:
        """The prompt's ids: text encoded as the Python runtime encodes it (no special tokens added),
        or a list of token ids (libspecrt checks them against the vocabulary)."""
        ids = (self.tokenizer.encode_batch([prompt], add_special_tokens=False)[0].ids if isinstance(prompt, str)
               else [int(t) for t in prompt])
        if not ids:
            raise ValueError("prompt is empty")
        check_prompt_length(len(ids), self.engine.max_len)
        return ids

    def generate(self, prompt, on_text=None, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = None, method: str | None = None,
                 gamma: int | None = None, stop=()) -> CppGeneration:
        """Generate a continuation of ``prompt`` (text or token ids), as ``Runtime.generate`` does;
        ``on_text(delta)`` receives the text as it becomes final (streaming). Ctrl-C ends the
        generation at the next token and raises KeyboardInterrupt after it."""
        ids = self.encode(prompt)
        detok, stops, pieces, interrupted = IncrementalDetokenizer(self.tokenizer), StopMatcher(stop), [], []

        def emit(delta: str) -> None:
            if delta:
                pieces.append(delta)
                if on_text is not None:
                    on_text(delta)

        def on_token(token_id: int) -> bool:  # False: stop here (a stop string appeared, or Ctrl-C)
            try:
                emit(stops.feed(detok.add(token_id)))
                return not stops.hit
            except KeyboardInterrupt:  # raised inside a ctypes callback it would be printed and dropped
                interrupted.append(True)
                return False

        seed = secrets.randbits(63) if seed is None else seed  # None: a fresh random stream, as in Python
        t0 = time.perf_counter()
        out = self.engine.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k, min_p=min_p, seed=seed, method=method, gamma=gamma,
                                   on_token=on_token)
        seconds = time.perf_counter() - t0
        if interrupted:
            raise KeyboardInterrupt
        emit(stops.flush(detok.flush()))
        finish = "stop" if out.finish_reason == "cancelled" else out.finish_reason  # cancelled here = a stop string
        stats = {**out.stats, "method": method or self.engine.default_method, "runtime": "cpp", "seconds": seconds,
                 "tokens_per_second": len(out.token_ids) / seconds if seconds else 0.0}
        return CppGeneration(out.token_ids, "".join(pieces), finish, stats)

    def close(self) -> None:
        self.engine.close()
