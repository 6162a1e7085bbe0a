"""`specrt profile`: measure an engine dir on this machine and decide whether speculation pays.

Measurements (this module): the latency of one call per graph and exported shape; the
verification cost curve T(Q)/T(1) per batch size (graphs called directly with random feeds:
they accept any batch B); each proposer's cost ratio c; α, tokens per pass and tokens/s of each
method on a prompt set, beside plain decoding in the same run. The analysis is the pure
``profile_advice.recommend``; tables, plots and ORT's operator profile are ``profile_report``.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ... import __version__
from ...contract import NP_DTYPES
from ...runtime.core import SequenceRequest
from ...runtime.sampling import SamplingError, SamplingParams
from .advice import (CURVE_QS, GAMMAS, MIN_GAIN, Measurements, MethodMeasurement, fit_alpha, recommend,
                             ridge_q)
from ..prompts import CODE, REPETITIVE

KNOWN_METHODS = ("draft", "ngram", "suffix", "medusa", "eagle")  # accepted by --methods; availability decided at run time
PROSE = [
    "The history of the printing press begins in the fifteenth century, when",
    "Dear team,\n\nThank you all for the work on the release last week. Before the next one,",
    "Speculative decoding makes a language model faster without changing its output because",
]
DEFAULT_PROMPTS = [*CODE[:3], *REPETITIVE[:2], *PROSE]  # the built-in set: code, code edits, prose


@dataclass
class ProfileConfig:
    """What `specrt profile` measures, and how."""

    methods: tuple = ()  # speculative methods to profile; () = every one this runtime implements
    batches: tuple = (1,)  # batch sizes of the verification cost curve (1 is always included)
    prompts: tuple = ()  # prompt strings; () = DEFAULT_PROMPTS
    max_new_tokens: int = 64  # tokens generated per prompt and method
    gamma: int | None = None  # fixed γ every method runs at; None = the engine dir's exported γ
    temperature: float = 0.0  # sampling settings of the generation runs (0 = greedy)
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0  # prompt i is sampled with seed + i
    warmup: int = 3  # untimed calls before each timed shape
    repeats: int = 20  # timed calls per shape; medians and p90s are over these
    past_len: int = 128  # tokens in the cache for timed decode/verify calls (capped so P + Q fits max_len)


def percentiles(seconds) -> dict:
    s = np.asarray(seconds, dtype=float)
    return {"median_s": float(np.median(s)), "p90_s": float(np.percentile(s, 90)), "reps": int(s.size)}


def tree_mask(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A binary tree of n nodes (node i's parent is (i-1)//2): ancestor-or-self mask [n, n] and depths [n]."""
    parent = (np.arange(n) - 1) // 2
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):  # parents precede children
        mask[i] |= mask[parent[i]]
    return mask, mask.sum(axis=1) - 1


def time_forward(runner, batch: int, q: int, past: int, rng: np.random.Generator, warmup: int, repeats: int,
                 tree: bool = False, vocab_size: int | None = None) -> list[float]:
    """Seconds of ``repeats`` runner calls of [batch, q] new tokens after ``past`` cached ones (stale
    entries: timing only) with a chain or a binary-tree mask; the way decoding calls the graph."""
    block, depth = tree_mask(q) if tree else (None, None)
    for slot in range(batch):
        runner.set_length(slot, past)
    ids = rng.integers(0, vocab_size or 2, (batch, q), dtype=np.int64)
    slots = np.arange(batch)
    blocks, depths = ([block] * batch, [depth] * batch) if tree else (None, None)
    out = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        runner.forward(slots, ids, blocks=blocks, depths=depths, record=False)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def time_calls(engine, feeds: dict, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        engine.run(feeds)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.run(feeds)
        out.append(time.perf_counter() - t0)
    return out


def role_models(rt) -> dict:
    """role -> Graph (engine + spec) of the target and draft decoder graphs."""
    return {role: getattr(rt, role) for role in rt.manifest.graphs if getattr(rt, role, None) is not None}


def timing_past_len(rt, cfg: ProfileConfig) -> tuple[int, list[int]]:
    """(P, Qs): the cache length of timed calls and the Qs of the curve that fit max_len with it."""
    tree = rt.manifest.target.shapes.get("tree_verify")  # a tree method's verify shape, if exported
    wanted = sorted({*CURVE_QS, *(g + 1 for g in GAMMAS), rt.gamma_max + 1, *([int(tree)] if tree else [])})
    qs = [q for q in wanted if q <= rt.manifest.max_len]
    return max(0, min(cfg.past_len, rt.manifest.max_len - qs[-1])), qs


def graph_latencies(rt, cfg: ProfileConfig, rng) -> dict:
    """Issue item 1: per graph and exported shape, median/p90 of one batch-1 call (prefill at P = 0)."""
    past, _ = timing_past_len(rt, cfg)
    out = {}
    for role, model in role_models(rt).items():
        out[role] = {}
        runner = rt.runner(role, 1)[0]
        for shape, q in model.spec.shapes.items():
            p = 0 if shape == "prefill" else min(past, rt.manifest.max_len - int(q))
            seconds = time_forward(runner, 1, int(q), p, rng, cfg.warmup, cfg.repeats, shape.startswith("tree"),
                                   model.spec.geometry.vocab_size)
            out[role][shape] = {"q": int(q), "past_len": p, **percentiles(seconds)}
    heads, spec = getattr(rt, "medusa", None), getattr(rt.manifest, "medusa", None)
    if heads is not None and spec is not None:  # Medusa heads: one call on one hidden state
        hidden = rng.standard_normal((1, spec.hidden_size)).astype(NP_DTYPES[spec.dtype])
        out["medusa_heads"] = {"step": {"q": 1, "past_len": 0, **percentiles(
            time_calls(heads, {"hidden": hidden}, cfg.warmup, cfg.repeats))}}
    return out


def verify_curve(rt, cfg: ProfileConfig, rng) -> list[dict]:
    """Issue item 2: T_B(Q) per batch B (target, chain mask) and the draft's T_B(1); ratios and the ridge."""
    past, qs = timing_past_len(rt, cfg)
    curves = []
    vocab = rt.target.spec.geometry.vocab_size
    for batch in sorted(set(cfg.batches) | {1}):
        target = rt.runner("target", batch)[0]
        times = [percentiles(time_forward(target, batch, q, past, rng, cfg.warmup, cfg.repeats, vocab_size=vocab))
                 for q in qs]
        med = np.array([t["median_s"] for t in times])
        ridge = ridge_q(qs, med)
        curve = {"batch": batch, "past_len": past, "q": qs, "median_s": med.tolist(),
                 "p90_s": [t["p90_s"] for t in times], "ratio": (med / med[0]).tolist(),
                 "ridge_q": ridge, "ridge_positions": ridge * batch if ridge else None}
        if rt.draft is not None:
            draft = time_forward(rt.runner("draft", batch)[0], batch, 1, past, rng, cfg.warmup, cfg.repeats,
                                 vocab_size=vocab)
            curve["draft_decode_median_s"] = float(np.median(draft))
        curves.append(curve)
    return curves


def export_curve(rt) -> dict | None:
    """The target's T(Q) measured when it was exported (manifest ``models.target.latency``, export/latency.py)
    and how it was quantized; None for an engine dir without one."""
    spec = rt.manifest.target
    if spec.latency is None:
        return None
    quantization = rt.manifest.raw["models"]["target"].get("quantization", {})
    return {**spec.latency, "quantize": spec.quantize, "kernels": quantization.get("kernels")}


def implemented_methods() -> tuple:
    """The runtime's METHODS, read now (methods may be added after this module was written)."""
    from ...runtime import methods

    return tuple(methods.METHODS)


def method_availability(rt, methods) -> dict:
    """method -> None if it can run on this engine dir, else the reason it cannot."""
    implemented = implemented_methods()
    reasons = {}
    for m in methods:
        if m not in implemented:
            reasons[m] = (f"not available: this specrt runtime does not implement {m!r} "
                          f"(it implements {', '.join(x for x in implemented if x != 'none')})")
            continue
        try:
            rt.resolve_method(m)
            reasons[m] = None
        except SamplingError as e:
            reasons[m] = f"not available for this engine dir: {e}"
    return reasons


def prompt_ids(rt, prompts, cfg: ProfileConfig, gamma: int) -> tuple[list[list[int]], int]:
    """Tokenized prompts, each cut to its last tokens so that generation fits max_len; (ids, number cut)."""
    keep = max(1, rt.manifest.max_len - max(cfg.max_new_tokens, gamma + 1) - 1)
    ids, cut = [], 0
    for i, p in enumerate(prompts):
        toks = rt.tokenizer.encode(p, add_special_tokens=False).ids
        if not toks:
            raise ValueError(f"prompt {i + 1} is empty after tokenization")
        cut += len(toks) > keep
        ids.append(toks[-keep:])
    return ids, cut


def step_seconds(rt, method: str, prompts: list, gamma: int, cfg: ProfileConfig) -> tuple[float, float] | None:
    """Issue item 3: (seconds per proposed token, seconds per target decode step), medians on the prompts.

    Both are timed the way decoding runs them (through the cached models, sampling included);
    None for a method whose proposer profile cannot build.
    """
    if method not in ("draft", "ngram"):
        return None
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                            seed=cfg.seed, max_new_tokens=rt.manifest.max_len)
    core = rt.core(method)  # the batch-1 decode core: its proposer and target runner
    reps, warmup = max(1, -(-cfg.repeats // len(prompts))), max(1, cfg.warmup)  # call 1 feeds the whole prompt
    prop, target = [], []
    for ids in prompts:
        if core.add(SequenceRequest("profile", ids, params)).finish_reason:
            continue  # the first token ended it (EOS): nothing to time on this prompt
        row = core.rows[0]
        for rep in range(warmup + reps):
            t0 = time.perf_counter()
            core.proposer.propose([row], [gamma])  # after the first call: gamma single-token steps
            t1 = time.perf_counter()
            core.target.forward([row.slot], [row.seq[-1:]])  # one decode step (nothing committed)
            if rep >= warmup:
                prop.append((t1 - t0) / gamma)
                target.append(time.perf_counter() - t1)
        core.remove("profile")
    return float(np.median(prop)), float(np.median(target))


def run_methods(rt, cfg: ProfileConfig, ids: list, methods: list, gamma: int) -> dict:
    """Issue item 4: every prompt with plain decoding and each method at fixed γ, interleaved per prompt."""
    kw = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p)
    for m in ["none", *methods]:  # warm-up (and the runtime's own cost calibration)
        rt.generate(ids[0], max_new_tokens=min(8, cfg.max_new_tokens), method=m, gamma=gamma, seed=cfg.seed, **kw)
    keys = ("new_tokens", "seconds", "target_passes", "proposed", "accepted", "rounds")
    sums = {m: dict.fromkeys(keys, 0) for m in ["none", *methods]}
    for i, prompt in enumerate(ids):
        for m in sums:
            s = rt.generate(prompt, max_new_tokens=cfg.max_new_tokens, method=m, gamma=gamma, seed=cfg.seed + i,
                            **kw).stats
            for k in keys:
                sums[m][k] += s.get(k, 0)
            if "tree_size" in s:  # a tree method (Medusa): verifies tree_size nodes per pass, has no γ
                sums[m]["tree_size"] = s["tree_size"]
    plain_tps = sums["none"]["new_tokens"] / sums["none"]["seconds"]
    out = {}
    for m, s in sums.items():
        r = {**s, "tokens_per_second": s["new_tokens"] / s["seconds"]}
        if m != "none":
            rounds = max(s["rounds"], 1)
            r.update(acceptance_rate=s["accepted"] / max(s["proposed"], 1),
                     tokens_per_pass=(s["accepted"] + s["rounds"]) / rounds, mean_proposal=s["proposed"] / rounds,
                     measured_speedup=r["tokens_per_second"] / plain_tps, gamma_run=None if "tree_size" in s else gamma)
        out[m] = r
    return out


def machine(rt) -> dict:
    import onnxruntime as ort

    session = getattr(rt.target.engine, "session", None)
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "onnxruntime": ort.__version__,
            "providers": session.get_providers() if session is not None else []}


def proposer_cost(rt, method: str, ids: list, gamma: int, cfg: ProfileConfig) -> dict:
    """c of one method: timed directly where specrt can build its proposer, else the runtime's own estimate."""
    steps = step_seconds(rt, method, ids, gamma, cfg)
    if steps is not None:
        return {"c": steps[0] / steps[1], "proposer_step_s": steps[0], "target_step_s": steps[1]}
    stats = rt.generate(ids[0], max_new_tokens=cfg.max_new_tokens, method=method, gamma=gamma).stats
    return {"c": float(stats.get("c", 0.0)), "proposer_step_s": None, "target_step_s": None}


def profile_engine(rt, cfg: ProfileConfig, log=lambda *_: None) -> dict:
    """Measure everything and recommend; returns the report dict written to profile.json."""
    gamma = rt.gamma_max if cfg.gamma is None else cfg.gamma
    if not 1 <= gamma <= rt.gamma_max:
        raise ValueError(f"--gamma must be in 1..{rt.gamma_max} (the engine dir's exported gamma), got {gamma}")
    if any(b < 1 for b in cfg.batches):
        raise ValueError(f"batch sizes must be >= 1, got {list(cfg.batches)}")
    rng = np.random.default_rng(cfg.seed)
    wanted = list(cfg.methods) or [m for m in implemented_methods() if m != "none"]
    availability = method_availability(rt, wanted)
    methods = [m for m in wanted if availability[m] is None]
    ids, cut = prompt_ids(rt, list(cfg.prompts) or DEFAULT_PROMPTS, cfg, gamma)

    log(f"timing every graph and shape ({cfg.warmup} warm-up + {cfg.repeats} timed calls each) ...")
    graphs = graph_latencies(rt, cfg, rng)
    log(f"verification cost curve at batch {', '.join(map(str, sorted(set(cfg.batches) | {1})))} ...")
    curves = verify_curve(rt, cfg, rng)
    log(f"generating {len(ids)} prompts x {1 + len(methods)} methods at γ={gamma} ...")
    runs = run_methods(rt, cfg, ids, methods, gamma)

    report_methods, measured = {}, []
    base = next(c for c in curves if c["batch"] == 1)
    for m in wanted:
        if availability[m] is not None:
            report_methods[m] = {"available": False, "reason": availability[m]}
            continue
        r, cost = runs[m], proposer_cost(rt, m, ids, gamma, cfg)
        c = cost["c"]
        c_by_batch = {cv["batch"]: c * (cv["draft_decode_median_s"] / cv["median_s"][0]) /
                      (base["draft_decode_median_s"] / base["median_s"][0])
                      for cv in curves} if m == "draft" else {}
        tree = r.get("tree_size")
        alpha = None if tree else fit_alpha(r["tokens_per_pass"], r["mean_proposal"])
        measured.append(MethodMeasurement(m, alpha, c, None if tree else gamma, r["measured_speedup"], c_by_batch,
                                          tree, r["tokens_per_pass"]))
        report_methods[m] = {"available": True, "reason": None, "alpha": alpha, **cost,
                             "c_by_batch": {str(b): v for b, v in c_by_batch.items()}, **r}
    meas = Measurements(gamma_max=rt.gamma_max, methods=measured,
                        verify_ratio={cv["batch"]: dict(zip(cv["q"], cv["ratio"])) for cv in curves})
    rec, predictions = recommend(meas)
    for name, p in predictions.items():
        report_methods[name]["prediction"] = asdict(p)
    return {
        "specrt_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine_dir": str(rt.manifest.root.resolve()), "machine": machine(rt),
        "settings": {**asdict(cfg), "prompts": len(ids), "prompts_truncated": cut, "gamma_run": gamma,
                     "gamma_max": rt.gamma_max, "methods": wanted, "batches": sorted(set(cfg.batches) | {1}),
                     "min_gain": MIN_GAIN},
        "graphs": graphs, "verify_cost": curves, "export_curve": export_curve(rt), "plain": runs["none"],
        "methods": report_methods,
        "recommendation": {**asdict(rec), "by_batch": {str(b): v for b, v in rec.by_batch.items()}},
    }


def write_defaults(engine_dir: str | Path, recommendation: dict) -> dict:
    """Write a recommendation into manifest.json's ``defaults`` (atomically); returns the new defaults.

    ``speculation_max_batch`` is written as null (no cap) when speculation still paid at the largest
    batch measured: the profile found no limit, so none is imposed.
    """
    path = Path(engine_dir) / "manifest.json"
    raw = json.loads(path.read_text())
    cap = None if recommendation.get("max_batch_is_lower_bound") else recommendation["speculation_max_batch"]
    kept = {k: v for k, v in raw.get("defaults", {}).items() if k != "measured"}  # export's figures: not this choice's
    raw["defaults"] = {**kept, "method": recommendation["method"],
                       "gamma": recommendation["gamma"], "speculation_max_batch": cap}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)
    return raw["defaults"]
