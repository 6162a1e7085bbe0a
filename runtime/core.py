"""The decode core: every method, batched, from one step function.

``DecodeCore`` is built from explicit parts: the target's runner (its cache of ``max_batch``
slots), one proposer per method it serves (runtime/proposers/__init__.py's ``Proposer``; each row
runs its request's method, "none" always available) and a batch-aware γ policy per method, the
stop rules (EOS ids, the tokenizer for stop strings) and the limits (cache length, exported γ,
vocabulary). It keeps the rows: active sequences in slots 0..B-1 (when one leaves, the last slot
moves into the hole, in the target's cache and the proposer's, so the active rows stay a
contiguous view of the cache). Per-request settings (sampling, γ, method, a compiled grammar)
travel with each ``SequenceRequest`` (runtime/core_types.py). ``Runtime.generate`` runs this core at max_batch 1 and
``specrt serve`` at max_batch N (both build it with ``Runtime.new_core``). A step:

    γ         one decision per method for its rows (runtime/batch_policy.py; 0 = plain decoding)
    propose   per row a chain of k_b <= γ tokens with q, or a tree with point masses (each method's
              proposer once for its rows); a grammar's forced tokens replace a row's proposal, and
              what a grammar forbids is cut from every proposal (runtime/proposers/constrained.py)
    verify    ONE target pass over [B, Q = max positions]: row b = its last token, its proposal,
              then padding; each row's logits processed (sampling.process_logits: penalties,
              logit_bias, min_tokens, the grammar's mask at each position's prefix) and verified by
              runtime/verify.py with its own generator
    commit    per row the cache keeps the last token and the accepted path (rollback/compaction)
    emit      EOS, stop ids, stop strings, length, a complete grammar: ``_emit``, the one implementation;
              the only place a row's grammar state advances (by the emitted tokens: a rejected
              proposal never reached it, so nothing rolls back)

Every row follows the same rules whatever the batch (first token from the prefill logits,
k_b = min(γ, budget - 1), its own random stream), so greedy rows equal plain greedy decoding
and seeded sampled rows at a fixed γ equal their batch-1 output.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from .batch_policy import CUT, NO_ROOM, PolicyConfig, PolicyDecision, SpeculationPolicy, lookup_cuts
from .gamma import AlphaEstimate
from .prefix_cache import PrefixCache
from .constraints import ConstraintError
from .core_types import CoreConfig, Limits, Row, SequenceRequest, SequenceUpdate, StepReport, StopRules
from .methods import by_method, cache_owner, fixed_gamma, parse_methods, target_feature
from .proposers import EMPTY, NoProposer, Proposal, Proposer, constrained
from .sampling import SamplingError, check_logit_bias, next_token, process_logits, top_logprobs
from .stats import sequence_stats
from .target_pass import pack, time_passes
from .text import IncrementalDetokenizer, StopMatcher, StreamEvent
from .verify import ACCEPTANCE, verify

SHADOW_ROWS = 4  # most rows a plain step scores shadow guesses for (in turns): α stays measured at any batch while
# the lookups cost a fixed ~4 rows' host time a step, not the whole batch's (at 16 rows ~0.3 ms of a ~33 ms step)


class DecodeCore:
    """Continuous batching with speculative rounds over a target runner and the proposers of its methods.

    Not thread-safe: one worker drives it (``add``, ``remove``, ``step``). Build it with
    ``Runtime.new_core`` (which makes the parts from an engine dir), or from parts of your own:
    ``proposers`` / ``policies`` map each method of ``config.method`` to its proposer / policy (a single
    one stands for the first method); "none" is added when absent.
    """

    def __init__(self, config: CoreConfig, target, proposers: dict | Proposer, policies: dict | SpeculationPolicy,
                 stops: StopRules, limits: Limits):
        check_config(config, limits.gamma_max)
        self.config = config
        self.target = target  # the target graph's runner: the cache of config.max_batch slots
        self.methods = parse_methods(config.method)  # the methods served; the first is a request's default
        self.proposers = by_method(proposers, self.methods, NoProposer())  # method -> its proposer
        self.policies = by_method(policies, self.methods, None)  # method -> its γ policy (T(B, n) costs shared)
        self.policies["none"] = self.policies.get("none") or SpeculationPolicy(
            PolicyConfig(limits.gamma_max, fixed_gamma=0), self.policy.target_cost)
        self.feature = target_feature(self.proposers)  # the target output the proposers read ("hidden" | ...)
        self.stops = stops
        self.max_len, self.gamma_max, self.vocab_size = limits.max_len, limits.gamma_max, limits.vocab_size
        self.rows: list[Row] = []  # rows[i].slot == i
        self.prefix = PrefixCache(target, cache_owner(self.proposers, self.proposer), config.max_batch,
                                  config.prefix_cache, host_mb=config.prefix_cache_mb)  # what free slots keep
        self.served = AlphaEstimate()  # α over the sequences served: a new sequence starts from it
        self._probes = 0  # tree probes so far (each probes one row, in turn)
        self._shadow_turn = 0  # steps that scored shadows so far (which SHADOW_ROWS rows are next)
        if config.calibrate and set(self.proposers) != {"none"}:
            self.calibrate()

    @property
    def proposer(self) -> Proposer:
        """The first method's proposer (a one-method core's only one)."""
        return self.proposers[self.methods[0]]

    @property
    def policy(self) -> SpeculationPolicy:
        """The first method's policy (their target pass costs are one and the same)."""
        return self.policies[self.methods[0]]

    def fixed_gamma(self, gamma: int | None, method: str | None = None) -> int | None:
        """``fixed_gamma`` for ``method`` (None: the first) and its proposer."""
        method = method or self.methods[0]
        return fixed_gamma(method, self.proposers[method], gamma)

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
        cached = self.prefix.claim(ids, rows[0].slot, len(rows), rows[0].proposer)  # tokens a kept slot holds
        logits, hidden = self.target.prefill(rows[0].slot, ids[cached:], self.feature)  # [V], [P', F] | None
        rows[0].counts.target_passes += self.target.prefill_calls(len(ids) - cached)
        updates = []
        for row in rows:
            row.counts.cached_tokens = cached
            if row is not rows[0]:
                for runner in self.prefix.runners:  # the target's cache and the proposer's, as far as they go
                    runner.copy(rows[0].slot, row.slot)
            self.rows.append(row)
            x = process_logits(logits[None], row)  # [1, V]
            tok = next_token(x[0], row.params, row.rng)
            updates.append(self._emit(row, [tok], self._logprobs(row, x, [0], [tok])))
        for row, update in zip(rows, updates):
            if update.finish_reason:
                self._free(row)
            else:
                self._timed(row.proposer, row.proposer.start, [row], row, hidden)
        return updates

    def _new_row(self, request: SequenceRequest, slot: int) -> Row:
        params, ids, method = request.params, list(request.prompt_ids), self._check_request(request)
        return Row(request=request, slot=slot, seq=ids, prompt_len=len(ids), method=method,
                   proposer=self.proposers[method], matcher=request.grammar.matcher() if request.grammar else None,
                   limit=min(params.max_new_tokens, self.max_len - len(ids)), rng=np.random.default_rng(params.seed),
                   end_ids=set(self.stops.eos_ids) | set(params.stop_token_ids),
                   detok=IncrementalDetokenizer(self.stops.tokenizer),
                   stops=StopMatcher(params.stop), alpha=AlphaEstimate(state=self.served.export_state()))

    def _check_request(self, request: SequenceRequest) -> str:
        """The request's method; SamplingError for a method this core does not serve or a logit_bias id outside
        the vocabulary, ConstraintError for a grammar compiled for another vocabulary."""
        method = request.method or self.methods[0]
        if method not in self.proposers:
            raise SamplingError(f"method {method!r} is not served here; available: {', '.join(self.proposers)}")
        if self.vocab_size is not None:
            check_logit_bias(request.params.logit_bias, self.vocab_size)
            if request.grammar is not None and request.grammar.space.vocab_size != self.vocab_size:
                raise ConstraintError(f"the grammar was compiled for a vocabulary of {request.grammar.space.vocab_size}"
                                      f" tokens, the model has {self.vocab_size}")
        return method

    def remove(self, request_id: str) -> bool:
        """Drop a request's sequence now (cancellation): its slot and cache are free on return."""
        for row in self.rows:
            if row.request.request_id == request_id:
                self._free(row)
                return True
        return False

    def _free(self, row: Row) -> None:
        kept = self.prefix.retain(row)  # what its slot holds, asked before the proposer forgets the row
        row.proposer.finish(row)
        last = self.rows.pop()
        if last is not row:  # the last slot moves into the hole: active slots stay 0..B-1
            self.prefix.move_row(last.slot, row.slot, kept)
            last.slot = row.slot
            self.rows[row.slot] = last
        self.prefix.release(len(self.rows), kept)  # the freed slot keeps the leaving row's caches for later prompts

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> tuple[list[SequenceUpdate], StepReport | None]:
        """One round for every active sequence; finished sequences leave their slots."""
        if not self.rows:
            return [], None
        t0, engine0 = time.perf_counter(), self.target.engine_seconds
        rows = list(self.rows)
        decisions, gammas, ks = self._plan(rows)
        proposals, work = self._propose(rows, ks)  # work: method -> [rows it proposed for, seconds]
        proposals, decisions = self._cut(rows, proposals, decisions)  # what the proposals pay for of the pass
        shadows = self._shadows(rows, decisions, proposals)  # per row: its idle lookup proposer's guess, or None
        out = self.target.forward(*pack(rows, proposals), counts=[p.positions for p in proposals])  # ONE target
        # pass: logits [B, Q, V] (a runner that packs chains: [1, N, V], no padding)
        verified = [self._verify(row, p, out.row(b)[: p.positions]) for b, (row, p) in enumerate(zip(rows, proposals))]
        keeps, news, logprobs = (list(column) for column in zip(*verified))  # per row: kept positions, tokens, logprobs
        for row, gamma, p, keep in zip(rows, gammas, proposals, keeps):
            self._record(row, gamma, p, len(keep) - 1)
        self.target.commit(out, keeps)
        updates = [self._emit(row, new, lp) for row, new, lp in zip(rows, news, logprobs)]
        self._observe(rows, updates, news, keeps, out, work)
        self._score_shadows(rows, shadows, news)
        for row, update in reversed(list(zip(rows, updates))):  # the last slot first: a leaving row's hole is
            if update.finish_reason:  # filled by moving the last row, which must not be one that leaves too
                self._free(row)
        decision = decisions[next(m for m in self.proposers if m in decisions)]
        tokens, seconds, positions = sum(map(len, news)), time.perf_counter() - t0, out.positions
        self._account(rows, decisions, tokens, seconds, self.target.engine_seconds - engine0)
        return updates, StepReport(
            batch_size=len(rows), gamma=max(d.gamma for d in decisions.values()), decision=decision,
            positions=positions, tokens=tokens,
            proposed=sum(len(p.tokens) for p in proposals), accepted=sum(len(k) - 1 for k in keeps),
            seconds=seconds, decisions=decisions)

    def _account(self, rows: list[Row], decisions: dict, tokens: int, seconds: float, engine: float) -> None:
        """Each method's policy learns what the whole step realized (host + engine: its guard's evidence),
        keyed by its rows' count (a core serving several methods: the step's figures are shared)."""
        for method, decision in decisions.items():
            count = sum(row.method == method for row in rows)
            self.policies[method].record_step(count, decision.gamma > 0, tokens, seconds, engine)

    def _plan(self, rows: list[Row]) -> tuple[dict, list[int], list[int]]:
        """Per method among the rows its policy's decision; per row its γ and proposal size k_b (0: none)."""
        methods = dict.fromkeys(r.method for r in rows)  # those with rows, in row order
        decisions = {m: self._decide(m, [r for r in rows if r.method == m]) for m in methods}
        gammas = [self._row_gamma(row, decisions[row.method]) for row in rows]
        ks = [self._room(row, g) for row, g in zip(rows, gammas)]
        for method, decision in decisions.items():
            if decision.reason == "probe" and self.proposers[method].tree:  # a tree probe costs B·N positions:
                self._probes += 1  # probe one row of the method
                group = [b for b, row in enumerate(rows) if row.method == method]
                ks = [0 if b in group and b != group[self._probes % len(group)] else k for b, k in enumerate(ks)]
        return decisions, gammas, ks

    def _decide(self, method: str, rows: list[Row]) -> PolicyDecision:
        """The policy's decision for the rows of ``method``."""
        fixed = self._step_fixed_gamma(method, rows)
        if fixed is not None or any(self._room(r, self.gamma_max) for r in rows):
            return self.policies[method].decide([r.alpha.alpha for r in rows], fixed)
        # no row can draft (its last token, a full cache): the adaptive policy is not asked, so its
        return NO_ROOM  # probes land on steps that can use them (every 8th step aliases on short requests)

    def _propose(self, rows: list[Row], ks: list[int]) -> tuple[list[Proposal], dict]:
        """Per row its proposal: its method's (one proposer call per method, for its rows with k_b > 0), cut where
        its grammar forbids a token, or the grammar's forced tokens where they say more (constrained.py); and per
        method [rows, seconds]."""
        forced = [self._forced(row) for row in rows]  # None: nothing forced
        proposals = [f if constrained.forced_first(f, k, row.proposer) else None for f, k, row in zip(forced, ks, rows)]
        work = {}
        for method, proposer in self.proposers.items():
            group = [b for b, row in enumerate(rows) if row.method == method and ks[b] and proposals[b] is None]
            if group:  # (no row drafts, γ = 0 or no room: no proposer call)
                members = [rows[b] for b in group]
                got, seconds = self._timed(proposer, proposer.propose, members, members, [ks[b] for b in group])
                work[method] = [len(group), seconds]
                for b, p in zip(group, got):
                    proposals[b] = constrained.with_forced(constrained.prune(p, rows[b].matcher), forced[b])
        return [EMPTY if p is None else p for p in proposals], work

    def _cut(self, rows: list[Row], proposals: list[Proposal], decisions: dict) -> tuple[list[Proposal], dict]:
        """The lookup proposals (point-mass chains the policy chose γ for) cut to the lengths whose pass pays best now
        that their lengths are known (``chain_cut``: one row's long match does not pay for every row's padding; on
        a target that packs rows, ``packed_cuts``: per row, each paying its own positions); a method whose rows are
        all cut to nothing runs a plain step (reason "cut"). Other rows (a fixed γ, a probe, forced tokens, a sampled
        draft) run whole; with a tree in the pass nothing is cut."""
        if any(p.tree is not None for p in proposals) or not any(len(p.tokens) for p in proposals):
            return proposals, decisions
        free = [p.q is None and not p.forced and row.request.gamma is None and decisions[row.method].reason == "policy"
                for row, p in zip(rows, proposals)]
        if not any(free) or not self.policy.target_cost:
            return proposals, decisions
        lengths = [len(p.tokens) for p in proposals]
        alphas = [self.policies[row.method].kinds.alpha(p.kind, row.alpha.alpha) for row, p in zip(rows, proposals)]
        cuts = lookup_cuts(lengths, alphas, free, self.policy.target_cost.seconds, self.target.packs,
                           self.policy.config.min_gain)
        if all(c >= k for c, k in zip(cuts, lengths)):
            return proposals, decisions
        proposals = [replace(p, tokens=p.tokens[:c]) if f else p for p, f, c in zip(proposals, free, cuts)]
        speculating = {row.method for row, p in zip(rows, proposals) if len(p.tokens)}
        return proposals, {m: d if m in speculating or d.gamma == 0 else CUT for m, d in decisions.items()}

    def _shadows(self, rows: list[Row], decisions: dict, proposals: list[Proposal]) -> list[Proposal | None]:
        """Per row the one-token proposal its proposer would make, for the rows of a ``shadow`` proposer (a lookup of no
        model cost) whose policy chose a plain step (not a fixed γ, theirs or the config's; not the guard's, where
        measured rates keep speculation off, not α, and its re-measuring steps measure α) and that propose nothing
        this step, at most ``SHADOW_ROWS`` of them a step (in turns); None for the others and where the lookup (or
        the row's grammar) leaves nothing."""
        out = [None] * len(rows)
        for method, proposer in self.proposers.items():
            decision = decisions.get(method)  # None: no row of this method
            if decision is None or decision.gamma > 0 or decision.reason in ("fixed", "guard") or not proposer.shadow:
                continue
            group = [b for b, row in enumerate(rows) if row.method == method and row.request.gamma is None
                     and not len(proposals[b].tokens) and self._room(row, 1)]
            if len(group) > SHADOW_ROWS:  # in turns
                self._shadow_turn += 1
                first = self._shadow_turn * SHADOW_ROWS % len(group)
                group = sorted((group + group)[first: first + SHADOW_ROWS])
            guesses = proposer.propose([rows[b] for b in group], [1] * len(group)) if group else []
            for b, p in zip(group, guesses):
                p = constrained.prune(p, rows[b].matcher)
                out[b] = p if len(p.tokens) else None
        return out

    def _score_shadows(self, rows: list[Row], shadows: list[Proposal | None], news: list) -> None:
        """A shadow token x counts as one proposed token (of its kind), accepted iff the step emitted x: the chance is
        p(x), the target's (processed) probability of x, which is what verifying the point-mass proposal x would
        accept with (greedy: x is the argmax). So the α estimates the policy reads stay unbiased while
        speculation is off, without probe steps."""
        for row, p, new in zip(rows, shadows, news):
            if p is not None:
                n = int(new[0] == p.tokens[0])
                row.alpha.update(1, n)
                self.served.update(1, n)
                self.policies[row.method].kinds.update(p.kind, 1, n)

    def _forced(self, row: Row) -> Proposal | None:
        """The grammar's forced tokens as a chain of at most γmax, the row's budget - 1 and its cache room; None
        without a grammar, with γ 0 asked, or nothing forced."""
        if row.matcher is None or row.request.gamma == 0 or not self.config.forced_tokens:
            return None
        return constrained.forced(row.matcher, min(self.gamma_max, row.budget - 1, self.target.room(row.slot) - 1))

    def _observe(self, rows: list[Row], updates: list, news: list, keeps: list, out, work: dict) -> None:
        """Medusa / EAGLE continue from the target's features at each row's kept nodes; a tree method's proposer
        work of the step (propose + observe) is its policy's D(B)."""
        for b, (row, update) in enumerate(zip(rows, updates)):
            if row.proposer.feature is not None and not update.finish_reason:
                hidden = out.row(b, self.feature)[keeps[b]]  # [n + 1, F]: "hidden" (H) or EAGLE-3's "aux_hidden"
                seconds = self._timed(row.proposer, row.proposer.observe, [row], row, news[b], hidden)[1]
                if row.method in work:
                    work[row.method][1] += seconds
        for method, (count, seconds) in work.items():
            if self.proposers[method].tree:
                self.policies[method].record_draft(count, 1, seconds)

    def _verify(self, row: Row, p: Proposal, logits: np.ndarray) -> tuple[np.ndarray, list[int], list | None]:
        """One row's verification over its logits [k + 1, V]: (the positions its cache keeps, the tokens
        it emits, their logprobs if asked). Token j of the emitted ones came from kept position j."""
        if row.matcher is not None or row.params.processed:  # each position processed with its own history
            logits = process_logits(logits, row, p.prefixes())
        path, nxt = verify(p, logits, row.params, row.rng, self.config.acceptance)
        if p.tree is None:  # a chain keeps its first n + 1 positions: the last token and n accepted
            keep, new = np.arange(len(path) + 1), [*p.tokens[: len(path)].tolist(), nxt]
        else:  # a tree keeps the root and the accepted path
            keep, new = np.concatenate([[0], path]), [*p.tokens[path - 1].tolist(), nxt]
        return keep, new, self._logprobs(row, logits, keep, new)

    def _step_fixed_gamma(self, method: str, rows: list[Row]) -> int | None:
        """The fixed γ of a method's rows: their own when they all ask the same one, else the config's (None: the
        policy)."""
        own = {row.request.gamma for row in rows}
        if len(own) == 1 and None not in own:
            return self.fixed_gamma(own.pop(), method)
        return self.policies[method].config.fixed_gamma

    def _row_gamma(self, row: Row, decision: PolicyDecision) -> int:
        """A row's γ this step: its request's own, else its method's decision."""
        return decision.gamma if row.request.gamma is None else self.fixed_gamma(row.request.gamma, row.method)

    def _room(self, row: Row, gamma: int) -> int:
        """The proposal size this row may take: k tokens of a chain, or 1 = "a tree fits" (0: none)."""
        if gamma == 0 or row.budget <= 1:
            return 0
        room = self.target.room(row.slot) - 1  # positions after the root
        if row.proposer.tree:
            return int(room >= row.proposer.max_nodes)
        return max(0, min(gamma, row.budget - 1, room))

    def _record(self, row: Row, gamma: int, p: Proposal, n: int) -> None:
        c = row.counts
        c.target_passes += 1
        if p.forced:  # the grammar's tokens, not the method's: counted apart, no acceptance estimate
            row.forced += len(p.tokens)
            row.forced_accepted += n
            return
        if p.tree is not None:
            k = p.tree.depth
            c.record(k, n, p.tree.size)
        elif row.proposer.tree:
            c.fallback_steps += 1
            return
        else:
            k = len(p.tokens)
            c.record(k, n)
            c.gamma_history.append(gamma)
        row.alpha.update(k, n)
        self.served.update(k, n)
        self.policies[row.method].kinds.update(p.kind, k, n)

    def _timed(self, proposer: Proposer, fn, rows, *args):
        """Run a call of ``proposer``; its wall time and graph calls count for each of ``rows``.
        Returns (the call's result, its seconds)."""
        t0, passes = time.perf_counter(), proposer.passes
        result = fn(*args)
        dt, dp = time.perf_counter() - t0, proposer.passes - passes
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
        """Apply EOS, stop ids, stop strings, the length limit and a complete grammar to new tokens; the row's
        grammar state advances by each token emitted (and only here)."""
        events, finish = [], "stop" if grammar_complete(row) else None  # (a grammar that took the empty output)
        for i, tok in enumerate([] if finish else new):
            row.out.append(tok)
            row.seq.append(tok)
            lp, top = logprobs[i] if logprobs else (None, None)
            if tok in row.end_ids:
                finish = "stop"
                events.append(StreamEvent(tok, "", lp, top))
                break
            if row.matcher is not None:
                row.matcher.advance([tok])
            text = row.stops.feed(row.detok.add(tok))
            row.text += text
            done = row.stops.hit or grammar_complete(row)
            finish = "stop" if done else ("length" if len(row.out) >= row.limit else None)
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
        cost = self.policy.target_cost
        stats = sequence_stats(row.counts, row.method, len(row.out), row.proposer,
                               (lambda n: cost.seconds(1, n)) if cost else (lambda n: 0.0), self.gamma_max, acceptance,
                               lossy=acceptance == "typical" and row.method == "medusa" and not row.params.greedy)
        if row.method != "none":
            stats["alpha_estimate"] = row.alpha.alpha  # the decayed estimate the policy used last
        if row.matcher is not None:  # forced: grammar-forced tokens proposed (not in proposed / accepted)
            stats.update(forced=row.forced, forced_accepted=row.forced_accepted,
                         grammar_mask_seconds=row.matcher.mask_seconds)
        return stats

    # ---- measurements --------------------------------------------------------------------------
    def calibrate(self, past: int | None = None, reps: int = 3) -> None:
        """Time target passes for B = 1, 2, 4, .., max_batch (Q = 1..γmax+1 at B = 1; Q = 1, γmax+1 or
        the tree size above) and draft passes at Q = 1, on stale cache entries of length ``past``. The
        fastest of ``reps`` runs after a warm-up goes into the costs (plain passes first: a verify pass is priced
        beyond its rows'), the shapes taking turns (a burst of other load does not skew them); shapes the costs
        already hold are skipped. Only while idle."""
        if self.rows:
            raise RuntimeError("calibrate only while no sequence is active")
        self.prefix.clear()  # the timed passes write into the slots
        g = self.gamma_max
        chains = any(not p.tree for m, p in self.proposers.items() if m != "none")
        tops = {g + 1} if chains else set()  # the largest pass of each method: its chain or its tree
        tops |= {p.max_nodes + 1 for p in self.proposers.values() if p.tree}
        past = max(0, min(past or 32, self.max_len - max(tops) - 1))
        sizes = sorted({*(2 ** i for i in range(self.config.max_batch.bit_length())), self.config.max_batch})
        def target_qs(b: int):
            return sorted({*range(1, g + 2), *tops} if b == 1 and chains else {1, *tops})

        plan = [(self.target, self.policy.target_cost, target_qs)]
        draft = self.proposers.get("draft")
        if draft is not None and draft.runner is not None:  # (a caller's own proposer may have no draft model)
            plan.append((draft.runner, self.policies["draft"].proposer_cost, lambda b: (1,)))
        for runner, cost, shapes in plan:
            todo = [(b, q) for b in sizes for q in shapes(b) if not cost.known(b, b * q)]
            todo.sort(key=lambda s: s[1] > 1)  # plain passes first (stable: sizes ascending)
            for (b, q), seconds in time_passes(runner, todo, past, reps).items():
                cost.record(b, b * q, seconds)
            for slot in range(max(sizes)):
                runner.set_length(slot, 0)


def check_config(config: CoreConfig, gamma_max: int) -> None:
    """A clear error for a bad size, γ or acceptance rule (the method: ``methods.check_method``)."""
    if config.max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {config.max_batch}")
    if config.prefix_cache_mb < 0:
        raise ValueError(f"prefix_cache_mb must be >= 0 (0 = no host-memory tier), got {config.prefix_cache_mb}")
    if config.gamma is not None and not 0 <= config.gamma <= gamma_max:
        raise SamplingError(f"gamma must be in 0..{gamma_max} or None for the policy, got {config.gamma}")
    methods = set(parse_methods(config.method)) - {"none"}
    if config.suffix_corpus is not None and "suffix" not in methods:
        raise SamplingError(f"a suffix corpus is for method 'suffix'; the methods served are {config.method!r}")
    if config.acceptance not in ACCEPTANCE or (config.acceptance != "exact" and methods != {"medusa"}):
        raise SamplingError(f"acceptance must be one of {', '.join(ACCEPTANCE)} ('typical' is lossy and only for "
                            f"method 'medusa'), got {config.acceptance!r} with method {config.method!r}")


def grammar_complete(row: Row) -> bool:
    """The row's grammar allows nothing more (complete, and the model has no EOS id to say so)."""
    return row.matcher is not None and row.matcher.exhausted
