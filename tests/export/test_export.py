"""Export parity (ORT vs PyTorch) and greedy generation equal to HF transformers, per architecture."""
import contextlib
import json

import numpy as np
import pytest
import torch

from tiny import ARCHS, FUSED_ARCHS, make_model
from reference import fresh_runner
from specrt.engines import OrtEngine
from specrt.engines.manifest import load_manifest
from specrt.export.fused_graph import run_in_place
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, example_tree_mask, random_feeds
from specrt.engines.wrapper import DecoderWrapper, UnsupportedArchitecture, check_architecture, geometry

TOL = 1e-4  # max |ORT - torch| on logits and K/V for these fp32 tiny models (logits scaled to O(10))


GRAPHS = [(a, "traced") for a in ARCHS] + [(a, "fused") for a in FUSED_ARCHS]


@pytest.fixture(scope="module", params=GRAPHS, ids=lambda p: "-".join(p))
def arch_engine(request, build_engine):
    """(arch, engine dir) of a tiny model per family and graph kind (fused needs head_dim 16: hidden 64)."""
    arch, graph = request.param
    target = dict(arch=arch, scale=20.0, **({"hidden": 64} if graph == "fused" else {}))
    engine_dir = build_engine(f"arch_{arch}_{graph}", target, max_len=48, gamma=4, graph=graph)
    assert load_manifest(engine_dir).target.kv_layout == ("in_place" if graph == "fused" else "time_major")
    return arch, engine_dir


def run_target(engine_dir, feeds) -> list[np.ndarray]:
    """The target graph's outputs on traced-graph feeds (logits, new K/V, [hidden]), either layout."""
    m = load_manifest(engine_dir)
    sess = OrtEngine(engine_dir / "target.onnx")
    if m.target.kv_layout == "in_place":
        return run_in_place(sess, feeds, m.max_len)
    got = sess.run({n: t.numpy() for n, t in zip(sess.input_names, feeds)})
    return [got[n] for n in sess.output_names]


@pytest.mark.parametrize("shape", [(7, 1, False), (7, 5, False), (0, 37, False), (9, 8, True)],
                         ids=["decode", "verify", "prefill37", "tree8"])
def test_ort_matches_torch(arch_engine, shape):
    arch, engine_dir = arch_engine
    past, q, tree = shape
    model = load_hf(engine_dir.parent / "target")
    geo = geometry(model)
    feeds = random_feeds(geo, torch.float32, past, q, example_tree_mask() if tree else None, seed=3)
    with torch.no_grad():
        ref = [t.numpy() for t in DecoderWrapper(model)(*feeds)]
    got = run_target(engine_dir, feeds)
    assert np.abs(ref[0]).max() > 1.0  # logits are not trivially tiny
    for i, (g, r) in enumerate(zip(got, ref)):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=0, err_msg=f"output {i}")


def test_tree_node_logits_equal_chain(arch_engine):
    """Each tree node's logits equal its root path run as a plain chain."""
    from specrt.runtime.api import Runtime

    arch, engine_dir = arch_engine
    rt = Runtime.load(engine_dir)
    runner = fresh_runner(rt.target, rt.manifest.max_len)
    mask = example_tree_mask().numpy()
    depths = mask.sum(-1) - 1
    prompt = [3, 5, 7, 9]
    nodes = np.array([11, 12, 13, 14, 15, 16, 17, 18])
    runner.prefill(0, prompt)
    tree_logits = runner.forward([0], [nodes], blocks=[mask], depths=[depths]).logits[0]
    for i in range(len(nodes)):
        path = nodes[np.flatnonzero(mask[i])]  # ancestors and self, in order
        runner.release(0)
        p = runner.forward([0], [prompt + path.tolist()])
        np.testing.assert_allclose(tree_logits[i], p.logits[0, -1], atol=TOL)


@pytest.mark.parametrize("prompt_len", [1, 5, 23])
def test_greedy_equals_hf_generate(arch_engine, prompt_len):
    import specrt

    arch, engine_dir = arch_engine
    model = load_hf(engine_dir.parent / "target")
    prompt = ((np.arange(prompt_len) * 7 + 3) % 31 + 1).tolist()
    n = 12
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            pad_token_id=0, eos_token_id=None)[0, prompt_len:].tolist()
    out = specrt.load(engine_dir).generate(prompt, max_new_tokens=n, method="none", stop_token_ids=())
    # specrt stops at EOS (id 0); HF was told not to: compare up to specrt's stop
    assert out.token_ids == hf[: len(out.token_ids)]
    assert len(out.token_ids) == n or out.token_ids[-1] == 0


def test_cache_fills_to_max_len_and_stops_cleanly(arch_engine):
    """A prompt that leaves 3 free slots: generation stops at max_len with finish_reason 'length'."""
    import specrt

    arch, engine_dir = arch_engine
    rt = specrt.load(engine_dir)
    max_len = rt.manifest.max_len
    prompt = ((np.arange(max_len - 3) * 5 + 1) % 31 + 1).tolist()
    model = load_hf(engine_dir.parent / "target")
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, min_new_tokens=3,
                            pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    for method in ("none", "ngram"):
        out = rt.generate(prompt, max_new_tokens=50, method=method)
        assert out.token_ids == hf[: len(out.token_ids)]
        assert len(out.token_ids) == 3 or out.finish_reason == "stop"
        if len(out.token_ids) == 3:
            assert out.finish_reason == "length"


def test_unsupported_architecture_named(tmp_path):
    import transformers as tf

    cfg = tf.BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2)
    with pytest.raises(UnsupportedArchitecture, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        check_architecture(tf.BloomForCausalLM(cfg))


def test_fp16_export(build_engine):
    """fp16 graphs pass the export parity check (export/parity.py's fp16 bounds) and decode like fp32 on a peaked model."""
    import specrt

    fp32 = build_engine("fp32_peaked", dict(arch="llama", scale=40.0))
    fp16 = build_engine("fp16_peaked", dict(arch="llama", scale=40.0), dtype="fp16")
    m = json.loads((fp16 / "manifest.json").read_text())["models"]["target"]
    assert m["dtype"] == "fp16" and m["inputs"][3]["dtype"] == "float16"
    a = specrt.load(fp32).generate([3, 1, 4], max_new_tokens=10, method="none").token_ids
    b = specrt.load(fp16).generate([3, 1, 4], max_new_tokens=10, method="ngram").token_ids
    assert a == b


# ---- parity: KL, top-1 and |Δ|/spread against torch, on a calibration text and the fixed shapes -------------
def test_parity_metrics_worked_example():
    """The example of parity.logit_metrics' docstring, and a near-tie that top-1 does not count."""
    from specrt.export.parity import TOP1_MARGIN, logit_metrics

    f = logit_metrics(np.array([[2.0, 0, 0.1]]), np.array([[2.0, 0, 0]]))
    assert f["kl_mean"] == f["kl_max"] == pytest.approx(4.885e-4, rel=1e-3)
    assert f["top1"] == 1.0 and f["decided"] == 1 and f["rel"] == pytest.approx(0.1 / 0.9428, rel=1e-3)
    tie = logit_metrics(np.array([[0.0, 0.5 * TOP1_MARGIN]]), np.array([[0.5 * TOP1_MARGIN, 0.0]]))
    assert tie["top1"] is None and tie["decided"] == 0 and tie["kl_max"] > 0  # a flipped near-tie: KL judges it


def test_parity_is_recorded_in_the_manifest(tmp_path):
    from dataclasses import asdict

    from specrt.export.onnx_export import export_engine
    from specrt.export.parity import BOUNDS

    t, cfg = _tiny_pair(tmp_path)
    lines = []
    out = export_engine(t, tmp_path / "e", cfg=cfg, log=lines.append)
    m = json.loads((out / "manifest.json").read_text())["models"]["target"]
    p = m["parity"]
    assert set(p["cases"]) == {"calibration", "decode", "verify", "prefill", "tree"}
    assert p["scheme"] == "fp32" and p["reference"] == "torch fp32" and p["override"] is None
    assert p["bounds"] == asdict(BOUNDS["fp32"]) and p["calibration_tokens"] == cfg.max_len  # the text is longer
    cal = p["cases"]["calibration"]
    assert cal["positions"] == cfg.max_len and cal["kl_max"] <= BOUNDS["fp32"].kl_max and cal["rel"] < 1e-4
    assert all(c["kv_rel"] < 1e-4 for k, c in p["cases"].items() if k != "calibration")
    assert set(m["parity_max_abs_diff"]["decode"]) == {"logits", "kv", "argmax_agreement"}  # absolute, recorded
    assert "tolerance" not in m
    assert any("parity vs torch fp32: KL mean" in line and f"(calibration {cfg.max_len} tokens + 4 shapes)" in line
               for line in lines)


@contextlib.contextmanager
def _off_by(weight, factor: float):
    """``weight`` multiplied by ``factor`` inside the block (restored after)."""
    with torch.no_grad():
        weight.mul_(factor)
    try:
        yield
    finally:
        with torch.no_grad():
            weight.div_(factor)


@pytest.mark.parametrize("graph", ["traced", "fused"])
def test_a_wrong_graph_is_refused(tmp_path, monkeypatch, graph):
    """A graph built from a model whose layer-0 o_proj is 2% off fails the parity check: no engine dir."""
    from specrt.export import fused_graph, onnx_export
    from specrt.export.errors import ExportError

    module, name = (fused_graph, "build_fused_graph") if graph == "fused" else (onnx_export, "trace_graph")
    real = getattr(module, name)

    def wrong(model_or_wrapper, *args):  # trace_graph gets the export wrapper, build_fused_graph the model
        model = model_or_wrapper.model if graph == "traced" else model_or_wrapper
        with _off_by(model.model.layers[0].self_attn.o_proj.weight, 1.02):
            return real(model_or_wrapper, *args)

    monkeypatch.setattr(module, name, wrong)
    src = make_model(tmp_path / "t", arch="llama", hidden=64, scale=20.0)
    with pytest.raises(ExportError, match=r"parity check failed \(fp32 graph vs the torch model\): calibration: .*"
                                          r"max \|Δ\|/spread"):
        onnx_export.export_engine(src, tmp_path / "e", cfg=ExportConfig(max_len=48, graph=graph), log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_a_quantized_graph_is_judged_on_the_calibration_text(tmp_path):
    """int4: KL and top-1 on the calibration text against the fp32 torch model (the random shapes are reported);
    the fp32 graph's check before quantization is recorded too; a floor the graph misses refuses it."""
    from dataclasses import asdict

    from specrt.export.errors import ExportError
    from specrt.export.onnx_export import export_engine
    from specrt.export.parity import BOUNDS

    src = make_model(tmp_path / "t", arch="llama", hidden=64, scale=20.0)
    lines = []
    out = export_engine(src, tmp_path / "e", cfg=ExportConfig(max_len=48, quantize="int4"), log=lines.append)
    p = json.loads((out / "manifest.json").read_text())["models"]["target"]["parity"]
    assert p["scheme"] == "int4" and p["reference"] == "torch fp32" and p["bounds"] == asdict(BOUNDS["int4"])
    cal = p["cases"]["calibration"]
    assert 0 < cal["kl_mean"] <= BOUNDS["int4"].kl_mean and cal["top1"] >= BOUNDS["int4"].top1 and cal["decided"] > 0
    assert p["unquantized"]["scheme"] == "fp32" and p["unquantized"]["cases"]["calibration"]["kl_mean"] < 1e-9
    assert any("parity int4 vs torch fp32 on the calibration text: KL mean" in line for line in lines)
    with pytest.raises(ExportError, match=r"int4 graph vs the torch model\): calibration: KL mean .* > 1e-06"):
        export_engine(src, tmp_path / "e2", log=lambda *_: None,
                      cfg=ExportConfig(max_len=48, quantize="int4", parity_bounds="kl_mean=1e-6"))
    assert not (tmp_path / "e2").exists()


def test_cli_parity_bounds_override_warns_and_is_recorded(tmp_path):
    from click.testing import CliRunner

    from specrt.export.parity import BOUNDS
    from specrt.tools.cli import cli

    t, _ = _tiny_pair(tmp_path)
    args = ["export", "--target", str(t), "--out", str(tmp_path / "e"), "--max-len", "16", "--prefill-chunk", "4"]
    res = CliRunner().invoke(cli, args + ["--parity-bounds", "kl_max=0.5,top1=none"])
    assert res.exit_code == 0, res.output
    assert "WARNING: --parity-bounds kl_max=0.5,top1=none" in res.output and "[bounds overridden" in res.output
    p = json.loads((tmp_path / "e" / "manifest.json").read_text())["models"]["target"]["parity"]
    assert p["override"] == "kl_max=0.5,top1=none" and p["bounds"]["kl_max"] == 0.5 and p["bounds"]["top1"] is None
    assert p["bounds"]["rel"] == BOUNDS["fp32"].rel  # the others as they were
    for bad in ("kl=1", "top1=high", ""):
        res = CliRunner().invoke(cli, args + ["--force", "--parity-bounds", bad])
        assert res.exit_code != 0 and "--parity-bounds" in res.output and "Traceback" not in res.output, bad


# ---- an engine dir appears whole or not at all ----------------------------------------------------------
def _tiny_pair(tmp_path):
    t = make_model(tmp_path / "t", arch="llama", vocab_size=32, hidden=16, layers=1, seed=3)
    return t, ExportConfig(gamma=2, max_len=16, prefill_chunk=4)


def test_export_into_an_existing_engine_dir_needs_force(tmp_path):
    from specrt.engines.manifest import load_manifest
    from specrt.export.errors import ExportError
    from specrt.export.onnx_export import export_engine

    t, cfg = _tiny_pair(tmp_path)
    out = export_engine(t, tmp_path / "e", cfg=cfg, log=lambda *_: None)
    m = json.loads((out / "manifest.json").read_text())
    m["defaults"]["gamma"] = 1  # what `specrt profile --write-defaults` writes
    (out / "manifest.json").write_text(json.dumps(m))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ExportError, match="exists and is not empty: pass --force"):
        export_engine(t, out, cfg=cfg, log=lambda *_: None)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # untouched
    (out / "draft.onnx").write_bytes(b"stale")
    export_engine(t, out, cfg=cfg, log=lambda *_: None, force=True)
    assert not (out / "draft.onnx").exists() and load_manifest(out).defaults["gamma"] is None  # replaced whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".e.")] == []  # nothing left beside it
    export_engine(t, tmp_path / "empty", cfg=cfg, log=lambda *_: None)  # an empty dir is no engine dir: fine


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["failure", "ctrl-c"])
def test_a_failed_or_interrupted_export_leaves_nothing(tmp_path, monkeypatch, error):
    from specrt.export import onnx_export

    t, cfg = _tiny_pair(tmp_path)
    d = make_model(tmp_path / "d", arch="llama", vocab_size=32, hidden=16, layers=1, seed=4)
    real, calls = onnx_export.export_graph, []

    def fail_on_the_draft(model, path, role_cfg):
        calls.append(path.name)
        if path.name == "draft.onnx":  # the target's graph is already written
            raise error
        return real(model, path, role_cfg)

    monkeypatch.setattr(onnx_export, "export_graph", fail_on_the_draft)
    with pytest.raises(type(error)):
        onnx_export.export_engine(t, tmp_path / "e", draft_dir=d, cfg=cfg, log=lambda *_: None)
    assert calls == ["target.onnx", "draft.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "t"]  # no engine dir, no partial dir


def test_a_draft_of_another_vocabulary_is_refused_before_any_graph(tmp_path, monkeypatch):
    from specrt.engines import EngineError
    from specrt.export import onnx_export

    t, cfg = _tiny_pair(tmp_path)
    d = make_model(tmp_path / "d", arch="llama", vocab_size=40, hidden=16, layers=1, seed=4)
    monkeypatch.setattr(onnx_export, "export_graph", lambda *a: pytest.fail("a graph was exported"))
    with pytest.raises(EngineError, match="draft vocabulary differs.*40 logits, target 32"):
        onnx_export.export_engine(t, tmp_path / "e", draft_dir=d, cfg=cfg, log=lambda *_: None)
    assert not list(tmp_path.rglob("*.onnx")) and not (tmp_path / "e").exists()


def test_cli_export_refuses_an_existing_dir_without_force(tmp_path):
    from click.testing import CliRunner

    from specrt.tools.cli import cli

    t, _ = _tiny_pair(tmp_path)
    args = ["export", "--target", str(t), "--out", str(tmp_path / "e"), "--max-len", "16", "--prefill-chunk", "4"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    res = CliRunner().invoke(cli, args)
    assert res.exit_code != 0 and "--force" in res.output and "Traceback" not in res.output
    assert CliRunner().invoke(cli, args + ["--force"]).exit_code == 0


def test_an_unsupported_draft_is_refused_before_any_graph(tmp_path, monkeypatch):
    import transformers as tf

    from specrt.export import onnx_export

    t, cfg = _tiny_pair(tmp_path)
    bloom = tf.BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2)
    tf.BloomForCausalLM(bloom).save_pretrained(tmp_path / "d")
    monkeypatch.setattr(onnx_export, "export_graph", lambda *a: pytest.fail("a graph was exported"))
    with pytest.raises(UnsupportedArchitecture, match="'BloomForCausalLM' is not supported"):
        onnx_export.export_engine(t, tmp_path / "e", draft_dir=tmp_path / "d", cfg=cfg, log=lambda *_: None)
    assert not (tmp_path / "e").exists()


def _mistral_window(tmp_path, window=8, hidden=32):
    import transformers as tf

    from tiny import make_tokenizer

    cfg = tf.MistralConfig(vocab_size=32, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=window, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    src = tmp_path / "mistral_window"
    model.save_pretrained(src)
    make_tokenizer(src, 32)
    return src, model


@pytest.mark.parametrize("hidden", [32, 64], ids=["head_dim8", "head_dim16"])
def test_sliding_window_is_honoured_past_the_window(tmp_path, hidden):
    """Mistral with a window of 8: prompts and generations longer than the window (and a prefill chunk of
    16 > 8) decode like HF generate, for every method; the graph applies the window itself (fused where the
    model can be: head_dim 16)."""
    import specrt
    from specrt.export.onnx_export import export_engine

    src, model = _mistral_window(tmp_path, hidden=hidden)
    engine = export_engine(src, tmp_path / "engine", draft_dir=src, log=lambda *_: None,
                           cfg=ExportConfig(max_len=64, prefill_chunk=16))
    spec = load_manifest(engine).target
    assert spec.windows == (8, 8) and spec.sliding_window is None
    rt = specrt.load(engine)
    for n in (5, 23, 40):
        prompt = ((np.arange(n) * 7 + 3) % 31 + 1).tolist()
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                pad_token_id=0, eos_token_id=None)[0, n:].tolist()
        for method in ("none", "ngram", "draft"):
            out = rt.generate(prompt, max_new_tokens=12, method=method).token_ids
            assert out == hf[: len(out)], (n, method)


def test_sliding_window_rows_of_a_batch_equal_batch_one(tmp_path):
    """Rows of different lengths in one batched pass each get their own window (past columns and new tokens)."""
    import specrt
    from reference import requests_for, run_all
    from specrt.export.onnx_export import export_engine
    from specrt.runtime.core import CoreConfig, DecodeCore
    from specrt.runtime.sampling import SamplingParams

    src, _ = _mistral_window(tmp_path)
    rt = specrt.load(export_engine(src, tmp_path / "engine", draft_dir=src, log=lambda *_: None,
                                   cfg=ExportConfig(max_len=64, prefill_chunk=16)))
    prompts = [((np.arange(n) * 5 + 2) % 31 + 1).tolist() for n in (3, 11, 20, 30)]
    for method in ("none", "draft"):
        core = rt.new_core(CoreConfig(max_batch=3, method=method, gamma=3 if method == "draft" else None))
        done = run_all(core, requests_for((p, SamplingParams(max_new_tokens=14)) for p in prompts))
        for i, p in enumerate(prompts):
            assert done[f"r{i}"][0] == rt.generate(p, max_new_tokens=14, method="none").token_ids, (method, i)
