"""Speculative decoding emits tokens distributed exactly as the target's (statistical tests)."""
import numpy as np
import pytest

import specrt
from specrt.export.hf_checkpoint import load_hf
from specrt.runtime import verify
from specrt.runtime.sampling import sample
from stat_harness import P_MIN, exact_joint, graph_logits, p_values, run_trials, run_trials_batched

V = 16
TRIALS = 2500
TARGET = dict(arch="llama", vocab_size=V, seed=0, scale=10.0, eos_token_id=None)
DRAFTS = {
    "weak": dict(arch="llama", vocab_size=V, seed=1, hidden=16, layers=1, scale=10.0, eos_token_id=None),
    "disagree": dict(arch="llama", vocab_size=V, seed=2, hidden=16, layers=1, scale=40.0, eos_token_id=None),
    "identical": TARGET,
}
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def engines(build_engine):
    return {name: build_engine(f"exact_{name}", TARGET, draft, gamma=3, max_len=32) for name, draft in DRAFTS.items()}


@pytest.fixture(scope="module")
def target_model(engines):
    return load_hf(engines["weak"].parent / "target")


CASES = [
    ("weak", dict(temperature=1.0)),
    ("weak", dict(temperature=0.7)),
    ("weak", dict(temperature=1.0, top_k=4)),
    ("weak", dict(temperature=1.0, top_p=0.8)),
    ("weak", dict(temperature=1.0, min_p=0.1)),
    ("disagree", dict(temperature=1.0)),
    ("identical", dict(temperature=1.0)),
]


@pytest.mark.parametrize("draft,sampling", CASES, ids=lambda x: str(x))
def test_draft_model_is_exact(engines, target_model, draft, sampling):
    rt = specrt.load(engines[draft])
    counts, totals = run_trials(rt, PROMPT, TRIALS, V, method="draft", gamma=2, **sampling)
    pv = p_values(counts, exact_joint(target_model, PROMPT, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    alpha = totals["accepted"] / totals["proposed"]
    if draft == "identical":
        assert alpha > 0.99  # p == q: (almost) everything is accepted
    if draft == "disagree":
        assert alpha < 0.5


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)], ids=str)
def test_ngram_is_exact(engines, target_model, sampling):
    """The prompt repeats the target's own greedy continuation, so lookups propose likely tokens."""
    rt = specrt.load(engines["weak"])
    base = [3, 1, 4, 1, 5]
    cont = rt.generate(base, max_new_tokens=8, method="none").token_ids
    prompt = base + cont + base + cont[:1]
    counts, totals = run_trials(rt, prompt, TRIALS, V, method="ngram", gamma=3, **sampling)
    pv = p_values(counts, exact_joint(target_model, prompt, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["proposed"] > TRIALS / 20 and totals["accepted"] > 0  # speculation really ran


def test_adaptive_gamma_is_exact(engines, target_model):
    rt = specrt.load(engines["weak"])
    counts, _ = run_trials(rt, PROMPT, TRIALS, V, method="draft", temperature=1.0)
    assert min(p_values(counts, exact_joint(target_model, PROMPT, {}, V)).values()) > P_MIN


FUSED_TARGET = dict(TARGET, hidden=64)  # head_dim 16: the fused graph (kv_layout in_place)


@pytest.fixture(scope="module")
def fused_engines(build_engine):
    """The fused target (and the weak draft) in fp32, and quantized to int8 and int4."""
    return {q: build_engine(f"exact_fused_{q}", FUSED_TARGET, DRAFTS["weak"], gamma=3, max_len=32,
                            quantize=None if q == "fp32" else q) for q in ("fp32", "int8", "int4")}


@pytest.mark.parametrize("quantize,method,batched", [
    ("fp32", "draft", False), ("fp32", "draft", True), ("fp32", "ngram", True),
    ("int8", "draft", False), ("int4", "draft", True)], ids=str)
def test_fused_and_quantized_graphs_are_exact(fused_engines, quantize, method, batched):
    """Exact with respect to the graph's own target: the quantized model's distribution, not fp32's."""
    rt = specrt.load(fused_engines[quantize], attention="ort")
    assert rt.manifest.target.kv_layout == "in_place" and rt.manifest.target.quantize == (None if quantize == "fp32"
                                                                                            else quantize)
    assert_exact(rt, method, batched)


@pytest.mark.parametrize("quantize,method,batched", [("fp32", "draft", True), ("int4", "ngram", True),
                                                     ("int4", "draft", False)], ids=str)
def test_graphs_on_specrt_attention_are_exact(fused_engines, specrt_attention, quantize, method, batched,
                                              monkeypatch):
    """The same on specrt's attention kernel, where a batch's verify pass runs the fused graph itself, and a batch
    of n-gram chains of different lengths runs packed (no padding: runtime.in_place.InPlaceRunner._packed)."""
    from specrt.runtime.in_place import InPlaceRunner

    packed, run = [], InPlaceRunner._packed
    monkeypatch.setattr(InPlaceRunner, "_packed", lambda self, *a: packed.append(1) or run(self, *a))
    rt = specrt.load(fused_engines[quantize], attention=specrt_attention)
    assert rt.target.engine.session.specrt_attention > 0
    assert_exact(rt, method, batched)
    assert packed or method != "ngram"  # (a batch of draft chains packs too where a row's budget cuts its chain)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_decode_steps_of_two_rows_are_exact(fused_engines, method, monkeypatch):
    """Where ONNX Runtime's one-row matmul differs (AVX2, ARM: runtime/in_place.py "Decode rows"), a decode step runs
    as two rows, the token and a dummy copy: forced here, the int4 target's sampled output is still its own
    distribution (the reference's logits come through the same runner rule)."""
    from specrt.runtime import in_place

    monkeypatch.setattr(in_place, "one_row_differs", lambda engine: True)
    rt = specrt.load(fused_engines["int4"], attention="ort")
    assert rt.runner("target", 1)[0].decode_rows == 2
    assert_exact(rt, method, batched=False)


def assert_exact(rt, method: str, batched: bool) -> None:
    """Temperature 1, γ 2, after a prompt whose n-grams repeat: chi-square of the emitted tokens against the
    exact joint of the graph's own logits."""
    base = [3, 1, 4, 1, 5]
    cont = rt.generate(base, max_new_tokens=8, method="none").token_ids
    prompt = base + cont + base + cont[:1]  # n-gram lookups find proposals
    sampling = dict(temperature=1.0)
    run = run_trials_batched if batched else run_trials
    counts, totals = run(rt, prompt, TRIALS, V, method=method, gamma=2, **sampling)
    pv = p_values(counts, exact_joint(graph_logits(rt.target, 32), prompt, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["accepted"] > 0


def naive_argmax_rule(tokens, q, p, rng):
    """WRONG: accept a proposal if it is the target's argmax, else emit a sample from p."""
    for i, x in enumerate(tokens):  # (no proposal: falls through to a plain sample from p)
        if p[i].argmax() != x:
            return i, int(sample(p[i][None], rng)[0])
    return len(tokens), int(sample(p[len(tokens)][None], rng)[0])


def resample_from_p_rule(tokens, q, p, rng):
    """WRONG: the right acceptance test, but on rejection sample from p instead of the residual."""
    x = np.asarray(tokens)
    if not len(x):  # no proposal this round (the token budget is nearly spent): plain sample
        return 0, int(sample(p[0][None], rng)[0])
    accept = rng.random(len(x)) * q[np.arange(len(x)), x] < p[np.arange(len(x)), x]
    n = int(np.argmin(accept)) if not accept.all() else len(x)
    return n, int(sample(p[n][None], rng)[0])


@pytest.mark.parametrize("rule,draft", [(naive_argmax_rule, "identical"), (resample_from_p_rule, "weak")],
                         ids=["naive_argmax_rule", "resample_from_p_rule"])
def test_harness_has_power_against_wrong_rules(engines, target_model, monkeypatch, rule, draft):
    """The same harness must FAIL a biased verifier: otherwise the tests above prove nothing.

    Each rule is paired with the draft that exposes its bias: the argmax rule over-emits the
    target's argmax whenever the draft proposes it (often, with q = p); resampling from p after a
    rejection over-emits tokens the draft over-proposes (rejections are frequent with a weak draft).
    """
    monkeypatch.setattr(verify, "verify_sampled", rule)
    rt = specrt.load(engines[draft])
    counts, _ = run_trials(rt, PROMPT, TRIALS, V, method="draft", gamma=2, temperature=1.0)
    pv = p_values(counts, exact_joint(target_model, PROMPT, {}, V))
    assert min(pv.values()) < P_MIN, pv
