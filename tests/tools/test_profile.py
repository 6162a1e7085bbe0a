"""`specrt profile`: the CLI end to end on a tiny engine dir, its errors, and the pure recommendation logic."""
import json
import math
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import specrt
from specrt.engines import EngineError
from specrt.runtime.gamma import expected_tokens, predicted_speedup
from specrt.tools.cli import cli
from specrt.tools.cli.profile import read_prompts
from specrt.tools.profile.measure import tree_mask, write_defaults
from specrt.tools.profile.advice import (CURVE_QS, GAMMAS, MIN_GAIN, Measurements, MethodMeasurement,
                                         break_even_alpha, fit_alpha, recommend, ridge_q)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FAST = ["--repeats", "2", "--warmup", "1", "--max-new-tokens", "12", "--threads", "1"]


@pytest.fixture
def engine_copy(llama_engine, tmp_path):
    """A private copy of the tiny engine dir (tests here rewrite or corrupt it)."""
    return shutil.copytree(llama_engine, tmp_path / "engine")


def numbers(obj, path=""):
    """Every number in a JSON tree, with its path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def test_profile_cli_writes_json_plots_and_defaults(engine_copy, tmp_path):
    out = tmp_path / "prof"
    res = CliRunner().invoke(cli, ["profile", str(engine_copy), "--out", str(out), "--batch", "1,2",
                                   "--methods", "draft,ngram,eagle", "--onnx-profile", "--write-defaults", *FAST])
    assert res.exit_code == 0, res.output
    assert "Recommendation" in res.output and "T(Q)/T(1)" in res.output
    report = json.loads((out / "profile.json").read_text())
    assert set(report) >= {"specrt_version", "created", "engine_dir", "machine", "settings", "graphs", "verify_cost",
                           "plain", "methods", "recommendation", "files", "onnx_profile", "written_defaults"}
    bad = [(p, v) for p, v in numbers(report) if not math.isfinite(v)]
    assert not bad, bad

    # 1. every graph and exported shape, median <= p90 over the stated repetitions
    assert report["settings"]["repeats"] == 2 and report["settings"]["warmup"] == 1
    assert set(report["graphs"]) == {"target", "draft"}
    assert set(report["graphs"]["target"]) == {"decode", "verify", "prefill"}
    assert report["graphs"]["target"]["verify"]["q"] == 5 and set(report["graphs"]["draft"]) == {"decode", "prefill"}
    for shapes in report["graphs"].values():
        for r in shapes.values():
            assert 0 < r["median_s"] <= r["p90_s"] and r["reps"] == 2

    # 2. the cost curve per batch: every curve Q (max_len 64 fits Q = 64 at P = 0), ratios to Q = 1
    assert [c["batch"] for c in report["verify_cost"]] == [1, 2]
    for c in report["verify_cost"]:
        assert set(CURVE_QS) <= set(c["q"]) and c["ratio"][0] == 1.0
        np.testing.assert_allclose(c["ratio"], np.array(c["median_s"]) / c["median_s"][0])
        assert c["ridge_q"] is None or c["ridge_q"] in CURVE_QS

    # 3-4. measured α, c, tokens/pass per method; eagle reported, not run
    methods, plain = report["methods"], report["plain"]
    assert methods["eagle"]["available"] is False and "eagle" in methods["eagle"]["reason"]
    assert "eagle: not available" in res.output
    for name in ("draft", "ngram"):
        m = methods[name]
        assert m["available"] and 0 <= m["alpha"] <= 1 and 0 <= m["acceptance_rate"] <= 1 and m["c"] >= 0
        assert 1 <= m["tokens_per_pass"] <= 5
        assert m["tokens_per_pass"] == pytest.approx((m["accepted"] + m["rounds"]) / m["rounds"])
        assert m["measured_speedup"] == pytest.approx(m["tokens_per_second"] / plain["tokens_per_second"])
        # 5. the table is the reference formula with the measured numbers
        p = m["prediction"]
        assert p["gammas"] == list(GAMMAS)
        for g, r, s in zip(p["gammas"], p["verify_ratio"], p["predicted"]):
            assert s == pytest.approx(predicted_speedup(m["alpha"], g, m["c"], r))
    assert methods["draft"]["c_by_batch"]["1"] == pytest.approx(methods["draft"]["c"])
    rec = report["recommendation"]
    assert rec["method"] in ("none", "draft", "ngram") and rec["reasons"]
    assert (rec["gamma"] is None) == (rec["method"] == "none")

    # 6. plots are valid PNGs; ORT's operator profile is summarised
    import matplotlib.pyplot as plt

    for key in ("verify_cost", "speedup"):
        data = open(report["files"][key], "rb").read()
        assert data.startswith(PNG_SIGNATURE)
        assert plt.imread(report["files"][key]).shape[:2] > (100, 100)
    for role in ("target", "draft"):
        s = report["onnx_profile"][role]
        assert s["top_ops"] and all(op["total_ms"] >= 0 and op["calls"] > 0 for op in s["top_ops"])
        assert "MatMul" in {op["op"] for op in report["onnx_profile"][role]["top_ops"]} or len(s["top_ops"]) == 8
        assert (tmp_path / "prof" / "onnx_profile").is_dir() and json.loads(open(s["trace_file"]).read())

    # 7. the recommendation is written into the manifest, and the runtime loads it
    defaults = json.loads((engine_copy / "manifest.json").read_text())["defaults"]
    cap = None if rec["max_batch_is_lower_bound"] else rec["speculation_max_batch"]  # null: no limit found
    assert defaults == {"method": rec["method"], "gamma": rec["gamma"], "speculation_max_batch": cap}
    assert specrt.load(engine_copy).default_gamma == rec["gamma"]


def test_profile_default_prompts_fit_a_small_engine(llama_engine, tmp_path):
    """The built-in prompts are longer than max_len = 64: they are cut to fit, not rejected."""
    res = CliRunner().invoke(cli, ["profile", str(llama_engine), "--out", str(tmp_path), "--batch", "1",
                                   "--methods", "ngram", "--gamma", "2", *FAST])
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "profile.json").read_text())["settings"]
    assert s["prompts"] == 8 and s["prompts_truncated"] > 0 and s["gamma_run"] == 2


@pytest.mark.parametrize("damage,message", [
    ("manifest", "not valid JSON"),
    ("graph", "ONNX Runtime cannot load"),
    ("missing", "does not exist"),
])
def test_profile_corrupt_engine_dir(engine_copy, tmp_path, damage, message):
    if damage == "manifest":
        (engine_copy / "manifest.json").write_text("{ not json")
    elif damage == "graph":
        (engine_copy / "target.onnx").write_bytes((engine_copy / "target.onnx").read_bytes()[:300])
    else:
        shutil.rmtree(engine_copy)
    res = CliRunner().invoke(cli, ["profile", str(engine_copy), "--out", str(tmp_path / "o"), *FAST])
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o" / "profile.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--methods", "draft,bogus"], "unknown method"),
    (["--batch", "1,0"], "integers >= 1"),
    (["--gamma", "9"], "--gamma must be in 1..4"),
])
def test_profile_bad_arguments(llama_engine, tmp_path, args, message):
    res = CliRunner().invoke(cli, ["profile", str(llama_engine), "--out", str(tmp_path), *FAST, *args])
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output


def test_read_prompts_formats(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["a b", "def f():\n"]))
    (tmp_path / "p.jsonl").write_text('"x"\n{"prompt": "y\\nz"}\n')
    (tmp_path / "multi.txt").write_text("def f():\n    pass\n---\nsecond\n")
    (tmp_path / "lines.txt").write_text("one\n\ntwo\n")
    assert read_prompts(str(tmp_path / "p.json")) == ("a b", "def f():\n")
    assert read_prompts(str(tmp_path / "p.jsonl")) == ("x", "y\nz")
    assert read_prompts(str(tmp_path / "multi.txt")) == ("def f():\n    pass", "second")
    assert read_prompts(str(tmp_path / "lines.txt")) == ("one", "two")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(Exception, match="non-empty list"):
        read_prompts(str(tmp_path / "bad.json"))


# ---- runtime: defaults.gamma ------------------------------------------------------------------
def test_runtime_uses_manifest_default_gamma_unless_given(engine_copy):
    write_defaults(engine_copy, {"method": "draft", "gamma": 2, "speculation_max_batch": 4})
    rt = specrt.load(engine_copy)
    assert rt.manifest.defaults["speculation_max_batch"] == 4
    assert set(rt.generate([3, 1, 4, 1, 5], max_new_tokens=12).stats["gamma_history"]) == {2}
    assert set(rt.generate([3, 1, 4, 1, 5], max_new_tokens=12, gamma=1).stats["gamma_history"]) == {1}
    written = write_defaults(engine_copy, {"method": "draft", "gamma": None, "speculation_max_batch": 16,
                                           "max_batch_is_lower_bound": True})
    assert written["speculation_max_batch"] is None  # paid at every batch measured: no cap written
    assert specrt.load(engine_copy).default_gamma is None  # null keeps adaptive γ
    write_defaults(engine_copy, {"method": "draft", "gamma": 99, "speculation_max_batch": 4})
    with pytest.raises(EngineError, match="defaults.gamma"):
        specrt.load(engine_copy)


# ---- recommendation logic on synthetic measurements ---------------------------------------------
def flat(level=1.0):
    return {q: level for q in range(1, 65)}


def test_no_speculation_when_every_gamma_predicts_below_one():
    meas = Measurements(gamma_max=8, verify_ratio={1: flat(), 8: flat()},
                        methods=[MethodMeasurement("draft", alpha=0.3, c=0.35, gamma_run=4),
                                 MethodMeasurement("ngram", alpha=0.1, c=0.15, gamma_run=4)])
    rec, pred = recommend(meas)
    assert all(s < 1 for p in pred.values() for s in p.predicted)  # the premise
    assert rec.method == "none" and rec.gamma is None and rec.speculation_max_batch == 0
    assert pred["draft"].break_even_gamma is None and "speculation off" in rec.reasons[0]


def test_no_speculation_when_measurements_show_overheads_the_formula_misses():
    """The formula says 2.8x (α 0.8, c 0.05, γ 4) but the run measured 0.5x: calibrated, nothing pays."""
    m = MethodMeasurement("draft", alpha=0.8, c=0.05, gamma_run=4, measured_speedup=0.5)
    rec, pred = recommend(Measurements(4, {1: flat()}, [m]))
    assert pred["draft"].predicted[3] == pytest.approx(2.80, abs=0.005)
    assert pred["draft"].calibration == pytest.approx(0.5 / 2.8, rel=1e-3)
    assert rec.method == "none"


def test_recommends_best_method_and_gamma_within_the_exported_gamma():
    ratios = {q: 1 + 0.02 * (q - 1) for q in range(1, 65)}
    strong = MethodMeasurement("draft", alpha=0.8, c=0.05, gamma_run=4)
    weak = MethodMeasurement("ngram", alpha=0.5, c=0.0, gamma_run=4)
    rec, pred = recommend(Measurements(8, {1: ratios}, [weak, strong]))
    best = max(GAMMAS, key=lambda g: predicted_speedup(0.8, g, 0.05, ratios[g + 1]))
    assert rec.method == "draft" and rec.gamma == best
    assert rec.predicted_speedup == pytest.approx(predicted_speedup(0.8, best, 0.05, ratios[best + 1]))
    assert rec.speculation_max_batch == 1 and rec.max_batch_is_lower_bound  # only batch 1 measured
    rec4, _ = recommend(Measurements(3, {1: ratios}, [weak, strong]))  # exported γ = 3
    assert rec4.gamma == 3 and any("re-export with --gamma" in r for r in rec4.reasons)


def test_speculation_switched_off_above_the_batch_where_verification_stops_being_free():
    proportional = {q: float(q) for q in range(1, 65)}  # compute-bound: T(Q) = Q T(1)
    m = MethodMeasurement("draft", alpha=0.8, c=0.05, gamma_run=4, c_by_batch={1: 0.05, 4: 0.05, 32: 0.05})
    ratios = {1: flat(), 4: {q: 1 + 0.1 * (q - 1) for q in range(1, 65)}, 32: proportional}
    rec, _ = recommend(Measurements(8, ratios, [m]))
    assert rec.method == "draft" and rec.speculation_max_batch == 4 and not rec.max_batch_is_lower_bound
    assert rec.by_batch[32]["predicted_speedup"] < 1 and rec.by_batch[4]["predicted_speedup"] >= MIN_GAIN
    costly = MethodMeasurement("draft", alpha=0.8, c=0.05, gamma_run=4, c_by_batch={4: 2.0})  # draft cost at B=4
    rec, _ = recommend(Measurements(8, {1: flat(), 4: flat()}, [costly]))
    assert rec.speculation_max_batch == 1


def test_ridge_found_from_measurements():
    qs = list(CURVE_QS)
    assert ridge_q(qs, [1.0] * len(qs)) is None  # free all the way
    assert ridge_q(qs, [max(1.0, q / 16) for q in qs]) == 16  # flat, then proportional from 16
    assert ridge_q(qs, [float(q) for q in qs]) == 1  # compute-bound from the start
    assert ridge_q(qs, [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7]) is None  # slow growth is still nearly free


def test_alpha_fit_and_break_even():
    for alpha in (0.0, 0.3, 0.7, 0.95):
        assert fit_alpha(expected_tokens(alpha, 4), 4) == pytest.approx(alpha, abs=1e-3)
    assert fit_alpha(1.0, 0) == 0.0  # no proposals: nothing to fit
    a = break_even_alpha(4, 0.3, 1.0)  # the reference's LOSS case (α 0.4, c 0.3) lies below it
    assert a > 0.4 and predicted_speedup(a, 4, 0.3) == pytest.approx(1.0, abs=1e-3)
    assert break_even_alpha(4, 2.0, 1.0) is None  # 9 target passes of drafting: even α = 1 loses


def test_tree_mask_is_ancestor_closed():
    mask, depth = tree_mask(7)
    assert mask[6].tolist() == [True, False, True, False, False, False, True]  # 6 -> 2 -> 0
    assert depth.tolist() == [0, 1, 1, 2, 2, 2, 2]


def test_tree_method_is_compared_by_its_measured_yield():
    """A tree method (Medusa) has no γ: tokens/pass / (c + T(N)/T(1)), against the best chain method."""
    ratios = {q: 1 + 0.01 * (q - 1) for q in range(1, 65)}
    tree = MethodMeasurement("medusa", alpha=None, c=0.1, gamma_run=None, tree_size=16, tokens_per_pass=3.0)
    chain = MethodMeasurement("ngram", alpha=0.5, c=0.0, gamma_run=4)
    rec, pred = recommend(Measurements(4, {1: ratios}, [chain, tree]))
    assert pred["medusa"].tree_predicted == pytest.approx(3.0 / (0.1 + ratios[16]))
    assert pred["medusa"].gammas == [] and pred["medusa"].best_gamma is None
    assert rec.method == "medusa" and rec.gamma is None and rec.speculation_max_batch == 1
    weak_tree = MethodMeasurement("medusa", alpha=None, c=0.1, gamma_run=None, tree_size=16, tokens_per_pass=1.1)
    rec, _ = recommend(Measurements(4, {1: ratios}, [chain, weak_tree]))
    assert rec.method == "ngram"


def test_profile_engine_without_draft_and_short_max_len(build_engine, tmp_path):
    """No draft graph: 'draft' is reported unavailable; max_len 48 limits the curve to Q <= 32."""
    engine = build_engine("arch_llama", dict(arch="llama", scale=20.0), max_len=48, gamma=4)  # shared with test_export
    res = CliRunner().invoke(cli, ["profile", str(engine), "--out", str(tmp_path), "--batch", "1", *FAST])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["methods"]["draft"]["available"] is False and "--draft" in report["methods"]["draft"]["reason"]
    assert report["methods"]["ngram"]["available"] and set(report["graphs"]) == {"target"}
    curve = report["verify_cost"][0]
    assert max(curve["q"]) == 32 and curve["past_len"] + max(curve["q"]) <= 48


def test_profile_shows_the_curve_measured_at_export(llama_fused_engine, tmp_path):
    """A fused target's manifest keeps the T(Q) measured when it was exported (export/latency.py): the profile
    reports it beside its own curve (table 2 and profile.json's export_curve)."""
    res = CliRunner().invoke(cli, ["profile", str(llama_fused_engine), "--out", str(tmp_path), "--batch", "1",
                                   "--methods", "ngram", *FAST])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "profile.json").read_text())
    exported = report["export_curve"]
    assert exported["q"][0] == 1 and exported["ratio"][0] == 1.0 and min(exported["seconds"]) > 0
    assert "at export" in res.output and "models.target.latency" in res.output
