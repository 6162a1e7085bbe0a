"""`specrt profile`'s analysis: pure functions over measured numbers (no timing, no I/O).

Everything here is unit-testable with synthetic measurements. The speedup formula is the
runtime's (``runtime/gamma.py``: E[tokens](α, γ) / (γ c + T(γ+1)/T(1))); this module applies it
to measured α, c and T(Q)/T(1), finds the ridge of the verification cost curve, the break-even
points, and recommends a method, a γ and the largest batch at which speculation still pays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...runtime.batch_policy import MIN_GAIN  # the speedup a recommendation needs: what the runtime's policy asks
from ...runtime.gamma import expected_tokens, predicted_speedup

GAMMAS = tuple(range(1, 9))  # γ values of the predicted-speedup table
CURVE_QS = (1, 2, 4, 8, 16, 32, 64)  # verified positions Q of the T(Q)/T(1) curve
RIDGE_ELASTICITY = 0.5  # d log T / d log Q where verifying more stops being nearly free (0 = free, 1 = proportional)


@dataclass
class MethodMeasurement:
    """One proposer, measured on the prompt set."""

    name: str  # method: "draft", "ngram", ...
    alpha: float | None  # per-token acceptance probability: the α at which the formula's E[tokens] equals the
    #                      measured tokens/pass (None for tree methods)
    c: float  # seconds of one proposed token / seconds of one target decode step (batch 1)
    gamma_run: int  # the fixed γ the method was run at
    measured_speedup: float | None = None  # tokens/s at gamma_run / plain tokens/s; None = not measured
    c_by_batch: dict = field(default_factory=dict)  # batch -> c at that batch; a batch missing here uses c
    tree_size: int | None = None  # tree methods (Medusa): nodes verified per pass; they have no γ
    tokens_per_pass: float | None = None  # measured; the yield a tree method's prediction uses


@dataclass
class Measurements:
    """What the recommendation is computed from."""

    gamma_max: int  # largest γ the engine dir verifies (manifest `gamma`); larger γ needs a re-export
    verify_ratio: dict  # batch -> {Q: T_B(Q) / T_B(1)}, measured; batch 1 must be present
    methods: list  # [MethodMeasurement], the methods that ran


@dataclass
class MethodPrediction:
    """The formula over γ = 1..8 for one method at batch 1, next to what was measured.

    A tree method has no γ: its lists are empty and ``tree_predicted`` is the tree's
    tokens/pass / (c + T(N)/T(1)) instead.
    """

    name: str  # method
    gammas: list  # γ values (GAMMAS)
    verify_ratio: list  # T(γ+1)/T(1) per γ, measured (interpolated only where Q was not measured)
    predicted: list  # the formula's speedup per γ with measured α, c and T(γ+1)/T(1)
    calibration: float  # measured / predicted speedup at gamma_run (1.0 when nothing was measured)
    calibrated: list  # predicted × calibration: the formula corrected for costs it does not count
    break_even_gamma: int | None  # largest γ whose predicted speedup is >= 1; None = no γ pays
    best_gamma: int | None  # γ in 1..gamma_max with the highest calibrated speedup (None: tree method)
    best_speedup: float  # calibrated speedup at best_gamma (tree methods: of the tree)
    best_gamma_any: int | None  # the same over all of GAMMAS (may need a re-export with a larger --gamma)
    break_even_alpha: float | None  # least α at which best_gamma (or gamma_run) pays; None = no α does
    tree_predicted: float | None = None  # tree methods: the predicted speedup of the tree


@dataclass
class Recommendation:
    method: str  # method to use; "none" = speculation off
    gamma: int | None  # fixed γ to run it at; None with method "none"
    predicted_speedup: float  # calibrated predicted speedup at (method, gamma); 1.0 for "none"
    speculation_max_batch: int  # largest measured batch at which it still pays; 0 = at no batch
    max_batch_is_lower_bound: bool  # it still pays at the largest batch measured: the true limit is higher
    by_batch: dict = field(default_factory=dict)  # batch -> {"gamma", "predicted_speedup"} for `method`
    reasons: list = field(default_factory=list)  # sentences explaining the choice


def ratio_at(ratios: dict, q: int) -> float:
    """T(q)/T(1) from a {Q: ratio} dict: measured, else linearly interpolated (clamped at the ends)."""
    if q in ratios:
        return float(ratios[q])
    qs = sorted(ratios)
    return float(np.interp(q, qs, [ratios[k] for k in qs]))


def ridge_q(qs, seconds) -> int | None:
    """The Q where verifying more positions stops being nearly free, from measured T(Q).

    Over the doubling points of CURVE_QS, the first segment Q -> 2Q whose elasticity
    log(T(2Q)/T(Q)) / log 2 reaches RIDGE_ELASTICITY (T grows at least as fast as √Q) starts at
    the ridge. None: cost stayed nearly flat up to the largest Q measured.
    """
    t = dict(zip(qs, seconds))
    pts = [q for q in CURVE_QS if q in t]
    if len(pts) < 2:
        return None
    q = np.array(pts, dtype=float)
    tq = np.array([t[p] for p in pts], dtype=float)
    elasticity = np.log(tq[1:] / tq[:-1]) / np.log(q[1:] / q[:-1])
    steep = np.nonzero(elasticity >= RIDGE_ELASTICITY)[0]
    return int(pts[steep[0]]) if steep.size else None


def fit_alpha(tokens_per_pass: float, mean_proposal: float) -> float:
    """The α at which E[tokens](α, k̄) equals the measured tokens per verify pass (k̄ = mean proposal length)."""
    if mean_proposal <= 0:
        return 0.0
    grid = np.linspace(0.0, 1.0, 4001)
    yields = np.array([expected_tokens(a, mean_proposal) for a in grid])  # increasing in α
    return float(np.interp(tokens_per_pass, yields, grid))


def break_even_alpha(gamma: int, c: float, verify_ratio: float) -> float | None:
    """Least α with E[tokens](α, γ) >= γ c + T(γ+1)/T(1); None if even α = 1 does not pay."""
    cost = gamma * c + verify_ratio
    if expected_tokens(1.0, gamma) < cost:
        return None
    grid = np.linspace(0.0, 1.0, 4001)
    yields = np.array([expected_tokens(a, gamma) for a in grid])
    return float(np.interp(cost, yields, grid))


def predict(m: MethodMeasurement, ratios: dict, gamma_max: int, c: float | None = None,
            calibration: float | None = None) -> MethodPrediction:
    """The formula over GAMMAS for one method with one batch's verify ratios and cost c (default m.c).

    calibration: factor applied to the formula; default measured / predicted at m.gamma_run.
    """
    c = m.c if c is None else c
    if m.tree_size is not None:
        return predict_tree(m, ratios, c, calibration)
    vr = [ratio_at(ratios, g + 1) for g in GAMMAS]
    pred = [predicted_speedup(m.alpha, g, c, r) for g, r in zip(GAMMAS, vr)]
    at_run = predicted_speedup(m.alpha, m.gamma_run, c, ratio_at(ratios, m.gamma_run + 1))
    if calibration is None:
        calibration = m.measured_speedup / at_run if m.measured_speedup is not None and at_run > 0 else 1.0
    calibrated = [p * calibration for p in pred]
    paying = [g for g, p in zip(GAMMAS, pred) if p >= 1.0]
    allowed = [i for i, g in enumerate(GAMMAS) if g <= gamma_max]
    best_i = max(allowed, key=lambda i: calibrated[i]) if allowed else None
    best_gamma = GAMMAS[best_i] if best_i is not None else None
    be_gamma = best_gamma if best_gamma is not None else m.gamma_run
    return MethodPrediction(
        name=m.name, gammas=list(GAMMAS), verify_ratio=vr, predicted=pred, calibration=calibration,
        calibrated=calibrated, break_even_gamma=max(paying) if paying else None, best_gamma=best_gamma,
        best_speedup=calibrated[best_i] if best_i is not None else 0.0,
        best_gamma_any=GAMMAS[int(np.argmax(calibrated))],
        break_even_alpha=break_even_alpha(be_gamma, c, ratio_at(ratios, be_gamma + 1)))


def predict_tree(m: MethodMeasurement, ratios: dict, c: float, calibration: float | None) -> MethodPrediction:
    """A tree method's one point: measured tokens/pass over one heads call plus one verify of N nodes."""
    pred = m.tokens_per_pass / (c + ratio_at(ratios, m.tree_size))
    if calibration is None:
        calibration = m.measured_speedup / pred if m.measured_speedup is not None and pred > 0 else 1.0
    return MethodPrediction(name=m.name, gammas=[], verify_ratio=[], predicted=[], calibration=calibration,
                            calibrated=[], break_even_gamma=None, best_gamma=None, best_speedup=pred * calibration,
                            best_gamma_any=None, break_even_alpha=None, tree_predicted=pred)


def recommend(meas: Measurements) -> tuple[Recommendation, dict]:
    """Recommend a method and γ (batch 1) and the batch size above which to switch speculation off.

    Returns (Recommendation, {method: MethodPrediction at batch 1}).
    """
    predictions = {m.name: predict(m, meas.verify_ratio[1], meas.gamma_max) for m in meas.methods}
    ranked = sorted(predictions.values(), key=lambda p: p.best_speedup, reverse=True)
    if not ranked or ranked[0].best_speedup < MIN_GAIN:
        why = ("no speculative method was measured" if not ranked else
               f"no method and γ <= {meas.gamma_max} is predicted to reach {MIN_GAIN:.2f}x (best: "
               f"{describe(ranked[0])}, {ranked[0].best_speedup:.2f}x)")
        return Recommendation("none", None, 1.0, 0, False, reasons=[f"speculation off: {why}"]), predictions
    best = ranked[0]
    m = next(x for x in meas.methods if x.name == best.name)
    formula = best.tree_predicted if best.best_gamma is None else best.predicted[best.best_gamma - 1]
    reasons = [f"{describe(best)}: predicted {formula:.2f}x by the formula, {best.best_speedup:.2f}x after "
               f"calibrating to the measured speedup (factor {best.calibration:.2f})"]
    if best.best_gamma is not None and best.best_gamma_any > meas.gamma_max:
        reasons.append(f"γ={best.best_gamma_any} would predict {best.calibrated[best.best_gamma_any - 1]:.2f}x: "
                       f"re-export with --gamma {best.best_gamma_any} to allow it")
    by_batch, max_batch, paying = {}, 0, True
    for batch in sorted(meas.verify_ratio):  # max_batch: the largest batch up to which every batch pays
        p = predict(m, meas.verify_ratio[batch], meas.gamma_max, m.c_by_batch.get(batch, m.c), best.calibration)
        by_batch[batch] = {"gamma": p.best_gamma, "predicted_speedup": p.best_speedup}
        paying = paying and p.best_speedup >= MIN_GAIN
        if paying:
            max_batch = batch
    lower_bound = max_batch == max(meas.verify_ratio)
    reasons.append(f"speculation pays up to batch {max_batch}" + (" (the largest measured)" if lower_bound else
                                                                 f"; switch it off above batch {max_batch}"))
    rec = Recommendation(best.name, best.best_gamma, best.best_speedup, max_batch, lower_bound, by_batch, reasons)
    return rec, predictions


def describe(p: MethodPrediction) -> str:
    return f"{p.name} (tree)" if p.best_gamma is None else f"{p.name} at γ={p.best_gamma}"
