"""Constrained decoding: a JSON schema, a regex, a choice or a grammar compiled by llguidance into a
per-sequence ``Matcher`` that says which tokens may come next.

    spec      ``ConstraintSpec(kind, value)``: what the caller asked for ("json_schema", "json_object",
              "regex", "choice", "grammar": Lark, or GBNF converted with llguidance's converter)
    compile   ``GrammarCompiler(tokenizer, vocab_size, eos_ids).compile(spec)`` -> ``Grammar`` (once per request;
              thread-safe; ``ConstraintError`` for an invalid or too costly constraint)
    matcher   ``Grammar.matcher()`` -> ``Matcher``: one sequence's state. Its COMMITTED state follows the
              emitted tokens (``advance``, called by the decode core's ``_emit`` only); ``allowed(prefix)`` /
              ``masks(prefixes)`` give the tokens allowed after committed + prefix, for the speculative
              positions of a round, without changing the committed state

Masks are over the MODEL's vocabulary (the logits' last dimension): ids the tokenizer lacks are never
allowed, and the grammar's "may end here" becomes the model's EOS ids (whatever llguidance's tokenizer
calls EOS). A state where nothing is allowed (the grammar is complete and the model has no EOS id) is
``exhausted``: the decode core ends the sequence there with finish_reason "stop".

Walking many prefixes (a chain's positions are nested prefixes; a tree's node paths come parent first):
the matcher keeps a speculative tail beyond the committed state, rolls back to the longest common
prefix of the tail and the next prefix, consumes the rest and computes the mask; masks are cached per
prefix until the committed state advances, so the pruning pass, the draft model's q and the target's p
of one round compute each mask once. A rejected proposal needs no rollback of the committed state:
it never reached it.

Worked example (regex ``(ab|ba)c*`` over a character tokenizer, a=1, b=2, c=3, model EOS 0):

    m = compiler.compile(ConstraintSpec("regex", "(ab|ba)c*")).matcher()
    m.allowed(())       -> True at 1, 2            m.forced() -> []
    m.allowed((1,))     -> True at 2 only          (the state after "a"; committed is still "")
    m.advance([1]);  m.forced() -> [2]             m.allowed((2,)) -> True at 3 and at EOS 0
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON output without free whitespace (separators as json.dumps writes them): the keys, separators and
# punctuation a schema fixes are then forced tokens, and a small model cannot loop on whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (the message names the problem), or one over the compile budget."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request constrains its output to. kind / value:

    "json_schema"  a JSON schema (dict)            "json_object"  None: any JSON object
    "regex"        a regular expression (str)      "choice"       one of these strings (list of str)
    "grammar"      a Lark grammar as llguidance takes it, or a GBNF grammar (str; detected and converted)
    """

    kind: str
    value: object = None

    def __post_init__(self):
        kind, value = self.kind, self.value
        if kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "json_schema" and not isinstance(value, dict):
            raise ConstraintError(f"a json_schema constraint needs a JSON schema object (dict), got {type(value).__name__}")
        if kind == "json_object" and value is not None:
            raise ConstraintError("a json_object constraint takes no value")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value.strip()):
            raise ConstraintError(f"a {kind} constraint needs a non-empty string, got {value!r:.80}")
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ConstraintError(f"a choice constraint needs a non-empty list of non-empty strings, got {value!r:.80}")
            object.__setattr__(self, "value", tuple(value))


class TokenSpace:
    """How llguidance's token ids map onto the model's vocabulary (see the module docstring)."""

    def __init__(self, lltokenizer, vocab_size: int, tokenizer_size: int, eos_ids):
        self.lltokenizer = lltokenizer
        self.vocab_size = vocab_size  # V: the logits' last dimension
        self.words = -(-lltokenizer.vocab_size // 32)  # int32 words of one llguidance bitmask
        self.eos_ids = np.array(sorted(i for i in eos_ids if 0 <= i < vocab_size), np.int64)  # model EOS ids
        self.grammar_eos = list(lltokenizer.eos_tokens)  # llguidance's EOS ids: "the grammar may end here"
        self.valid = None if tokenizer_size >= vocab_size else np.arange(vocab_size) < tokenizer_size  # [V]
        self._eos = set(self.eos_ids.tolist())

    def to_grammar(self, token: int) -> int:
        """The llguidance id of a model token (a model EOS id is llguidance's EOS)."""
        return self.grammar_eos[0] if token in self._eos else token

    def allowed(self, bitmask: np.ndarray) -> np.ndarray:
        """int32 [W] llguidance bitmask -> bool [V] over the model's vocabulary (a fresh array)."""
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")  # [32 W] 0/1
        may_end = bool(bits[self.grammar_eos].any())
        allowed = bits[: self.vocab_size].view(bool)
        if self.valid is not None:
            allowed &= self.valid
        for i in self.grammar_eos:  # llguidance's EOS is no token of the model's unless the model says so
            if i < self.vocab_size:
                allowed[i] = False
        allowed[self.eos_ids] = may_end
        return allowed


def _tokenizer_wrapper(tokenizer, size: int):
    """llguidance's ``TokenizerWrapper`` over a ``tokenizers.Tokenizer`` whose decoder llguidance cannot read
    (e.g. a ``Fuse`` decoder): each token's bytes from decoding it alone, special tokens marked as llguidance
    expects (0xFF + name), ``size`` ids, and one extra id past them as the grammar's EOS."""
    from llguidance import TokenizerWrapper

    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    class Tokens:
        eos_token_id, bos_token_id = size, None
        special_token_ids = sorted(special)
        tokens = [b"\xff" + (tokenizer.id_to_token(i) or "").encode() if i in special
                  else tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(size)] + [b""]

        def __call__(self, text):
            return tokenizer.encode(text.decode() if isinstance(text, bytes) else text, add_special_tokens=False).ids

    return TokenizerWrapper(Tokens())


def token_space(tokenizer, vocab_size: int, eos_ids) -> TokenSpace:
    """llguidance's tokenizer for a ``tokenizers.Tokenizer`` (the engine dir's tokenizer.json) and a model of
    ``vocab_size`` logits with EOS ids ``eos_ids``. Tokenizers llguidance reads itself (byte-level BPE,
    SentencePiece byte fallback) go straight in; others through ``_tokenizer_wrapper``. ~0.2 s for 49K tokens."""
    from llguidance import LLTokenizer

    size = tokenizer.get_vocab_size(with_added_tokens=True)
    n = max(vocab_size, size)
    eos = sorted(eos_ids)
    try:
        if not eos:
            raise ValueError("no EOS id")  # the wrapper's extra id is the grammar's EOS
        lltok = LLTokenizer(tokenizer.to_str(), n_vocab=n, eos_token=eos)
    except ValueError:  # a decoder llguidance cannot read, or no EOS id: token bytes from the tokenizer itself
        lltok = LLTokenizer(_tokenizer_wrapper(tokenizer, n), n_vocab=n + 1, eos_token=n)
    return TokenSpace(lltok, vocab_size, size, eos)


class GrammarCompiler:
    """Compiles ``ConstraintSpec``s for one tokenizer and model vocabulary (``Runtime.grammar_compiler``).

    Thread-safe: ``compile`` may run on any thread (llguidance releases the GIL while it builds).
    Worked example:

        compiler = GrammarCompiler(rt.tokenizer, vocab_size=49152, eos_ids={2})
        grammar = compiler.compile(ConstraintSpec("json_schema", {"type": "object", "properties": {...}}))
        request = SequenceRequest("r1", ids, params, grammar=grammar)
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids=()):
        from llguidance import LLParserLimits

        self.space = token_space(tokenizer, vocab_size, eos_ids)
        self.limits = LLParserLimits(verbose_errors=False)  # llguidance's fuel limits; errors without grammar dumps
        self._lock = threading.Lock()  # llguidance's objects are thread-safe; this guards only our counters
        self.compiled = 0  # grammars compiled (stats)

    def grammar_text(self, spec: ConstraintSpec) -> str:
        """The llguidance grammar of ``spec``; ConstraintError where the spec cannot be converted."""
        from llguidance import LLMatcher, grammar_from

        try:
            if spec.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(json.dumps(spec.value), overrides=JSON_OPTIONS)
            if spec.kind == "json_object":
                return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
            if spec.kind == "choice":
                return grammar_from("choice", list(spec.value))
            return grammar_from("regex" if spec.kind == "regex" else "grammar", spec.value)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"invalid {spec.kind} constraint: {describe(e)}") from None

    def compile(self, spec: ConstraintSpec, max_seconds: float = 10.0) -> Grammar:
        """A ``Grammar`` for ``spec``; ConstraintError if it is invalid or took over ``max_seconds`` to build
        (llguidance's own limits, ``LLParserLimits``' fuel, bound each step; the wall time is checked here)."""
        from llguidance import LLMatcher

        if not isinstance(spec, ConstraintSpec):
            raise ConstraintError(f"expected a ConstraintSpec, got {type(spec).__name__}")
        t0 = time.perf_counter()
        text = self.grammar_text(spec)
        template = LLMatcher(self.space.lltokenizer, text, log_level=0, limits=self.limits)
        if template.is_error():
            raise ConstraintError(f"invalid {spec.kind} constraint: {describe(template.get_error())}")
        mask = np.zeros(self.space.words, np.int32)
        template.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # the first mask: lexer built now
        seconds = time.perf_counter() - t0
        if template.is_error():
            raise ConstraintError(f"invalid {spec.kind} constraint: {describe(template.get_error())}")
        if seconds > max_seconds:
            raise ConstraintError(f"the {spec.kind} constraint took {seconds:.1f} s to compile, over the "
                                  f"{max_seconds:g} s budget: simplify it")
        with self._lock:
            self.compiled += 1
        return Grammar(spec, template, self.space, seconds)


def describe(error, limit: int = 300) -> str:
    """An error message on one line, at most ``limit`` characters (llguidance's span several)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or "unknown error"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Grammar:
    """A compiled constraint: ``matcher()`` gives each sequence its own state."""

    def __init__(self, spec: ConstraintSpec, template, space: TokenSpace, seconds: float = 0.0):
        self.spec = spec
        self.space = space
        self.seconds = seconds  # compile time
        self._template = template  # an LLMatcher at the start state; each matcher is a copy

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.space)


class Matcher:
    """One sequence's grammar state (see the module docstring): the committed tokens plus a speculative tail."""

    def __init__(self, llmatcher, space: TokenSpace):
        self._m = llmatcher
        self.space = space
        self._tail: list[int] = []  # tokens consumed beyond the committed state
        self._masks: dict[tuple, np.ndarray | None] = {}  # prefix -> allowed bool [V] (None: all); until advance
        self._forced: list[int] | None = None  # forced tokens at the committed state (cached)
        self._buffer = np.zeros(space.words, np.int32)  # [W] llguidance writes each mask here
        self.committed = 0  # tokens advanced so far
        self.mask_seconds = 0.0  # time spent computing masks (stats)

    # ---- the committed state --------------------------------------------------------------------
    def advance(self, tokens) -> None:
        """The sequence emitted ``tokens``: the committed state moves past them (only the core's ``_emit``).
        Masks already computed for prefixes that start with them stay cached (re-keyed)."""
        tokens = tuple(int(t) for t in tokens)
        k = len(tokens)
        if tuple(self._tail[:k]) != tokens and not self._goto(tokens):
            raise RuntimeError(f"tokens {list(tokens)} emitted against the grammar (after {self.committed} tokens)")
        del self._tail[:k]  # the llguidance state is unchanged: only the committed boundary moves
        self.committed += k
        self._masks = {key[k:]: m for key, m in self._masks.items() if key[:k] == tokens}
        self._forced = None

    def forced(self) -> list[int]:
        """The tokens the grammar forces next at the committed state ([] if more than one continuation;
        EOS excluded: the sequence ends through the mask)."""
        if self._forced is None:
            self._goto(())
            ff = [int(t) for t in self._m.compute_ff_tokens()]
            cut = next((i for i, t in enumerate(ff) if t in self.space.grammar_eos or t >= self.space.vocab_size),
                       len(ff))
            self._forced = ff[:cut]
        return self._forced

    @property
    def exhausted(self) -> bool:
        """Nothing may follow the committed state: the grammar is complete and the model has no EOS id (or
        llguidance stopped on an error, e.g. a parser limit)."""
        allowed = self.allowed(())
        return allowed is not None and not allowed.any()

    # ---- speculative positions --------------------------------------------------------------------
    def allowed(self, prefix=()) -> np.ndarray | None:
        """bool [V]: the tokens allowed after committed + ``prefix`` (None: every token). A prefix the grammar
        cannot reach (a forbidden token in it) allows nothing: such a position is never emitted."""
        key = tuple(int(t) for t in prefix)
        if key not in self._masks:
            t0 = time.perf_counter()
            if self._goto(key):
                self._m.unsafe_compute_mask_ptr(self._buffer.ctypes.data, self._buffer.nbytes)
                allowed = self.space.allowed(self._buffer)
                self._masks[key] = None if allowed.all() else allowed
            else:
                self._masks[key] = np.zeros(self.space.vocab_size, bool)
            self.mask_seconds += time.perf_counter() - t0
        return self._masks[key]

    def masks(self, prefixes) -> np.ndarray | None:
        """bool [N, V] (a fresh array): ``allowed`` after each prefix (walked in order: nested or parent-first
        prefixes cost one token each); None when every position allows every token."""
        rows = [self.allowed(p) for p in prefixes]
        if all(r is None for r in rows):
            return None
        return np.stack([np.ones(self.space.vocab_size, bool) if r is None else r for r in rows])

    def _goto(self, prefix: tuple) -> bool:
        """Make the llguidance state committed + ``prefix`` (roll back to the common prefix with the tail,
        consume the rest); False (left at the longest reachable prefix) if a token is not allowed."""
        tail, n = self._tail, 0
        while n < min(len(tail), len(prefix)) and tail[n] == prefix[n]:
            n += 1
        if len(tail) > n:
            self._m.rollback(len(tail) - n)
            del tail[n:]
        for t in prefix[n:]:
            if self._m.try_consume_tokens([self.space.to_grammar(t)]) != 1:
                return False
            tail.append(t)
        return True
