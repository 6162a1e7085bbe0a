"""Batched generation: several sequences advance together, one target pass per step.

``BatchedGenerator`` owns batched time-major KV caches (target and draft) with ``max_batch``
slots. Active sequences occupy slots 0..B-1; a sequence that finishes or is removed frees its
slot at once (the last slot's cache is moved into the hole, so the active rows stay a
contiguous view of the cache). Each ``step`` is one round for every active sequence:

    γ         chosen for the whole batch by the ``SpeculationPolicy`` (0 = plain decoding)
    propose   per row k_b <= γ tokens (draft model: γ batched draft passes; n-gram: lookup)
    verify    ONE target pass over [B, Q = max k_b + 1]: row b = its last token, its proposal,
              then padding (never attended to by the real positions)
    accept    per row with the runtime's ``verify_greedy`` / ``verify_sampled`` on ``probs``
    rollback  per row: the cache keeps the last token and the accepted proposals only

Every row follows exactly the batch-1 runtime's rules (first token from the prefill logits,
k_b = min(γ, budget - 1), the same random stream per request), so greedy rows equal
``Runtime.generate(..., method="none")`` and seeded sampled rows at a fixed γ equal the runtime's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .batch_model import BatchedModel
from .batch_policy import PolicyConfig, PolicyDecision, SpeculationPolicy
from .gamma import GammaController
from .proposers import NGramProposer, Proposal
from .rejection import verify_greedy, verify_sampled
from .runtime import StreamEvent
from .sampling import SamplingError, SamplingParams, next_token, probs, sample
from .text import IncrementalDetokenizer, StopMatcher

BATCH_METHODS = ("none", "draft", "ngram")  # proposers the batched generator runs (tree methods: batch 1 only)


@dataclass
class BatchConfig:
    max_batch: int = 8  # slots: sequences decoded together in one target pass
    method: str = "draft"  # "none" | "draft" | "ngram": the proposer of every sequence
    gamma: int | None = None  # fixed γ every step (0 = speculation off); None = the batch-aware policy
    probe_every: int = 16  # policy: steps at γ = 0 before one probe step at γ = 1
    calibrate: bool = True  # time target (and draft) passes for B = 1, 2, 4, .., max_batch at start


@dataclass
class SequenceRequest:
    request_id: str  # caller's id, unique among active and queued requests
    prompt_ids: list  # token ids of the prompt (validated by ``Runtime.encode``)
    params: SamplingParams  # sampling and stop rules, max_new_tokens included


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


@dataclass
class _Row:
    """One active sequence in slot ``slot``."""

    request: SequenceRequest
    slot: int
    seq: list  # prompt + generated tokens
    limit: int  # tokens this request may generate (max_new_tokens, capped by the cache)
    rng: np.random.Generator
    end_ids: set
    detok: IncrementalDetokenizer
    stops: StopMatcher
    acceptance: GammaController  # the α estimate of this sequence (its ``alpha``)
    ngram: NGramProposer | None = None
    draft_seen: list = field(default_factory=list)  # tokens in the draft cache of this slot, in order
    out: list = field(default_factory=list)  # generated tokens
    text: str = ""
    target_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def budget(self) -> int:
        return self.limit - len(self.out)


class BatchedGenerator:
    """Continuous batching with speculative rounds over a loaded ``Runtime``'s graphs.

    Not thread-safe: one worker drives it (``add``, ``remove``, ``step``).
    """

    def __init__(self, runtime, config: BatchConfig):
        if config.method not in BATCH_METHODS:
            raise SamplingError(f"unknown method {config.method!r} for batched generation; available: "
                                f"{', '.join(BATCH_METHODS)}")
        if config.method == "draft" and runtime.draft is None:
            raise SamplingError("method 'draft' needs an engine dir exported with --draft")
        if config.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {config.max_batch}")
        g_max = runtime.gamma_max
        if config.gamma is not None and not 0 <= config.gamma <= g_max:
            raise SamplingError(f"gamma must be in 0..{g_max} or None for the policy, got {config.gamma}")
        self.runtime = runtime
        self.config = config
        self.max_len = runtime.manifest.max_len
        cap = runtime.manifest.defaults.get("speculation_max_batch")
        self.policy = SpeculationPolicy(PolicyConfig(
            gamma_max=g_max, fixed_gamma=0 if config.method == "none" else config.gamma,
            speculation_max_batch=int(cap) if cap is not None else None, probe_every=config.probe_every,
            draft_cost=config.method == "draft"))
        self.target = BatchedModel(runtime.target.engine, runtime.target.spec, self.max_len, config.max_batch,
                                   on_call=self.policy.record_target)
        self.draft = None
        if config.method == "draft":
            self.draft = BatchedModel(runtime.draft.engine, runtime.draft.spec, self.max_len, config.max_batch,
                                      on_call=self.policy.record_draft)
        self.rows: list[_Row] = []  # rows[i].slot == i
        self.acceptance = GammaController(g_max)  # α over all sequences served: the prior of a new sequence's α
        if config.calibrate and config.method != "none" and config.gamma is None:
            self.calibrate()

    # ---- admission and eviction -------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.config.max_batch - len(self.rows)

    def add(self, request: SequenceRequest) -> SequenceUpdate:
        """Prefill a new sequence into a free slot and emit its first token."""
        if not self.free_slots:
            raise RuntimeError("no free slot")
        ids, params = list(request.prompt_ids), request.params
        if not ids or len(ids) >= self.max_len:
            raise ValueError(f"prompt length {len(ids)} outside 1..{self.max_len - 1}")
        rt = self.runtime
        row = _Row(request=request, slot=len(self.rows), seq=ids,
                   limit=min(params.max_new_tokens, self.max_len - len(ids)),
                   rng=np.random.default_rng(params.seed), end_ids=rt.eos_ids | set(params.stop_token_ids),
                   detok=IncrementalDetokenizer(rt.tokenizer), stops=StopMatcher(params.stop),
                   acceptance=GammaController(rt.gamma_max, prior_alpha=self.acceptance.alpha))
        self.target.lengths[row.slot] = 0
        logits = self.target.prefill(row.slot, ids)  # [V]
        row.target_passes += self.target.prefill_calls(len(ids))
        if self.draft is not None:
            self.draft.lengths[row.slot] = 0
            self.draft.prefill(row.slot, ids)
            row.draft_seen = list(ids)
        if self.config.method == "ngram":
            row.ngram = NGramProposer()
        self.rows.append(row)
        update = self._emit(row, [next_token(logits, params, row.rng)])
        if update.finish_reason:
            self._free(row)
        return update

    def remove(self, request_id: str) -> bool:
        """Drop a request's sequence now (cancellation): its slot and cache are free on return."""
        for row in self.rows:
            if row.request.request_id == request_id:
                self._free(row)
                return True
        return False

    def _free(self, row: _Row) -> None:
        last = self.rows.pop()
        if last is not row:  # move the last slot into the hole: active slots stay 0..B-1
            i = row.slot
            for model in (self.target, self.draft):
                if model is not None:
                    model.cache.move(last.slot, i)
            last.slot = i
            self.rows[i] = last
        else:
            for model in (self.target, self.draft):
                if model is not None:
                    model.lengths[row.slot] = 0

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> tuple[list[SequenceUpdate], StepReport | None]:
        """One round for every active sequence; finished sequences leave their slots."""
        if not self.rows:
            return [], None
        t0 = time.perf_counter()
        rows = list(self.rows)
        decision = self.policy.decide([r.acceptance.alpha for r in rows])
        ks = [max(0, min(decision.gamma, r.budget - 1)) for r in rows]
        proposals = self._propose(rows, ks)
        q = max(len(p.tokens) for p in proposals) + 1
        ids = np.zeros((len(rows), q), dtype=np.int64)  # [B, Q]: last token, proposal, padding (id 0)
        for b, (row, p) in enumerate(zip(rows, proposals)):
            ids[b, 0] = row.seq[-1]
            ids[b, 1 : 1 + len(p.tokens)] = p.tokens
        slots = np.arange(len(rows))
        logits, outputs = self.target.run(slots, ids)  # logits [B, Q, V]
        keep, news, proposed, accepted = [], [], 0, 0
        for b, (row, p) in enumerate(zip(rows, proposals)):
            k = len(p.tokens)
            row_logits = logits[b, : k + 1]  # [k + 1, V]
            if row.request.params.greedy:
                n, nxt = verify_greedy(p.tokens, row_logits)
            else:
                n, nxt = verify_sampled(p.tokens, p.q, probs(row_logits, row.request.params), row.rng)
            keep.append(1 + n)  # the last token and the n accepted proposals
            news.append([*p.tokens[:n].tolist(), nxt])
            row.acceptance.update(k, n)
            self.acceptance.update(k, n)
            row.target_passes += 1
            row.rounds += 1
            row.proposed += k
            row.accepted += n
            proposed += k
            accepted += n
        self.target.write(slots, outputs, keep)
        updates = []
        for row, new in zip(rows, news):
            update = self._emit(row, new)
            updates.append(update)
            if update.finish_reason:
                self._free(row)
        report = StepReport(batch_size=len(rows), gamma=decision.gamma, decision=decision, positions=len(rows) * q,
                            tokens=sum(len(n) for n in news), proposed=proposed, accepted=accepted,
                            seconds=time.perf_counter() - t0)
        return updates, report

    def _propose(self, rows: list[_Row], ks: list[int]) -> list[Proposal]:
        empty = Proposal(np.zeros(0, np.int64), None)
        if not any(ks):
            return [empty] * len(rows)
        if self.config.method == "ngram":
            return [r.ngram.propose(r.seq, k, r.request.params, r.rng) if k else empty for r, k in zip(rows, ks)]
        return self._propose_draft(rows, ks)

    def _propose_draft(self, rows: list[_Row], ks: list[int]) -> list[Proposal]:
        """Batched draft chains: one call feeding each row's unseen tokens, then Q=1 calls.

        Per row this is ``DraftModelProposer.propose``: same tokens fed, same q = ``probs``,
        same order of random draws.
        """
        active = [b for b, k in enumerate(ks) if k > 0]
        unseen = []
        for b in active:
            row = rows[b]
            n = 0
            limit = min(len(row.draft_seen), len(row.seq))
            while n < limit and row.draft_seen[n] == row.seq[n]:
                n += 1
            n = min(n, len(row.seq) - 1)  # the draft must run on at least the last token
            self.draft.lengths[row.slot] = n
            del row.draft_seen[n:]
            unseen.append(row.seq[n:])
        width = max(len(u) for u in unseen)
        ids = np.zeros((len(active), width), dtype=np.int64)  # [A, U] unseen tokens, padded
        for i, u in enumerate(unseen):
            ids[i, : len(u)] = u
        slots = np.array([rows[b].slot for b in active])
        lens = np.array([len(u) for u in unseen])
        logits = self.draft.step(slots, ids, keep=lens)[np.arange(len(active)), lens - 1]  # [A, V]
        for b, u in zip(active, unseen):
            rows[b].draft_seen.extend(u)
        tokens = {b: [] for b in active}
        qs = {b: [] for b in active}
        for i in range(max(ks)):
            feed = []
            for j, b in enumerate(active):
                if ks[b] <= i:
                    continue
                params = rows[b].request.params
                if params.greedy:
                    tok = int(np.argmax(logits[j]))
                else:
                    q = probs(logits[j][None], params)[0]  # [V]
                    tok = int(sample(q[None], rows[b].rng)[0])
                    qs[b].append(q)
                tokens[b].append(tok)
                if i < ks[b] - 1:
                    feed.append(j)
            if not feed:
                break
            step_logits = self.draft.step(slots[feed], [[tokens[active[j]][-1]] for j in feed])  # [F, 1, V]
            for f, j in enumerate(feed):
                logits[j] = step_logits[f, 0]
                rows[active[j]].draft_seen.append(tokens[active[j]][-1])
        out = []
        for b in range(len(rows)):
            if b in tokens:
                out.append(Proposal(np.array(tokens[b], np.int64), np.stack(qs[b]) if qs[b] else None))
            else:
                out.append(Proposal(np.zeros(0, np.int64), None))
        return out

    # ---- output ------------------------------------------------------------------------------
    def _emit(self, row: _Row, new: list[int]) -> SequenceUpdate:
        """Apply EOS, stop ids, stop strings and the length limit to new tokens (as ``Runtime.stream``)."""
        events, finish = [], None
        for tok in new:
            row.out.append(tok)
            row.seq.append(tok)
            if tok in row.end_ids:
                finish = "stop"
                events.append(StreamEvent(tok, ""))
                break
            text = row.stops.feed(row.detok.add(tok))
            row.text += text
            finish = "stop" if row.stops.hit else ("length" if len(row.out) >= row.limit else None)
            events.append(StreamEvent(tok, text))
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

    def stats_for(self, row: _Row) -> dict:
        rounds = max(row.rounds, 1)
        return {"method": self.config.method, "new_tokens": len(row.out), "target_passes": row.target_passes,
                "proposed": row.proposed, "accepted": row.accepted,
                "acceptance_rate": row.accepted / row.proposed if row.proposed else 0.0,
                "rounds": row.rounds, "tokens_per_pass": (row.accepted + row.rounds) / rounds}

    # ---- measurements --------------------------------------------------------------------------
    def calibrate(self, past: int | None = None, reps: int = 3) -> None:
        """Time target passes of B·Q positions for B = 1, 2, 4, .., max_batch and Q = 1, γmax+1 (and draft
        passes at Q = 1) on stale cache entries of length ``past``; the fastest of ``reps`` runs (after a
        warm-up) goes into the policy's curves, so a burst of other load does not skew them. Only while idle."""
        if self.rows:
            raise RuntimeError("calibrate only while no sequence is active")
        g = self.runtime.gamma_max
        past = min(past or 32, self.max_len - g - 1)
        sizes = sorted({*(2 ** i for i in range(self.config.max_batch.bit_length())), self.config.max_batch})
        for model, qs, record in ((self.target, (1, g + 1), self.policy.record_target),
                                  (self.draft, (1,), self.policy.record_draft)):
            if model is None:
                continue
            for b in sizes:
                slots = np.arange(b)
                model.lengths[:b] = past
                for q in qs:
                    ids = np.zeros((b, q), np.int64)
                    model.run(slots, ids, record=False)  # warm-up
                    times = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        model.run(slots, ids, record=False)
                        times.append(time.perf_counter() - t0)
                    record(b, q, min(times))
            model.lengths[:] = 0
