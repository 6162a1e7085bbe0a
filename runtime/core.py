"""The decode core: every method, batched, from one step function.

``DecodeCore`` is built from explicit parts: the target's runner (its cache of ``max_batch``
slots), ONE proposer for all rows (runtime/proposers/__init__.py's ``Proposer``), the batch-aware
γ policy, the stop rules (EOS ids, the tokenizer for stop strings) and the limits (cache length,
exported γ). It keeps the rows: active sequences in slots 0..B-1 (when one leaves, the last slot
moves into the hole, in the target's cache and the proposer's, so the active rows stay a
contiguous view of the cache). Per-request settings (sampling, γ) travel with each
``SequenceRequest``. ``Runtime.generate`` runs this core at max_batch 1 and ``specrt serve`` at
max_batch N (both build it with ``Runtime.new_core``). A step:

    γ         one decision for the batch (runtime/batch_policy.py; 0 = plain decoding)
    propose   per row a chain of k_b <= γ tokens with q, or a tree with point masses
    verify    ONE target pass over [B, Q = max positions]: row b = its last token, its proposal,
              then padding; each row verified by runtime/verify.py with its own generator
    commit    per row the cache keeps the last token and the accepted path (rollback/compaction)
    emit      EOS, stop ids, stop strings, length: ``_emit``, the one implementation

Every row follows the same rules whatever the batch (first token from the prefill logits,
k_b = min(γ, budget - 1), its own random stream), so greedy rows equal plain greedy decoding
and seeded sampled rows at a fixed γ equal their batch-1 output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .batch_policy import NO_ROOM, LatencyCurve, PolicyConfig, PolicyDecision, SpeculationPolicy
from .gamma import AlphaEstimate
from .proposers import EMPTY, Proposal, Proposer
from .sampling import SamplingError, SamplingParams, next_token, penalize, top_logprobs
from .stats import SequenceCounts, sequence_stats
from .text import IncrementalDetokenizer, StopMatcher, StreamEvent
from .verify import ACCEPTANCE, verify

@dataclass
class CoreConfig:
    max_batch: int = 8  # slots: sequences decoded together in one target pass
    method: str = "draft"  # the proposer of every sequence: none | draft | ngram | suffix | medusa | eagle
    gamma: int | None = None  # fixed γ every step (0 = speculation off); None = the batch-aware policy
    probe_every: int = 16  # policy: steps at γ = 0 before one probe step at γ = 1
    calibrate: bool = True  # time target (and draft) passes for B = 1, 2, 4, .., max_batch at start
    acceptance: str = "exact"  # "typical": Medusa-2's LOSSY rule (method medusa, temperature > 0 only)


@dataclass
class SequenceRequest:
    request_id: str  # caller's id, unique among active and queued requests
    prompt_ids: list  # token ids of the prompt (validated by ``Runtime.encode``)
    params: SamplingParams  # sampling and stop rules, max_new_tokens included
    cache_scope: str | None = None  # whose earlier sequences cross-request state (suffix decoding's global
    # cache) may draw on and feed: the server's API key; None = one shared scope
    gamma: int | None = None  # this sequence's fixed γ (0 = no speculation); None = the core's (config.gamma
    # or the batch-aware policy)


@dataclass
class StopRules:
    tokenizer: object  # detokenizes the output, where stop strings are matched (a ``tokenizers.Tokenizer``)
    eos_ids: set  # token ids that end every sequence


@dataclass
class Limits:
    max_len: int  # cache entries per slot: prompt + output
    gamma_max: int  # the longest chain the exported verify shape takes (its Q - 1)


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
    gamma: int  # draft length of the step
    decision: PolicyDecision  # why
    positions: int  # B * Q positions the target pass processed
    tokens: int  # tokens the step produced (before stop rules cut any)
    proposed: int  # proposals verified
    accepted: int  # proposals accepted
    seconds: float  # wall time of the step (propose + verify + bookkeeping)


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
    counts: SequenceCounts = field(default_factory=SequenceCounts)
    out: list = field(default_factory=list)  # generated tokens
    text: str = ""

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def budget(self) -> int:
        return self.limit - len(self.out)


class DecodeCore:
    """Continuous batching with speculative rounds over a target runner and one proposer.

    Not thread-safe: one worker drives it (``add``, ``remove``, ``step``). Build it with
    ``Runtime.new_core`` (which makes the parts from an engine dir), or from parts of your own.
    """

    def __init__(self, config: CoreConfig, target, proposer: Proposer, policy: SpeculationPolicy,
                 stops: StopRules, limits: Limits):
        check_config(config, limits.gamma_max)
        self.config = config
        self.target = target  # the target graph's runner: the cache of config.max_batch slots
        self.proposer = proposer
        self.policy = policy
        self.stops = stops
        self.max_len, self.gamma_max = limits.max_len, limits.gamma_max
        self.rows: list[Row] = []  # rows[i].slot == i
        self.served = AlphaEstimate()  # α over the sequences served: a new sequence starts from it
        self._probes = 0  # tree probes so far (each probes one row, in turn)
        if config.calibrate and config.method != "none":
            self.calibrate()

    def fixed_gamma(self, gamma: int | None) -> int | None:
        """``fixed_gamma`` for this core's method and proposer."""
        return fixed_gamma(self.config.method, self.proposer, gamma)

    # ---- admission and eviction -------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.config.max_batch - len(self.rows)

    def add(self, request: SequenceRequest) -> SequenceUpdate:
        """Prefill a new sequence into a free slot and emit its first token."""
        return self.add_group([request])[0]

    def add_group(self, requests: list[SequenceRequest]) -> list[SequenceUpdate]:
        """Sequences of one prompt (a request's n choices): ONE prefill, its cache copied into every
        other sequence's slot; each samples its first token from its own generator."""
        if len(requests) > self.free_slots:
            raise RuntimeError(f"{len(requests)} sequences need a slot each; {self.free_slots} free")
        ids = list(requests[0].prompt_ids)
        if any(list(r.prompt_ids) != ids for r in requests[1:]):
            raise ValueError("the sequences of a group share one prompt")
        if not ids or len(ids) >= self.max_len:
            raise ValueError(f"prompt length {len(ids)} outside 1..{self.max_len - 1}")
        rows = [self._new_row(r, len(self.rows) + i) for i, r in enumerate(requests)]
        self.target.release(rows[0].slot)
        logits, hidden = self.target.prefill(rows[0].slot, ids, self.proposer.feature)  # [V], [P, F] | None
        rows[0].counts.target_passes += self.target.prefill_calls(len(ids))
        updates = []
        for row in rows:
            if row is not rows[0]:
                self.target.copy(rows[0].slot, row.slot)
            self.rows.append(row)
            x = penalize(logits[None], row.params, row.seq, row.prompt_len)  # [1, V]
            tok = next_token(x[0], row.params, row.rng)
            updates.append(self._emit(row, [tok], self._logprobs(row, x, [0], [tok])))
        for row, update in zip(rows, updates):
            if update.finish_reason:
                self._free(row)
            else:
                self._timed(self.proposer.start, [row], row, hidden)
        return updates

    def _new_row(self, request: SequenceRequest, slot: int) -> Row:
        params, ids = request.params, list(request.prompt_ids)
        return Row(request=request, slot=slot, seq=ids, prompt_len=len(ids),
                   limit=min(params.max_new_tokens, self.max_len - len(ids)), rng=np.random.default_rng(params.seed),
                   end_ids=set(self.stops.eos_ids) | set(params.stop_token_ids),
                   detok=IncrementalDetokenizer(self.stops.tokenizer),
                   stops=StopMatcher(params.stop), alpha=AlphaEstimate(state=self.served.export_state()))

    def remove(self, request_id: str) -> bool:
        """Drop a request's sequence now (cancellation): its slot and cache are free on return."""
        for row in self.rows:
            if row.request.request_id == request_id:
                self._free(row)
                return True
        return False

    def _free(self, row: Row) -> None:
        self.proposer.finish(row)
        runners = [r for r in (self.target, self.proposer.runner) if r is not None]  # the caches, slot for slot
        last = self.rows.pop()
        if last is not row:  # move the last slot into the hole: active slots stay 0..B-1
            for runner in runners:
                runner.move(last.slot, row.slot)
            last.slot = row.slot
            self.rows[row.slot] = last
        else:
            for runner in runners:
                runner.release(row.slot)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> tuple[list[SequenceUpdate], StepReport | None]:
        """One round for every active sequence; finished sequences leave their slots."""
        if not self.rows:
            return [], None
        t0 = time.perf_counter()
        rows = list(self.rows)
        decision, gammas, ks = self._plan(rows)
        drafting = [r for r, k in zip(rows, ks) if k]
        if drafting:
            proposals, proposer_s = self._timed(self.proposer.propose, drafting, rows, ks)
        else:  # no row drafts (γ = 0, no room): plain decoding, no proposer call
            proposals, proposer_s = [EMPTY] * len(rows), 0.0
        out = self.target.forward(*pack(rows, proposals))  # ONE target pass: logits [B, Q, V]
        verified = [self._verify(row, p, out.logits[b, : p.positions]) for b, (row, p) in enumerate(zip(rows, proposals))]
        keeps, news, logprobs = (list(column) for column in zip(*verified))  # per row: kept positions, tokens, logprobs
        for row, gamma, p, keep in zip(rows, gammas, proposals, keeps):
            self._record(row, gamma, p, len(keep) - 1)
        self.target.commit(out, keeps)
        updates = [self._emit(row, new, lp) for row, new, lp in zip(rows, news, logprobs)]
        if self.proposer.feature is not None:  # Medusa / EAGLE continue from the target's features at the kept nodes
            hidden = out.outputs[self.proposer.feature]  # [B, Q, F]: "hidden" (H) or EAGLE-3's "aux_hidden" (3H)
            for b, (row, update) in enumerate(zip(rows, updates)):
                if not update.finish_reason:
                    proposer_s += self._timed(self.proposer.observe, [row], row, news[b], hidden[b, keeps[b]])[1]
        if self.proposer.tree and drafting:  # a tree method's D(B): its proposer work per step
            self.policy.record_draft(len(drafting), 1, proposer_s)
        for row, update in zip(rows, updates):
            if update.finish_reason:
                self._free(row)
        return updates, StepReport(
            batch_size=len(rows), gamma=decision.gamma, decision=decision, positions=out.logits.shape[0] * out.logits.shape[1],
            tokens=sum(map(len, news)), proposed=sum(len(p.tokens) for p in proposals),
            accepted=sum(len(k) - 1 for k in keeps), seconds=time.perf_counter() - t0)

    def _plan(self, rows: list[Row]) -> tuple[PolicyDecision, list[int], list[int]]:
        """The step's decision, each row's γ, and each row's proposal size k_b (0: none)."""
        fixed = self._step_fixed_gamma(rows)
        if fixed is not None or any(self._room(r, self.gamma_max) for r in rows):
            decision = self.policy.decide([r.alpha.alpha for r in rows], fixed)
        else:  # no row can draft (its last token, a full cache): the adaptive policy is not asked, so its
            decision = NO_ROOM  # probes land on steps that can use them (every 8th step aliases on short requests)
        gammas = [self._row_gamma(row, decision) for row in rows]
        ks = [self._room(row, g) for row, g in zip(rows, gammas)]
        if decision.reason == "probe" and self.proposer.tree:  # a tree probe costs B·N positions: probe one row
            self._probes += 1
            ks = [k if b == self._probes % len(rows) else 0 for b, k in enumerate(ks)]
        return decision, gammas, ks

    def _verify(self, row: Row, p: Proposal, logits: np.ndarray) -> tuple[np.ndarray, list[int], list | None]:
        """One row's verification over its logits [k + 1, V]: (the positions its cache keeps, the tokens
        it emits, their logprobs if asked). Token j of the emitted ones came from kept position j."""
        if row.params.penalized:  # each position penalised with its own history
            logits = penalize(logits, row.params, row.seq, row.prompt_len, p.prefixes())
        path, nxt = verify(p, logits, row.params, row.rng, self.config.acceptance)
        if p.tree is None:  # a chain keeps its first n + 1 positions: the last token and n accepted
            keep, new = np.arange(len(path) + 1), [*p.tokens[: len(path)].tolist(), nxt]
        else:  # a tree keeps the root and the accepted path
            keep, new = np.concatenate([[0], path]), [*p.tokens[path - 1].tolist(), nxt]
        return keep, new, self._logprobs(row, logits, keep, new)

    def _step_fixed_gamma(self, rows: list[Row]) -> int | None:
        """The step's fixed γ: the rows' own when they all ask the same one, else the config's (None: the policy)."""
        own = {row.request.gamma for row in rows}
        if len(own) == 1 and None not in own:
            return self.fixed_gamma(own.pop())
        return self.policy.config.fixed_gamma

    def _row_gamma(self, row: Row, decision: PolicyDecision) -> int:
        """A row's γ this step: its request's own, else the step's decision."""
        return decision.gamma if row.request.gamma is None else self.fixed_gamma(row.request.gamma)

    def _room(self, row: Row, gamma: int) -> int:
        """The proposal size this row may take: k tokens of a chain, or 1 = "a tree fits" (0: none)."""
        if gamma == 0 or row.budget <= 1:
            return 0
        room = self.target.room(row.slot) - 1  # positions after the root
        if self.proposer.tree:
            return int(room >= self.proposer.max_nodes)
        return max(0, min(gamma, row.budget - 1, room))

    def _record(self, row: Row, gamma: int, p: Proposal, n: int) -> None:
        c = row.counts
        c.target_passes += 1
        if p.tree is not None:
            k = p.tree.depth
            c.record(k, n, p.tree.size)
        elif self.proposer.tree:
            c.fallback_steps += 1
            return
        else:
            k = len(p.tokens)
            c.record(k, n)
            c.gamma_history.append(gamma)
        row.alpha.update(k, n)
        self.served.update(k, n)

    def _timed(self, fn, rows, *args):
        """Run a proposer call; its wall time and graph calls count for each of ``rows``.
        Returns (the call's result, its seconds)."""
        t0, passes = time.perf_counter(), self.proposer.passes
        result = fn(*args)
        dt, dp = time.perf_counter() - t0, self.proposer.passes - passes
        for row in rows:
            row.counts.proposer_seconds += dt
            row.counts.proposer_passes += dp
        return result, dt

    # ---- output ------------------------------------------------------------------------------
    def _logprobs(self, row: Row, logits: np.ndarray, kept, tokens: list[int]) -> list[tuple] | None:
        """(logprob, top alternatives) per emitted token if the request asks; token j came from row kept[j] of
        logits [Q, V]."""
        if row.params.logprobs is None:
            return None
        return top_logprobs(logits[kept], tokens, row.params, row.params.logprobs)

    def _emit(self, row: Row, new: list[int], logprobs: list[tuple] | None = None) -> SequenceUpdate:
        """Apply EOS, stop ids, stop strings and the length limit to new tokens."""
        events, finish = [], None
        for i, tok in enumerate(new):
            row.out.append(tok)
            row.seq.append(tok)
            lp, top = logprobs[i] if logprobs else (None, None)
            if tok in row.end_ids:
                finish = "stop"
                events.append(StreamEvent(tok, "", lp, top))
                break
            text = row.stops.feed(row.detok.add(tok))
            row.text += text
            finish = "stop" if row.stops.hit else ("length" if len(row.out) >= row.limit else None)
            events.append(StreamEvent(tok, text, lp, top))
            if finish:
                break
        update = SequenceUpdate(row.request.request_id, events)
        if finish:
            tail = row.stops.flush(row.detok.flush())
            if tail:
                row.text += tail
                events.append(StreamEvent(None, tail))
            update.finish_reason, update.token_ids, update.text = finish, list(row.out), row.text
            update.stats = self.stats_for(row)
        return update

    def stats_for(self, row: Row) -> dict:
        acceptance = self.config.acceptance
        curve = self.policy.target_curve
        stats = sequence_stats(row.counts, self.config.method, len(row.out), self.proposer,
                               curve.seconds if curve else (lambda n: 0.0), self.gamma_max, acceptance,
                               lossy=acceptance == "typical" and not row.params.greedy)
        if self.config.method != "none":
            stats["alpha_estimate"] = row.alpha.alpha  # the decayed estimate the policy used last
        return stats

    # ---- measurements --------------------------------------------------------------------------
    def calibrate(self, past: int | None = None, reps: int = 3) -> None:
        """Time target passes for B = 1, 2, 4, .., max_batch (Q = 1..γmax+1 at B = 1; Q = 1, γmax+1 or
        the tree size above) and draft passes at Q = 1, on stale cache entries of length ``past``. The
        fastest of ``reps`` runs after a warm-up goes into the curves (a burst of other load does not
        skew them); shapes the curves already hold are skipped. Only while idle."""
        if self.rows:
            raise RuntimeError("calibrate only while no sequence is active")
        g = self.gamma_max
        top = self.proposer.max_nodes + 1 if self.proposer.tree else g + 1
        past = max(0, min(past or 32, self.max_len - top - 1))
        sizes = sorted({*(2 ** i for i in range(self.config.max_batch.bit_length())), self.config.max_batch})
        def target_qs(b: int):
            return range(1, top + 1) if b == 1 and not self.proposer.tree else (1, top)

        plan = [(self.target, self.policy.target_curve, target_qs)]
        draft = self.proposer.runner if self.config.method == "draft" else None
        if draft is not None:  # (a caller's own proposer may have no draft model)
            plan.append((draft, self.policy.draft_curve, lambda b: (1,)))
        for runner, curve, shapes in plan:
            for b in sizes:
                for q in shapes(b):
                    if b * q not in curve.points:
                        curve.record(b * q, time_pass(runner, b, q, past, reps))
                for slot in range(b):
                    runner.set_length(slot, 0)


def time_pass(runner, batch: int, q: int, past: int, reps: int) -> float:
    """The fastest of ``reps`` calls (after a warm-up) of [batch, q] tokens after ``past`` stale entries."""
    slots, ids = np.arange(batch), np.zeros((batch, q), np.int64)
    for slot in slots:
        runner.set_length(slot, past)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        runner.forward(slots, ids, record=False)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def pack(rows: list[Row], proposals: list[Proposal]):
    """The target pass's inputs: (slots [B], ids [B, Q], blocks, depths) for ``HostRunner.forward``."""
    if len(rows) == 1 and proposals[0].tree is None:  # one chain: no padding
        return [rows[0].slot], [[rows[0].seq[-1], *proposals[0].tokens.tolist()]]
    q = max(p.positions for p in proposals)
    ids = np.zeros((len(rows), q), dtype=np.int64)  # [B, Q]: last token, proposal, padding (id 0)
    for b, (row, p) in enumerate(zip(rows, proposals)):
        ids[b, 0] = row.seq[-1]
        ids[b, 1 : p.positions] = p.tokens
    slots = np.array([row.slot for row in rows], dtype=np.int64)
    if all(p.tree is None for p in proposals):
        return slots, ids
    blocks = [p.tree.mask if p.tree is not None else None for p in proposals]
    depths = [p.tree.depths if p.tree is not None else None for p in proposals]
    return slots, ids, blocks, depths


def fixed_gamma(method: str, proposer: Proposer, gamma: int | None) -> int | None:
    """The policy's fixed γ for a requested γ (None: the policy decides): 0 for method "none"; a tree
    method has one speculative choice, its whole tree: γ >= 1 means "always verify the tree", 0 "never"."""
    if method == "none":
        return 0
    return min(gamma, 1) if gamma is not None and proposer.tree else gamma


def check_config(config: CoreConfig, gamma_max: int) -> None:
    """A clear error for a bad size, γ or acceptance rule (the method: ``methods.check_method``)."""
    if config.max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {config.max_batch}")
    if config.gamma is not None and not 0 <= config.gamma <= gamma_max:
        raise SamplingError(f"gamma must be in 0..{gamma_max} or None for the policy, got {config.gamma}")
    if config.acceptance not in ACCEPTANCE or (config.acceptance != "exact" and config.method != "medusa"):
        raise SamplingError(f"acceptance must be one of {', '.join(ACCEPTANCE)} ('typical' is lossy and only for "
                            f"method 'medusa'), got {config.acceptance!r} with method {config.method!r}")
