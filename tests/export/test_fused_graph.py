"""The fused graph (export/fused_graph.py): which models get it, model variants it must get right,
and weight quantization (export/quantize.py)."""
import json

import numpy as np
import pytest
import torch

import specrt
from tiny import make_model
from specrt.engines.manifest import load_manifest
from specrt.export.errors import ExportError
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, export_engine

FUSED = dict(arch="llama", hidden=64, scale=20.0)  # head_dim 16: GroupQueryAttention's smallest


def export(tmp_path, name, target, **cfg):
    src = make_model(tmp_path / f"{name}_model", **target)
    return export_engine(src, tmp_path / name, log=lambda *_: None, cfg=ExportConfig(max_len=48, **cfg))


def greedy_pair(engine_dir, model_dir, prompt, n=12):
    model = load_hf(model_dir)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    out = specrt.load(engine_dir).generate(prompt, max_new_tokens=n, method="none")
    return out.token_ids, hf[: len(out.token_ids)]


def test_auto_picks_the_fused_graph_and_falls_back_with_the_reason(tmp_path):
    fused = export(tmp_path, "fused", FUSED)
    traced = export(tmp_path, "traced", dict(arch="llama"))  # hidden 32, 4 heads: head_dim 8
    m = json.loads((fused / "manifest.json").read_text())
    assert m["schema_version"] == 2 and m["models"]["target"]["kv_layout"] == "in_place"
    assert load_manifest(traced).target.kv_layout == "time_major"
    with pytest.raises(ExportError, match="head_dim 8"):
        export(tmp_path, "refused", dict(arch="llama"), graph="fused")
    with pytest.raises(ExportError, match="GPT2LMHeadModel has no fused graph"):
        export(tmp_path, "gpt2", dict(arch="gpt2"), graph="fused")


@pytest.mark.parametrize("variant", [
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}),
    dict(tie_word_embeddings=True),
    dict(attention_bias=True, mlp_bias=True),
], ids=["llama3-rope", "tied", "biases"])
def test_llama_variants_decode_like_hf(tmp_path, variant):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, **variant)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    src = tmp_path / "model"
    model.save_pretrained(src)
    from tiny import make_tokenizer

    make_tokenizer(src, 32)
    engine = export_engine(src, tmp_path / "engine", log=lambda *_: None, cfg=ExportConfig(max_len=48))
    assert load_manifest(engine).target.kv_layout == "in_place"
    prompt = ((np.arange(23) * 7 + 3) % 31 + 1).tolist()  # past the rope's original 16 positions
    ours, hf = greedy_pair(engine, src, prompt)
    assert ours == hf


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_export_is_recorded_and_close(tmp_path, scheme):
    engine = export(tmp_path, scheme, FUSED, quantize=scheme)
    spec = load_manifest(engine).target
    m = json.loads((engine / "manifest.json").read_text())["models"]["target"]
    assert spec.quantize == scheme and m["quantization"]["matmuls"] == 2 * 4 + 1  # qkv, o, gate|up, down; lm_head
    p = m["parity"]  # judged against the fp32 torch model on the calibration text
    cal = p["cases"]["calibration"]
    assert p["scheme"] == scheme and cal["kl_mean"] <= p["bounds"]["kl_mean"] and cal["top1"] >= p["bounds"]["top1"]
    out = specrt.load(engine).generate([3, 1, 4, 1, 5], max_new_tokens=8, method="none")
    assert len(out.token_ids) >= 1


def test_a_quantized_draft_can_differ_from_the_target(tmp_path):
    t = make_model(tmp_path / "t", **FUSED)
    d = make_model(tmp_path / "d", **{**FUSED, "seed": 1})
    engine = export_engine(t, tmp_path / "e", draft_dir=d, log=lambda *_: None,
                           cfg=ExportConfig(max_len=48, quantize=None, draft_quantize="int8"))
    m = load_manifest(engine)
    assert m.target.quantize is None and m.draft.quantize == "int8"
    out = specrt.load(engine).generate([3, 1, 4], max_new_tokens=8, method="draft")
    plain = specrt.load(engine).generate([3, 1, 4], max_new_tokens=8, method="none")
    assert out.token_ids == plain.token_ids  # greedy output is the target's whatever the draft's precision


def test_the_fused_graph_window_mask_follows_the_contract_rule():
    """export/windows.py's ONNX window mask, alone in a graph, on in-place rows of different lengths (mask
    column t of row b = the row's entry t; new entries at [L_b, L_b + Q) hold position_ids, here a tree's
    L + depth on row 0): equal to ``contract.window_hides`` on those key positions, per window."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specrt.contract import MASK_MIN, window_hides
    from specrt.export.fused_graph import _Graph
    from specrt.export.windows import window_masks

    g = _Graph()
    names = window_masks(g, [None, 3, 5, 3])
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("attention_mask", f32, ["b", 1, "q", "t"]),
              helper.make_tensor_value_info("position_ids", i64, ["b", "q"]),
              helper.make_tensor_value_info("seqlens_k", i32, ["b"])]
    outputs = [helper.make_tensor_value_info(names[w], f32, None) for w in (3, 5)]
    proto = helper.make_model(helper.make_graph(g.nodes, "windows", inputs, outputs, g.inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 9
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    lengths, q = np.array([5, 9]), 3
    positions = np.array([[5, 6, 6], [9, 10, 11]])  # row 0: a root and two children
    mask = np.random.default_rng(0).choice([0.0, MASK_MIN], size=(2, 1, q, 12)).astype(np.float32)
    got = session.run(None, {"attention_mask": mask, "position_ids": positions,
                             "seqlens_k": (lengths + q - 1).astype(np.int32)})
    for w, out in zip((3, 5), got):
        for b in range(2):
            cols = lengths[b] + q  # the row's entries; columns past them are the longer row's (masked anyway)
            key_pos = np.concatenate([np.arange(lengths[b]), positions[b]])
            want = np.where(window_hides(key_pos, positions[b], w), MASK_MIN, mask[b, 0, :, :cols])
            np.testing.assert_array_equal(out[b, 0, :, :cols], want)
