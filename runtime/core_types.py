"""The decode core's vocabulary: its configuration, a request, the rules and limits it runs under, one
active sequence (``Row``) and what a step reports (``SequenceUpdate`` per request, ``StepReport`` per step).

Plain data, no behaviour beyond two properties: runtime/core.py's ``DecodeCore`` reads and writes them,
the server (runtime/serve/) and ``Runtime`` (runtime/api.py) build and read them. Example::

    SequenceRequest("r1", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=8))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .batch_policy import PolicyDecision
from .gamma import AlphaEstimate
from .proposers import Proposer
from .sampling import SamplingParams
from .stats import SequenceCounts
from .text import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from .constraints import Grammar


@dataclass
class CoreConfig:
    max_batch: int = 8  # slots: sequences decoded together in one target pass
    method: str | tuple = "draft"  # the methods served: none | draft | ngram | suffix | medusa | eagle, or several
    # ("draft,ngram" or a tuple; the first is a request's default, "none" is always served)
    gamma: int | None = None  # fixed γ every step (0 = speculation off); None = the batch-aware policy
    probe_every: int = 16  # policy: steps at γ = 0 before one probe step at γ = 1
    calibrate: bool = True  # time target (and draft) passes for B = 1, 2, 4, .., max_batch at start
    acceptance: str = "exact"  # "typical": Medusa-2's LOSSY rule (method medusa, temperature > 0 only)
    prefix_cache: bool = True  # free slots keep finished sequences' caches for prompts that share a prefix
    # (runtime/prefix_cache.py)
    prefix_cache_mb: float = 512  # host-memory tier of the prefix cache: copies of overwritten slots' caches,
    # at most this many MB (runtime/prefix_store.py; 0 = none)
    forced_tokens: bool = True  # a grammar's forced tokens are a row's proposal (False: measure without)
    suffix_corpus: str | None = None  # method suffix: a file of texts (.jsonl of {"text"}, or plain text) every
    # request also draws proposals from (runtime/proposers/suffix.py, docs/runtime.md#a-suffix-corpus)


@dataclass
class SequenceRequest:
    request_id: str  # caller's id, unique among active and queued requests
    prompt_ids: list  # token ids of the prompt (validated by ``Runtime.encode``)
    params: SamplingParams  # sampling and stop rules, max_new_tokens included
    cache_scope: str | None = None  # whose earlier sequences cross-request state (suffix decoding's global
    # cache) may draw on and feed: the server's API key; None = one shared scope
    gamma: int | None = None  # this sequence's fixed γ (0 = no speculation); None = the core's (config.gamma
    # or the batch-aware policy)
    grammar: Grammar | None = None  # its compiled constraint (runtime/constraints.py); None = unconstrained
    method: str | None = None  # its method, one the core serves; None = the core's first


@dataclass
class StopRules:
    tokenizer: object  # detokenizes the output, where stop strings are matched (a ``tokenizers.Tokenizer``)
    eos_ids: set  # token ids that end every sequence


@dataclass
class Limits:
    max_len: int  # cache entries per slot: prompt + output
    gamma_max: int  # the longest chain the exported verify shape takes (its Q - 1)
    vocab_size: int | None = None  # the logits' last dimension (checks logit_bias ids and grammars; None: unchecked)


@dataclass
class SequenceUpdate:
    request_id: str  # which request
    events: list  # StreamEvent list produced this step (token_id None: a final text flush)
    finish_reason: str | None = None  # "stop" | "length" once finished (the slot is already free)
    token_ids: list | None = None  # all generated ids, when finished
    text: str | None = None  # all generated text, when finished
    stats: dict | None = None  # per-request speculation stats, when finished


@dataclass
class StepReport:
    batch_size: int  # sequences in this step's target pass
    gamma: int  # draft length of the step (several methods: the largest of their decisions)
    decision: PolicyDecision  # why (several methods: the decision of the first served method among the rows)
    positions: int  # positions the target pass processed: B * Q, or a packed pass's own (no padding)
    tokens: int  # tokens the step produced (before stop rules cut any)
    proposed: int  # proposals verified
    accepted: int  # proposals accepted
    seconds: float  # wall time of the step (propose + verify + bookkeeping)
    decisions: dict = field(default_factory=dict)  # method -> its rows' PolicyDecision this step


@dataclass(eq=False)
class Row:
    """One active sequence in cache slot ``slot``."""

    request: SequenceRequest
    slot: int
    seq: list  # prompt + generated tokens
    prompt_len: int  # how much of ``seq`` is the prompt
    limit: int  # tokens this request may generate (max_new_tokens, capped by the cache)
    rng: np.random.Generator  # this sequence's random stream (proposer and verifier draw from it)
    end_ids: set  # EOS and stop token ids
    detok: IncrementalDetokenizer
    stops: StopMatcher
    alpha: AlphaEstimate  # this sequence's acceptance estimate (the policy reads ``alpha.alpha``)
    method: str = "none"  # the method it runs (request.method or the core's first)
    proposer: Proposer | None = None  # that method's proposer (the core's, shared with the rows of the method)
    matcher: object = None  # its grammar state (constraints.Matcher); None = unconstrained
    counts: SequenceCounts = field(default_factory=SequenceCounts)
    forced: int = 0  # grammar-forced tokens proposed (runtime/proposers/constrained.py)
    forced_accepted: int = 0  # ... and accepted
    out: list = field(default_factory=list)  # generated tokens
    text: str = ""

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def budget(self) -> int:
        return self.limit - len(self.out)
