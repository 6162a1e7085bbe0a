"""Export parity: how close an exported graph's outputs are to the torch model's, at any model scale.

Cases (each graph, before it is written into an engine dir):

- ``calibration``: ``CALIBRATION_TEXT`` (some code, some prose) tokenized with the model's tokenizer and
  run through the HF model in one forward (the reference) and through the graph as the runtime runs a
  prompt and its reply: prefill in chunks of the exported prefill shape, then ``DECODE_STEPS`` one-token
  steps, every call reading the K/V the graph itself wrote. Logits only (a K/V error shows in the logits
  of the positions after it).
- the fixed shapes (``decode``, ``verify``, ``prefill``, ``tree`` and ``tree_verify`` with an exported
  tree): random ids and past K/V through the export wrapper and the graph (onnx_export.parity_cases);
  logits, the new K/V and hidden / aux_hidden.

Figures per case (``case_metrics``): KL(p_torch || p_graph) mean and max over positions (softmax at
temperature 1, nats), top-1 agreement on the *decided* positions (torch's top-1 logit ahead of its
runner-up by ``TOP1_MARGIN`` or more; near-ties may flip under any rounding and say nothing), and
the largest logit difference relative to the spread of torch's logits at that position; K/V and hidden
get the same relative figure against each output's spread. A graph passes when every judged case is
within ``BOUNDS[scheme]`` (docs/export.md, "Parity"): fp32/fp16 graphs on every case against the torch
model they were exported from; quantized graphs (a different model by design) on the calibration text
against the unquantized torch model, by KL mean and top-1 only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from .errors import ExportError

CALIBRATION_TEXT = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

The river was high that spring, and the old bridge at the edge of town had been closed for a week.
Most people took the long road through the hills; a few, in a hurry, paid the ferryman instead.
'''
DECODE_STEPS = 4  # one-token steps at the end of the calibration text (the rest is prefilled)
MAX_CALIBRATION_TOKENS = 256  # and never past the export's max_len
TOP1_MARGIN = 1.0  # nats: torch's top-1 logit this far ahead of its runner-up makes a position "decided"
ROWS = 32  # positions per block in float64 (a 262k vocabulary: 64 MiB per block and array)


@dataclass(frozen=True)
class Bounds:
    """What a graph must meet; None: not bounded."""

    kl_mean: float | None = None  # mean over positions of KL(p_torch || p_graph), nats
    kl_max: float | None = None  # KL at any position
    top1: float | None = None  # floor of the top-1 agreement on decided positions
    rel: float | None = None  # max |Δ| / spread, on logits, K/V and hidden
    calibration_only: bool = False  # judge the calibration case only (the fixed shapes are reported)


# Set from measurements (docs/export.md, "Parity", has the table). fp32: SmolLM2-135M's worst case is
# KL max 5e-8, |Δ|/spread 4e-4 (Gemma 3 270M: 5e-10, 4e-5); a 0.1% error in one weight matrix of SmolLM2
# already gives |Δ|/spread >= 1.4e-2 and KL max >= 1e-5. fp16: rounding alone moves SmolLM2's logits on
# the random-feed shapes by up to 0.25 spread (KL max 1.8e-2), enough to flip a 1-nat margin: KL and the
# relative difference only, at gross-error level. int8/int4: the quantized model is another model;
# SmolLM2 measures KL mean 4e-3 (int8) and 0.27 (int4), top-1 100% and 91%: these floors say it is still
# a close approximation of the torch model on real text.
BOUNDS = {
    "fp32": Bounds(kl_max=1e-5, top1=1.0, rel=5e-3),
    "fp16": Bounds(kl_max=0.1, rel=1.0),
    "int8": Bounds(kl_mean=0.05, top1=0.95, calibration_only=True),
    "int4": Bounds(kl_mean=0.5, top1=0.8, calibration_only=True),
}
OVERRIDE_KEYS = [f.name for f in fields(Bounds) if f.name != "calibration_only"]


def parse_override(text: str | None) -> dict | None:
    """``--parity-bounds``: "off" (report only) or "key=value,..." over ``OVERRIDE_KEYS`` (a value "none"
    lifts that bound); None: no override. ExportError for anything else.

    >>> parse_override("kl_mean=0.5,top1=none")
    {'kl_mean': 0.5, 'top1': None}
    """
    if text is None:
        return None
    if text.strip() == "off":
        return {k: None for k in OVERRIDE_KEYS}
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        try:
            out[key] = None if value.strip() == "none" else float(value)
        except ValueError:
            key = None
        if key not in OVERRIDE_KEYS:
            raise ExportError(f"--parity-bounds {text!r}: expected 'off' or key=value pairs with keys "
                              f"{', '.join(OVERRIDE_KEYS)} and numbers (or 'none') as values")
    if not out:
        raise ExportError("--parity-bounds is empty: 'off' or key=value pairs")
    return out


def bounds_for(scheme: str, override: str | None) -> Bounds:
    """The bounds a graph of ``scheme`` (fp32 | fp16 | int8 | int4) meets, with ``--parity-bounds`` applied."""
    return replace(BOUNDS[scheme], **(parse_override(override) or {}))


# ---- the calibration case ----------------------------------------------------------------------------
def calibration_ids(model, vocab_size: int, limit: int) -> list[int]:
    """``CALIBRATION_TEXT`` in the tokenizer saved beside the model's checkpoint (its ``name_or_path``),
    at most ``limit`` tokens; a model loaded from elsewhere reads the text's UTF-8 bytes as ids. Ids wrap
    around ``vocab_size`` (a tokenizer larger than the model's logits cannot break the check)."""
    tokenizer = Path(getattr(model, "name_or_path", "") or ".") / "tokenizer.json"
    if tokenizer.is_file():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tokenizer)).encode(CALIBRATION_TEXT).ids
    else:
        ids = list(CALIBRATION_TEXT.encode())
    return [i % vocab_size for i in ids[:limit]]


def calibration_case(model, vocab_size: int, max_len: int) -> tuple[list[int], np.ndarray]:
    """(the calibration ids, the HF model's logits [N, V] over them in one forward: no export wrapper in
    between), N <= ``max_len``. The graph gets the plain causal mask (sliding windows apply in the graph)."""
    ids = calibration_ids(model, vocab_size, min(MAX_CALIBRATION_TOKENS, max_len))
    with torch.no_grad():
        return ids, model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def run_calibration(run, ids: list[int], geo, dtype, chunk: int) -> np.ndarray:
    """The graph's logits [N, V] over ``ids``: prefill in chunks of ``chunk``, then ``DECODE_STEPS`` steps.

    run(feeds) -> outputs, as for the fixed shapes (feeds: input_ids, position_ids, attention_mask, the
    time-major past K/V); each call's past is the K/V the graph returned before, as in the runtime.
    """
    from ..engines.wrapper import chain_mask

    n = len(ids)
    prompt = n - min(DECODE_STEPS, n - 1)
    spans = [(a, min(a + chunk, prompt)) for a in range(0, prompt, chunk)] + [(a, a + 1) for a in range(prompt, n)]
    past = [torch.zeros(0, 1, geo.num_kv_heads, geo.head_dim, dtype=dtype) for _ in range(2 * geo.num_layers)]
    logits = []
    for a, b in spans:
        out = run([torch.tensor([ids[a:b]]), torch.arange(a, b)[None], chain_mask(a, b - a, dtype), *past])
        logits.append(np.asarray(out[0][0], dtype=np.float32))
        new = out[1:1 + 2 * geo.num_layers]
        past = [torch.cat([p, torch.from_numpy(np.ascontiguousarray(k)).to(dtype)]) for p, k in zip(past, new)]
    return np.concatenate(logits)


# ---- the figures -------------------------------------------------------------------------------------
def logit_metrics(got: np.ndarray, ref: np.ndarray) -> dict:
    """KL(p_torch || p_graph) mean/max, top-1 agreement on decided positions, max |Δ|/spread, of logits [..., V].

    Worked example, one position of a 3-token vocabulary: torch [2, 0, 0], graph [2, 0, 0.1]:
    p_torch = softmax = [0.7870, 0.1065, 0.1065], p_graph = [0.7783, 0.1053, 0.1164];
    KL = sum p_torch * (log p_torch - log p_graph) = 4.9e-4 nats (kl_mean = kl_max = 4.9e-4);
    torch's top-1 (token 0) leads its runner-up by 2 >= TOP1_MARGIN: decided, and the graph's top-1 is
    token 0 too: top1 = 1/1 = 1.0; the spread is std([2, 0, 0]) = 0.943 and max |Δ| = 0.1: rel = 0.106.
    A position whose top two logits are within TOP1_MARGIN is not counted in top1 (``decided`` counts
    those that are); top1 is None when no position is decided (flat distributions: KL judges them).
    """
    ref = ref.reshape(-1, ref.shape[-1])
    got = got.reshape(ref.shape)
    kl, decided, agree, rel = [], 0, 0, 0.0
    for a in range(0, len(ref), ROWS):
        t, g = ref[a:a + ROWS].astype(np.float64), got[a:a + ROWS].astype(np.float64)
        lt, lg = _log_softmax(t), _log_softmax(g)
        kl.append(np.maximum((np.exp(lt) * (lt - lg)).sum(-1), 0.0))
        top2 = np.partition(t, -2, axis=-1)[:, -2:]
        sure = top2[:, 1] - top2[:, 0] >= TOP1_MARGIN
        decided += int(sure.sum())
        agree += int((sure & (t.argmax(-1) == g.argmax(-1))).sum())
        rel = max(rel, float((np.abs(g - t).max(-1) / np.maximum(t.std(-1), 1e-12)).max()))
    kl = np.concatenate(kl)
    return {"positions": len(ref), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": agree / decided if decided else None, "decided": decided, "rel": rel}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def rel_diff(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / std(ref) over a whole tensor (K/V, hidden)."""
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(np.asarray(got, dtype=np.float64) - ref).max() / max(float(ref.std()), 1e-12))


def case_metrics(got: list, ref: list, num_layers: int) -> tuple[dict, dict]:
    """(the figures of one case, its absolute max differences) from the graph's and torch's outputs
    (logits, then 2 * num_layers new K/V, then hidden / aux_hidden; the calibration case: logits only)."""
    figures = logit_metrics(got[0], ref[0])
    absolute = {"logits": float(np.abs(got[0].astype(np.float32) - ref[0]).max()),
                "argmax_agreement": float((got[0].argmax(-1) == ref[0].argmax(-1)).mean())}
    for key, part in (("kv", slice(1, 1 + 2 * num_layers)), ("hidden", slice(1 + 2 * num_layers, None))):
        pairs = list(zip(got[part], ref[part]))
        if pairs:
            figures[f"{key}_rel"] = max(rel_diff(g, r) for g, r in pairs)
            absolute[key] = max(float(np.abs(np.asarray(g, np.float32) - r).max()) for g, r in pairs)
    return figures, absolute


def measure(run, cases: dict, calibration: tuple, geo, dtype, chunk: int) -> tuple[dict, dict]:
    """({case: figures}, {case: absolute differences}) of the graph ``run`` on the calibration text
    (``calibration`` = (ids, torch logits)) and the fixed-shape ``cases`` ({name: (feeds, torch outputs)})."""
    ids, ref = calibration
    figures, absolute = {}, {}
    figures["calibration"], absolute["calibration"] = case_metrics(
        [run_calibration(run, ids, geo, dtype, chunk)], [ref], geo.num_layers)
    for name, (feeds, outs) in cases.items():
        figures[name], absolute[name] = case_metrics(run(feeds), outs, geo.num_layers)
        figures[name]["query"] = int(feeds[0].shape[1])
    return figures, absolute


def violations(figures: dict, bounds: Bounds) -> list[str]:
    """What each judged case exceeds of ``bounds`` (NaN exceeds everything), e.g. "decode: KL max 0.03 > 1e-05"."""
    out = []
    for name, f in figures.items():
        if bounds.calibration_only and name != "calibration":
            continue
        checks = [("KL mean", f["kl_mean"], bounds.kl_mean, 1), ("KL max", f["kl_max"], bounds.kl_max, 1),
                  ("top-1", f["top1"], bounds.top1, -1)]
        checks += [(f"{label} max |Δ|/spread", f.get(k), bounds.rel, 1)
                   for k, label in (("rel", "logits"), ("kv_rel", "K/V"), ("hidden_rel", "hidden"))]
        for label, value, bound, sign in checks:
            if bound is None or value is None:
                continue
            if not sign * value <= sign * bound:
                out.append(f"{name}: {label} {value:.3g} {'>' if sign > 0 else '<'} {bound:g}")
    return out


def check(run, cases: dict, calibration: tuple, geo, dtype: str, chunk: int, scheme: str,
          override: str | None = None) -> tuple[dict, dict]:
    """``measure`` then judge against ``bounds_for(scheme, override)``: (the manifest's ``parity`` object,
    the absolute differences per case); ExportError naming every bound a case exceeds. ``dtype`` is the
    torch model's (fp32 | fp16), ``scheme`` the graph's (its dtype, or int8 | int4)."""
    from .hf_checkpoint import TORCH_DTYPES

    bounds = bounds_for(scheme, override)
    figures, absolute = measure(run, cases, calibration, geo, TORCH_DTYPES[dtype], chunk)
    bad = violations(figures, bounds)
    if bad:
        raise ExportError(f"parity check failed ({scheme} graph vs the torch model): " + "; ".join(bad) +
                          " (docs/export.md, Parity; --parity-bounds overrides the bounds)")
    report = {"scheme": scheme, "reference": f"torch {dtype}",
              "calibration_tokens": len(calibration[0]), "cases": figures,
              "bounds": asdict(bounds), "override": override}
    return report, absolute


def summary(parity: dict) -> str:
    """One line over the judged cases (the worst of each figure), e.g. "parity vs torch fp32: KL mean 1.3e-11,
    max 4.8e-08, top-1 100%, max |Δ|/spread 4.1e-04 (calibration 154 tokens + 4 shapes)"; a quantized graph's
    figures are the calibration text's ("int4 vs torch fp32 on the calibration text: ..., 4 shapes reported")."""
    cases, bounds = parity["cases"], parity["bounds"]
    judged = [cases["calibration"]] if bounds["calibration_only"] else list(cases.values())
    top1 = [c["top1"] for c in judged if c["top1"] is not None]
    figures = (f"KL mean {max(c['kl_mean'] for c in judged):.1e}, max {max(c['kl_max'] for c in judged):.1e}, "
               f"top-1 " + (f"{100 * min(top1):.3g}%" if top1 else "n/a (no decided position)")
               + f", max |Δ|/spread {max(c['rel'] for c in judged):.1e}")
    shapes = len(cases) - 1
    if bounds["calibration_only"]:
        line = (f"parity {parity['scheme']} vs {parity['reference']} on the calibration text: {figures} "
                f"({parity['calibration_tokens']} tokens; {shapes} shapes reported)")
    else:
        line = (f"parity vs {parity['reference']}: {figures} "
                f"(calibration {parity['calibration_tokens']} tokens + {shapes} shapes)")
    if parity.get("override") is not None:
        line += f" [bounds overridden: --parity-bounds {parity['override']}]"
    return line
