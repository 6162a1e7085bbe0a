"""Sampling parameters and THE function that turns logits into a sampling distribution.

``probs`` is used for the target and for every proposer (draft model, heads): speculative
decoding is exact only if p and q are processed identically (temperature, top-k, top-p, min-p).

Filter semantics (applied in this order, as HF transformers' warpers do):
    temperature  logits / T; T == 0 means greedy: a one-hot on the argmax (lowest id on ties)
    top_k        keep tokens whose probability is >= the k-th largest (ties at the boundary kept)
    top_p        keep token x if the mass of tokens strictly more probable than x is < top_p
                 (the smallest top set reaching top_p; ties at the boundary kept)
    min_p        keep tokens with probability >= min_p * max probability
Then renormalise. top-p uses a partial sort (argpartition on a growing candidate set), never
a full sort of the vocabulary; the result is exact.

Penalties (``penalize``, before all of the above; vLLM's and OpenAI's definitions) depend on the
sequence so far, so a row's history is passed with its logits. Speculation stays exact because
the target's row after a proposal prefix is penalised with that prefix in its history, and the
draft's q the same way (the same function on both sides):
    repetition_penalty  r in [0.01, 100]: a token seen in the prompt or the output gets logit / r if the
                        logit is positive, logit * r otherwise (HF's and vLLM's rule; 1 = off)
    frequency_penalty   logit -= f * (times the token occurs in the output)   (0 = off)
    presence_penalty    logit -= p * (1 if the token occurs in the output)    (0 = off)

``process_logits`` is THE processing of a sequence's raw logits at each position it is sampled or
verified at (the first token after prefill, the target's verify rows, the draft model's q): the
penalties, then ``logit_bias`` (OpenAI: added to the logits), ``min_tokens`` (vLLM: EOS and stop token
ids impossible before that many tokens) and the grammar's mask (runtime/constraints.py: forbidden
tokens -inf), each with the position's own history (the sequence plus the proposal prefix before it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; > 0 scales logits
    top_k: int = 0  # 0 = off; keep the k most probable tokens
    top_p: float = 1.0  # in (0, 1]; 1 = off
    min_p: float = 0.0  # in [0, 1); 0 = off
    seed: int | None = None  # seeds the request's random stream (None: fresh entropy)
    max_new_tokens: int = 64  # generation length limit
    stop_token_ids: tuple = ()  # extra ids that end generation (besides the model's EOS)
    stop: tuple = field(default_factory=tuple)  # strings that end generation (excluded from text)
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from the logit of every token in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # in [0.01, 100]: divides positive / multiplies negative logits of seen tokens; 1 = off
    logprobs: int | None = None  # report each emitted token's log-probability and this many alternatives; None = off
    logit_bias: tuple = ()  # ((token id, bias in [-100, 100]), ...) added to the logits (a dict is accepted)
    min_tokens: int = 0  # EOS and stop_token_ids are impossible until this many tokens are generated

    def __post_init__(self):
        t, k, p, mp = self.temperature, self.top_k, self.top_p, self.min_p
        if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(mp, (int, float)) or not (0 <= mp < 1):
            raise SamplingError(f"min_p must be in [0, 1), got {mp!r}")
        if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise SamplingError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                raise SamplingError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not (0.01 <= r <= 100):
            raise SamplingError(f"repetition_penalty must be a number in [0.01, 100] (1 = off), got {r!r}")
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, (int, np.integer)) or isinstance(lp, bool) or not 0 <= lp <= 20):
            raise SamplingError(f"logprobs must be an integer in 0..20 (alternatives per token) or None, got {lp!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        m = self.min_tokens
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or not 0 <= m <= self.max_new_tokens:
            raise SamplingError(f"min_tokens must be an integer in 0..max_new_tokens ({self.max_new_tokens}), got {m!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def processed(self) -> bool:
        """Whether ``process_logits`` changes logits under these params alone (a grammar aside)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


def check_logit_bias(bias, vocab_size: int | None = None) -> tuple:
    """``logit_bias`` as sorted ((id, bias), ...) pairs from a dict or pairs; SamplingError for an id that is not
    an integer >= 0 (or >= ``vocab_size`` when given) or a bias outside [-100, 100]."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = list(pairs or ())
        out = {}
        for tok, b in pairs:
            if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool) or tok < 0:
                raise SamplingError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if vocab_size is not None and tok >= vocab_size:
                raise SamplingError(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})")
            if not isinstance(b, (int, float, np.number)) or isinstance(b, bool) or not -100 <= b <= 100:
                raise SamplingError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {tok}")
            out[int(tok)] = float(b)
    except (TypeError, ValueError) as e:
        if isinstance(e, SamplingError):
            raise
        raise SamplingError(f"logit_bias must map token ids to biases, got {bias!r:.80}") from None
    return tuple(sorted(out.items()))


def process_logits(logits: np.ndarray, row, prefixes=None) -> np.ndarray:
    """A sequence's raw logits [N, V] -> processed logits [N, V]: the penalties, ``logit_bias``, ``min_tokens``
    and the grammar's mask (forbidden tokens -inf), position i with history row.seq + prefixes[i]. Unchanged
    (not copied) when nothing applies.

    row: the sequence (a decode core ``Row``): ``params``, ``seq`` (prompt + output), ``prompt_len``,
    ``end_ids`` (EOS and stop token ids) and ``matcher`` (its grammar state, None without a constraint);
    prefixes: per row of ``logits`` the proposal tokens before it (None: none). Where min_tokens and the
    grammar leave no token (the grammar is complete), the grammar wins; where the grammar allows nothing,
    the row is left unmasked (the core ends the sequence before such a position is emitted).
    Worked example: row.seq = prompt + [a], min_tokens 2, prefixes [[], [b]] -> EOS -inf in row 0 only.
    """
    params = row.params
    x = penalize(logits, params, row.seq, row.prompt_len, prefixes)
    if params.logit_bias:
        x = np.array(x, dtype=np.float64) if x is logits else x
        ids, bias = zip(*params.logit_bias)
        x[:, list(ids)] += np.array(bias)
    keep = _allowed(row, x.shape, prefixes)  # [N, V] | None
    return x if keep is None else np.where(keep, x, -np.inf)


def _allowed(row, shape: tuple, prefixes) -> np.ndarray | None:
    """bool [N, V]: what min_tokens and the grammar allow at each position (None: everything)."""
    params, matcher, (n, v) = row.params, row.matcher, shape
    generated = len(row.seq) - row.prompt_len
    if matcher is None and generated >= params.min_tokens:
        return None
    lengths = [len(p) for p in prefixes] if prefixes is not None else [0] * n
    grammar = matcher.masks(prefixes if prefixes is not None else [()] * n) if matcher is not None else None  # [N, V]
    early = np.array([generated + k < params.min_tokens for k in lengths])  # [N] EOS and stop ids still forbidden
    ends = [i for i in row.end_ids if 0 <= i < v] if early.any() else []
    if grammar is None and not ends:
        return None
    keep = np.ones((n, v), bool) if grammar is None else grammar  # (masks() returns a fresh array)
    if ends:
        keep = keep.copy()  # ``grammar`` stays as it was: an emptied row falls back to it below
        keep[np.ix_(early, ends)] = False
    empty = ~keep.any(-1)  # [N] min_tokens against a complete grammar: the grammar wins
    if empty.any():
        keep[empty] = grammar[empty] if grammar is not None else True
        keep[~keep.any(-1)] = True  # nothing allowed at all: never emitted (the core ends the sequence first)
    return keep


def penalize(logits: np.ndarray, params: SamplingParams, seq, prompt_len: int, prefixes=None) -> np.ndarray:
    """The penalties of ``params`` applied to rows of logits; unchanged (not copied) when none is set.

    logits: [N, V]; seq: the sequence so far (prompt, then output); prompt_len: how much of ``seq`` is
    the prompt; prefixes: per row the proposal tokens before it (row i's history is seq + prefixes[i];
    None: every row's history is seq). Returns [N, V] (float64 when penalised).
    """
    if not params.penalized:
        return logits
    x = np.array(logits, dtype=np.float64)  # [N, V] a copy
    n, v = x.shape
    seq = np.asarray(seq, dtype=np.int64)
    counts = np.tile(np.bincount(seq[prompt_len:], minlength=v)[:v], (n, 1))  # [N, V] output occurrences
    if prefixes is not None:
        rows = np.concatenate([np.full(len(t), i) for i, t in enumerate(prefixes)]).astype(np.int64)
        toks = np.concatenate([np.asarray(t, dtype=np.int64) for t in prefixes])
        np.add.at(counts, (rows, toks), 1)
    if params.repetition_penalty != 1:
        seen = counts > 0
        seen[:, seq[:prompt_len]] = True  # [N, V] in the prompt or the output
        r = params.repetition_penalty
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return x


def log_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """What a token's reported log-probability is: log ``probs()`` (the distribution it was sampled
    from; -inf for filtered tokens) when sampling, the model's log-softmax when greedy (log of a
    one-hot says nothing). logits: [N, V] (penalised) -> float64 [N, V]."""
    if params.greedy:
        x = np.asarray(logits, dtype=np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    with np.errstate(divide="ignore"):
        return np.log(probs(logits, params))


def top_logprobs(logits: np.ndarray, tokens, params: SamplingParams, top: int) -> list[tuple]:
    """Per row, (the token's log-probability, ((id, logprob), ...) the ``top`` most probable, best first).
    logits: [K, V] (penalised); tokens: int [K], the tokens emitted from those rows."""
    lp = log_probs(logits, params)  # [K, V]
    out = []
    k = min(top, lp.shape[-1])
    for row, tok in zip(lp, tokens):
        best = np.argpartition(-row, k - 1)[:k] if 0 < k < len(row) else np.arange(k)  # the k best, unordered
        best = best[np.argsort(-row[best], kind="stable")]
        out.append((float(row[tok]), tuple((int(i), float(row[i])) for i in best)))
    return out


def _top_p_threshold(p: np.ndarray, top_p: float) -> np.ndarray:
    """Per row, the smallest probability kept by top-p. p: [N, V] normalised; returns [N, 1]."""
    n, v = p.shape
    k = min(v, 64)
    while True:
        part = np.argpartition(-p, k - 1, axis=-1)[:, :k] if k < v else np.broadcast_to(np.arange(v), (n, v))
        top = np.take_along_axis(p, part, axis=-1)  # [N, k]
        top = -np.sort(-top, axis=-1)  # [N, k] descending, only k elements sorted
        before = np.cumsum(top, axis=-1) - top  # [N, k] mass strictly before each sorted entry
        # mass of tokens strictly more probable than top[j]: `before` at the first entry equal to top[j]
        first_equal = np.maximum.accumulate(np.where(np.diff(top, prepend=np.inf, axis=-1) != 0,
                                                     np.arange(k), 0), axis=-1)
        strictly_before = np.take_along_axis(before, first_equal, axis=-1)  # [N, k]
        kept = strictly_before < top_p
        enough = ~kept[:, -1] | (k == v)  # the last candidate is already cut: the set is complete
        if enough.all():
            last = kept.sum(-1) - 1  # [N] index of the smallest kept entry
            return top[np.arange(n), last][:, None]
        k = min(v, 4 * k)


def probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Sampling distribution for each row. logits: [..., V] -> probabilities float64 [..., V]."""
    x = np.asarray(logits, dtype=np.float64)
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [N, V]
    if params.greedy:
        out = np.zeros_like(x)
        out[np.arange(len(x)), x.argmax(-1)] = 1.0
        return out.reshape(shape)
    x = (x - x.max(-1, keepdims=True)) / params.temperature  # max first: a tiny T cannot overflow to inf - inf
    p = np.exp(x)
    p /= p.sum(-1, keepdims=True)  # [N, V]
    if 0 < params.top_k < p.shape[-1]:
        kth = -np.partition(-p, params.top_k - 1, axis=-1)[:, params.top_k - 1:params.top_k]  # [N, 1]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        p = np.where(p >= _top_p_threshold(p, params.top_p), p, 0.0)
        p /= p.sum(-1, keepdims=True)
    if params.min_p > 0:
        p = np.where(p >= params.min_p * p.max(-1, keepdims=True), p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p.reshape(shape)


def sample(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row by inverse CDF. p: [N, V] (need not be normalised) -> int64 [N]."""
    cdf = np.cumsum(p, axis=-1)  # [N, V]
    u = rng.random(len(p)) * cdf[:, -1]  # [N]
    idx = (cdf <= u[:, None]).sum(-1)  # [N] first index with cdf > u
    return np.minimum(idx, p.shape[-1] - 1).astype(np.int64)


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Choose one token from one row of logits [V] under ``params``."""
    if params.greedy:
        return int(logits.argmax())
    return int(sample(probs(logits[None], params), rng)[0])
