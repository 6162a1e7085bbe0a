"""The batch-aware speculation policy: per step, choose γ (0 = off) from the batch size and measured costs.

Speculation and batching draw on the same spare arithmetic (see the reference text's batching
caveat): a step that verifies γ+1 positions for each of B sequences processes n = B·(γ+1)
positions, and once n crosses the hardware's ridge the extra positions stop being free.
TensorRT-LLM's ``draft_len_schedule`` and vLLM's ``disable_by_batch_size`` encode that by hand
(a table batch size -> γ, a batch size above which speculation is off). Here it is computed,
every step, from measurements:

    T(B, n)   measured seconds of one target pass of B rows over n positions in all (``PassCost``; T(B) = T(B, B))
    D(B)      measured seconds of one draft step at batch B (0 for n-gram lookup)
    α_b       each sequence's measured acceptance rate (a lookup's proposals of a ``kind``, n-gram's match length:
              that kind's, ``gamma.KindAlphas``, once made; before, the best kind's: proposing costs nothing)

    throughput(γ) = Σ_b E[tokens](α_b, γ) / (T(B, B·(γ+1)) + γ·D(B))     E = (1 - α^(γ+1)) / (1 - α)
    throughput(0) = B / T(B)

and the policy runs the γ in 0..γmax with the highest predicted throughput (ties: the smaller γ), where it
beats γ = 0 by at least ``MIN_GAIN`` (a smaller gain is within the measurements' noise and does not pay for what
the prediction leaves out: a batch whose rows speculation advanced unevenly ends on steps of fewer rows).
A measured ``speculation_max_batch`` (manifest ``defaults``, written by profiling) caps it:
speculation is off above that batch size whatever the prediction says.

The prediction leaves out what a step costs besides its engine calls (proposing, verification
bookkeeping, masks, rows with nothing to propose padded into the pass) and trusts α estimates that
lag, so a guard checks it against what steps realize (``RealizedRates``): per batch size the
whole-step tokens/s (host + engine: tokens, host time and engine time per step measured, the engine
time relative to T(B) then) of speculative steps and of plain steps; where
speculative steps realize less than ``MIN_GAIN`` times plain's, the step is plain (reason "guard") and every
``probe_every``-th
such step (doubling, up to 4x, while it keeps losing) the speculative rate is measured afresh,
so speculation comes back once it pays. Plain
steps are spent only where speculative ones do not already beat ``MIN_GAIN`` · B / T(B) (a plain step's engine
call alone), and then re-measured every ``probe_every`` speculative steps.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .gamma import KindAlphas, expected_tokens
from .pass_cost import PassCost, batch_bucket

PassSeconds = Callable[[int, int], float]  # (rows, positions in all) -> seconds of one target pass (PassCost.seconds)

MIN_GAIN = 1.1  # tokens/s speculation must be predicted (and, under the guard, measured) to reach, as a multiple of
# plain decoding's, to run: below it, timing noise and what the prediction leaves out outweigh the gain


@dataclass(frozen=True)
class PolicyDecision:
    gamma: int  # draft length for this step (0 = speculation off)
    predicted_speedup: float  # predicted throughput at gamma / throughput at γ = 0 (1.0 when off)
    reason: str  # "policy" (chosen by prediction) | "cap" (batch above speculation_max_batch) | "probe" | "fixed"
    # | "room" (no sequence could draft this step: the policy was not asked) | "guard" (plain: measured
    # speculative steps realize fewer tokens/s than plain ones, or a plain step to keep that measured) | "cut"
    # (plain: the rows' proposals, once made, were too short or too few to pay for the pass, ``chain_cut``)


NO_ROOM = PolicyDecision(0, 1.0, "room")
CUT = PolicyDecision(0, 1.0, "cut")
REASONS = ("policy", "probe", "cap", "fixed", "room", "guard", "cut")  # every PolicyDecision.reason (/metrics labels)


class RealizedRates:
    """Measured tokens per second of whole steps (host + engine), per batch size, plain vs speculative.

    Per (bucket of batch sizes, speculative) decayed sums over steps of tokens per row, engine time relative to
    what the pass costs said a plain step at that batch size cost then (``reference``, T(B)), host seconds and
    engine seconds. A rate at batch B puts what does not move with the machine's load or the rows' context
    lengths (tokens per row, relative engine time, host time as a fraction of engine time) over the current cost
    of a plain step:

        rate(B) = B · tokens per row / (T(B) · relative engine time · (1 + host / engine))

    so two arms measured minutes apart, under different load or at other context lengths, still compare (the
    costs of the passes only speculative steps run are not read: they lag), and evidence carries over
    between nearby batch sizes (buckets 1, 2, 3-4, 5-8, 9-16, ...: a server's batch shrinks one by one as its
    requests finish, and each size measured afresh would cost every size its own losing steps). Known once
    ``min_steps`` steps were recorded; one step's host seconds count at most ``spike`` times the
    arm's mean (a preempted step does not swing the guard).

        r = RealizedRates()
        for _ in range(3):
            r.record(4, False, tokens=4, seconds=0.011, engine=0.010, reference=0.010)  # plain: 10% host
            r.record(4, True, tokens=6, seconds=0.033, engine=0.030, reference=0.010)  # speculative: 3x the engine
        T = lambda b: 0.010  # a plain step's engine cost now
        r.rate(4, True, T) < r.rate(4, False, T)  # -> True (182 < 364 tok/s): speculation does not pay
    """

    def __init__(self, decay: float = 0.8, spike: float = 3.0, min_steps: int = 3):
        self.decay, self.spike, self.min_steps = decay, spike, min_steps
        self.arms: dict[tuple[int, bool], list] = {}  # (batch_bucket, speculative) -> [tokens per row, relative
        # engine time, host, engine, weight] decayed, and the number of steps recorded

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float, engine: float,
               reference: float) -> None:
        """One step: ``tokens`` emitted in ``seconds`` (wall), ``engine`` of them in engine calls, when the pass
        costs gave a plain step at this batch size ``reference`` seconds."""
        arm = self.arms.setdefault((batch_bucket(batch), speculative), [0.0, 0.0, 0.0, 0.0, 0.0, 0])
        host = max(0.0, seconds - engine)
        if arm[5]:
            host = min(host, self.spike * arm[2] / arm[4])
        d = self.decay
        for i, x in enumerate((tokens / batch, engine / max(reference, 1e-12), host, engine, 1.0)):
            arm[i] = d * arm[i] + x
        arm[5] += 1

    def rate(self, batch: int, speculative: bool, target_seconds: Callable[[int], float]) -> float | None:
        """Tokens/s of the arm at this batch size at the engine cost ``target_seconds`` (B -> seconds of a plain
        pass of B rows) says now; None before ``min_steps`` steps."""
        arm = self.arms.get((batch_bucket(batch), speculative))
        if arm is None or arm[5] < self.min_steps:
            return None
        tokens, relative, host, engine, weight, _ = arm
        t = target_seconds(batch) * relative / weight
        cost = t * (1 + host / engine) if engine > 0 else t + host / weight
        return batch * tokens / weight / max(cost, 1e-12)

    def forget(self, batch: int, speculative: bool) -> None:
        """Drop an arm's evidence at ``batch``'s bucket (it is measured afresh)."""
        self.arms.pop((batch_bucket(batch), speculative), None)


def step_throughput(gamma: int, alphas: Sequence[float], target_seconds: PassSeconds,
                    draft_seconds: Callable[[int], float], tree: tuple[int, int] | None = None) -> float:
    """Predicted tokens per second of one step that runs every sequence at draft length ``gamma``.

    tree: (nodes N, depth D) of a tree method, whose one speculative choice (γ = 1) verifies its
    whole tree: E(α, D) tokens per row for T(B·N) + the proposer's D(B) (the heads or the drafting).
    """
    b = len(alphas)
    if gamma == 0:
        return b / max(target_seconds(b, b), 1e-12)
    if tree is None:
        tokens = sum(expected_tokens(a, gamma) for a in alphas)
        cost = target_seconds(b, b * (gamma + 1)) + gamma * draft_seconds(b)
    else:
        nodes, depth = tree
        tokens = sum(expected_tokens(a, depth) for a in alphas)
        cost = target_seconds(b, b * nodes) + draft_seconds(b)
    return tokens / max(cost, 1e-12)


def choose_gamma(alphas: Sequence[float], gamma_max: int, target_seconds: PassSeconds,
                 draft_seconds: Callable[[int], float], speculation_max_batch: int | None = None,
                 tree: tuple[int, int] | None = None, min_gain: float = MIN_GAIN, packed: bool = False) -> PolicyDecision:
    """The γ in 0..gamma_max (a tree method: 0 or 1 = its tree) with the highest predicted throughput for
    this batch (one α per sequence), if that beats γ = 0's by ``min_gain``; else 0.

    Pure: everything it uses is an argument. ``speculation_max_batch``: above this batch size
    the answer is 0 (a measured cap; None = no cap). ``packed``: the pass packs rows (each pays its own positions,
    ``packed_cuts``) and proposals cost no draft passes (a lookup): the γ is the longest chain the best subset
    of rows' chains takes, rows of higher α first.
    """
    if not alphas:
        return PolicyDecision(0, 1.0, "policy")
    if speculation_max_batch is not None and len(alphas) > speculation_max_batch:
        return PolicyDecision(0, 1.0, "cap")
    if packed and tree is None:
        b = len(alphas)
        cuts, gain = packed_cuts([gamma_max] * b, alphas, lambda m: target_seconds(b, b + m), min_gain=min_gain)
        return PolicyDecision(max(cuts), gain, "policy")
    choices = range(gamma_max + 1) if tree is None else range(2)
    rates = [step_throughput(g, alphas, target_seconds, draft_seconds, tree) for g in choices]
    best = int(np.argmax(rates))  # first maximum: the smaller γ on ties
    if rates[best] < min_gain * rates[0]:
        return PolicyDecision(0, 1.0, "policy")
    return PolicyDecision(best, rates[best] / rates[0], "policy")


def chain_cut(lengths: Sequence[int], alphas: Sequence[float], target_seconds: PassSeconds,
              floor: int = 0, min_gain: float = MIN_GAIN) -> int:
    """How many of its proposed tokens each row verifies this step, decided once the proposals are made: the
    c in floor..max(lengths) with the highest predicted tokens per second of the pass, where that beats the
    floor's by ``min_gain`` (else the floor).

    ``choose_gamma`` prices a step as if every row proposed γ tokens. A lookup proposer (n-gram, suffix) proposes
    what its match gives: 0..γ tokens per row. The pass still verifies every row at the longest chain's length (the
    shorter ones padded), so B rows cost T(B, B·(c+1)) for Σ_b E[tokens](α_b, min(k_b, c)). ``floor``: a length no
    cut goes below (rows whose chain must run whole: a fixed γ, a grammar's forced tokens, a sampled draft).

        >>> T = lambda b, n: 0.004 + 0.001 * n  # seconds of a pass of b rows over n positions
        >>> chain_cut([8, 0, 0, 0], [0.9] * 4, T)  # one row's long match does not pay for four rows' padding
        0
        >>> chain_cut([8, 8, 8, 8], [0.9] * 4, T), chain_cut([8], [0.9], T)
        (3, 7)
    """
    b = len(lengths)
    rates = [sum(expected_tokens(a, min(k, c)) for k, a in zip(lengths, alphas))
             / max(target_seconds(b, b * (c + 1)), 1e-12) for c in range(floor, max([floor, *lengths]) + 1)]
    best = int(np.argmax(rates))  # first maximum: the shorter cut on ties
    return floor + best if rates[best] >= min_gain * rates[0] else floor


def packed_cuts(lengths: Sequence[int], alphas: Sequence[float], pass_seconds: Callable[[int], float],
                fixed: Sequence[bool] = (), min_gain: float = MIN_GAIN) -> tuple[list[int], float]:
    """``chain_cut`` for a pass that packs rows (each row pays for its own positions, no padding; ``pass_seconds``:
    m -> seconds of the pass with m positions beyond each row's one, T(B, B + m), elementwise on an array of m): per
    row how many of its ``lengths`` proposed tokens it verifies, and the predicted tokens/s over the plain pass's.

    Token j of row b's chain adds one position and α_b^j expected tokens (E[tokens](α, c) grows by α^(c+1)), so
    the chains' tokens are taken best first, as long as the pass's predicted tokens per second grows; the cuts
    stand where they beat the plain pass (only the rows in ``fixed``, which run whole: a fixed γ, forced tokens, a
    sampled draft) by ``min_gain``, else every other row verifies none.

        >>> T = lambda m: 0.008 + 0.001 * m  # four rows, m positions more
        >>> packed_cuts([8, 0, 0, 0], [0.9] * 4, T)[0]  # one row's long match pays for its own positions
        [4, 0, 0, 0]
        >>> packed_cuts([8, 8, 8, 8], [0.9, 0.9, 0.2, 0.2], T)[0]  # rows whose guesses fail verify none
        [4, 4, 0, 0]
    """
    fixed = list(fixed) or [False] * len(lengths)
    tokens = sum(expected_tokens(a, k) if f else 1.0 for k, a, f in zip(lengths, alphas, fixed))
    base = sum(k for k, f in zip(lengths, fixed) if f)
    steps = sorted(((a ** j, b) for b, (k, a, f) in enumerate(zip(lengths, alphas, fixed)) if not f
                    for j in range(1, k + 1)), reverse=True)  # (expected tokens it adds, row), best first
    plain = best = tokens / max(pass_seconds(base), 1e-12)
    taken = 0
    if steps:  # the pass taking the first m of them, m = 1, 2, ...: priced in one call (an array of counts)
        seconds = pass_seconds(base + np.arange(1, len(steps) + 1))
        rates = (tokens + np.cumsum([v for v, _ in steps])) / np.maximum(seconds, 1e-12)
        m = int(np.argmax(rates))  # the first maximum: fewer positions on ties
        if rates[m] > best:
            best, taken = float(rates[m]), m + 1
    if best < min_gain * plain:
        best, taken = plain, 0
    cuts = [k if f else 0 for k, f in zip(lengths, fixed)]
    for _, b in steps[:taken]:
        cuts[b] += 1
    return cuts, best / plain if plain > 0 else 1.0


def lookup_cuts(lengths: Sequence[int], alphas: Sequence[float], free: Sequence[bool],
                target_seconds: PassSeconds, packed: bool,
                min_gain: float = MIN_GAIN) -> list[int]:
    """Per row how many tokens of its chain the pass verifies: the ``free`` rows' (lookup chains the policy chose γ
    for) cut by ``packed_cuts`` where the pass packs rows, else all to one length by ``chain_cut``; the others whole.

        >>> T = lambda b, n: 0.004 + 0.001 * n
        >>> lookup_cuts([8, 0, 0, 0], [0.9] * 4, [True] * 4, T, packed=False)  # padding: cut to nothing
        [0, 0, 0, 0]
    """
    if packed:  # each row pays for its own positions
        b = len(lengths)
        return packed_cuts(lengths, alphas, lambda m: target_seconds(b, b + m), [not f for f in free], min_gain)[0]
    c = chain_cut(lengths, alphas, target_seconds, max([k for k, f in zip(lengths, free) if not f], default=0),
                  min_gain)  # every row pays for the longest chain's positions
    return [min(k, c) if f else k for k, f in zip(lengths, free)]


def speculation_max_batch(alpha: float, max_batch: int, gamma_max: int, target_seconds: PassSeconds,
                          draft_seconds: Callable[[int], float], tree: tuple[int, int] | None = None,
                          min_gain: float = MIN_GAIN) -> int:
    """The largest batch size <= max_batch at which ``choose_gamma`` speculates when every sequence has
    acceptance ``alpha`` (0: not even at batch 1). The measured analogue of vLLM's disable_by_batch_size."""
    largest = 0
    for b in range(1, max_batch + 1):
        if choose_gamma([alpha] * b, gamma_max, target_seconds, draft_seconds, tree=tree, min_gain=min_gain).gamma > 0:
            largest = b
    return largest


@dataclass
class PolicyConfig:
    gamma_max: int  # largest γ (the exported verify shape - 1)
    fixed_gamma: int | None = None  # run this γ every step (0 = off): forced on/off; None = the policy decides
    speculation_max_batch: int | None = None  # measured cap from the manifest's defaults (None = no cap)
    probe_every: int = 16  # steps decided at γ = 0 before one probe step at γ = 1 (keeps α measured);
    # the interval doubles after each probe that leaves speculation off (up to 4x; a tree: 16x), back on: reset
    draft_cost: bool = True  # whether proposals cost draft passes (False for n-gram lookup)
    tree: tuple[int, int] | None = None  # (nodes, depth) of a tree method: γ is 0 (plain) or 1 (verify the tree)
    guard: bool = True  # check the prediction against realized whole-step tokens/s (False: the prediction alone)
    probe: bool = True  # probe steps while off (False: α is measured without them, the proposer's ``shadow``)
    min_gain: float = MIN_GAIN  # speculation runs where predicted (and measured) tokens/s beat plain's by this factor
    packed: bool = False  # a lookup method (no draft cost) on a target that packs rows: each row pays its own positions


class SpeculationPolicy:
    """``choose_gamma`` with its measurements: the target's T(B, n) and the proposer's D(B) costs, and probing.

    D(B): a draft model's step at batch B (recorded by its runner), or a tree method's proposer
    work per step at batch B (recorded by the decode core).
    """

    def __init__(self, config: PolicyConfig, target_cost: PassCost | None = None,
                 proposer_cost: PassCost | None = None):
        self.config = config
        self.target_cost = target_cost if target_cost is not None else PassCost()  # (B, n) -> seconds of a target pass
        self.proposer_cost = proposer_cost if proposer_cost is not None else PassCost()  # B -> D(B), seconds of a
        # draft step or of a tree method's proposer work per step (read where config.draft_cost)
        self._idle_steps = 0
        self._probe_interval = config.probe_every  # steps at γ = 0 before the next probe (trees: doubling)
        self.last = PolicyDecision(0, 1.0, "policy")  # the latest decision (exposed in /metrics)
        self.kinds = KindAlphas()  # acceptance per kind of lookup guess (Proposal.kind), measured by the core
        self.realized = RealizedRates()  # whole-step tokens/s per batch size, plain vs speculative: the guard's
        self._guard_steps: dict[int, tuple] = {}  # batch_bucket -> (guarded steps on one arm since the other was
        # re-measured, steps between re-measurements: probe_every, doubling up to 4x while speculation keeps losing)

    def record_target(self, batch: int, q: int, seconds: float) -> None:
        self.target_cost.record(batch, batch * q, seconds)

    def record_draft(self, batch: int, q: int, seconds: float) -> None:
        self.proposer_cost.record(batch, batch * q, seconds)

    def record_step(self, batch: int, speculative: bool, tokens: int, seconds: float, engine: float) -> None:
        """A whole step of ``batch`` rows of this method: ``tokens`` emitted in ``seconds`` (host + ``engine``
        seconds of target calls), rated against what a plain step at ``batch`` costs now."""
        reference = self.target_cost.seconds(batch) if self.target_cost else engine
        self.realized.record(batch, speculative, tokens, seconds, engine, reference)

    def draft_seconds(self, batch: int) -> float:
        if not self.config.draft_cost or not self.proposer_cost:
            return 0.0
        return self.proposer_cost.seconds(batch)

    def decide(self, alphas: Sequence[float], fixed_gamma: int | None = None) -> PolicyDecision:
        """The γ of one step for sequences with acceptance ``alphas``; ``fixed_gamma`` (else the
        config's) forces it."""
        cfg = self.config
        fixed = cfg.fixed_gamma if fixed_gamma is None else fixed_gamma
        if fixed is not None:
            if self.last.reason != "fixed" or self.last.gamma != fixed:
                self.last = PolicyDecision(fixed, 1.0, "fixed")
            return self.last
        if not self.target_cost:  # nothing measured yet: plain decoding measures T(B)
            self.last = PolicyDecision(0, 1.0, "policy")
            return self.last
        best = self.kinds.best()  # a lookup's guesses come in kinds, each priced by its own α once made (the core's
        if best:  # cut), and cost nothing: ask for them where the best kind pays
            alphas = [max(a, best) for a in alphas]
        d = choose_gamma(alphas, cfg.gamma_max, self.target_cost.seconds, self.draft_seconds,
                         cfg.speculation_max_batch, cfg.tree, cfg.min_gain, cfg.packed)
        if d.gamma == 0 and d.reason == "policy" and cfg.gamma_max > 0 and cfg.probe:
            self._idle_steps += 1
            if self._idle_steps >= self._probe_interval:
                self._idle_steps = 0
                # a probe costs every row a padded position (a tree: B·N): back off while speculation stays off
                self._probe_interval = min(2 * self._probe_interval, (16 if cfg.tree is not None else 4) * cfg.probe_every)
                d = PolicyDecision(1, d.predicted_speedup, "probe")
        else:
            self._idle_steps = 0
            self._probe_interval = cfg.probe_every
            if d.gamma > 0 and d.reason == "policy" and cfg.guard:
                d = self._guard(len(alphas), d)
        self.last = d
        return d

    def _guard(self, batch: int, d: PolicyDecision) -> PolicyDecision:
        """The predicted speculative step ``d`` checked against measured whole steps at this batch size (its
        bucket's evidence, ``RealizedRates``): plain
        ("guard") where speculative steps realized fewer tokens/s than ``min_gain`` times plain ones', or to
        measure plain steps at all, unless they beat even that times B / T(B), a plain step's engine call alone
        (then no plain step is spent).
        Every ``probe_every`` guarded steps on one arm the other arm is forgotten and measured afresh
        (``min_steps`` steps), so either can win back; while speculation keeps losing, the interval doubles
        (up to 4x)."""
        t = self.target_cost.seconds
        spec, plain = self.realized.rate(batch, True, t), self.realized.rate(batch, False, t)
        if spec is None:  # speculation not measured (again) yet at this batch size: as predicted
            return d
        gain = self.config.min_gain
        if spec >= gain * batch / t(batch):  # faster than a plain step's engine call alone
            return d
        if plain is None:  # then plain steps, to compare
            return PolicyDecision(0, 1.0, "guard")
        key = batch_bucket(batch)
        count, interval = self._guard_steps.get(key, (0, self.config.probe_every))
        wins = spec >= gain * plain
        if wins:
            interval = self.config.probe_every
        if count + 1 > interval:  # re-measure the arm not run lately; speculation that keeps losing: less often
            self._guard_steps[key] = (0, interval if wins else min(2 * interval, 4 * self.config.probe_every))
            self.realized.forget(batch, not wins)
            return PolicyDecision(0, 1.0, "guard") if wins else d
        self._guard_steps[key] = (count + 1, interval)
        return d if wins else PolicyDecision(0, spec / plain, "guard")

    def max_speculative_batch(self, alpha: float, max_batch: int) -> int:
        """``speculation_max_batch`` under the current measurements (and the manifest's cap)."""
        if not self.target_cost:
            return 0
        b = speculation_max_batch(alpha, max_batch, self.config.gamma_max, self.target_cost.seconds,
                                  self.draft_seconds, self.config.tree, self.config.min_gain)
        cap = self.config.speculation_max_batch
        return b if cap is None else min(b, cap)
