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
    assert spec.quantize == scheme and m["quantization"]["matmuls"] == 2 * 5 + 1  # qkv, o, gate, up, down; lm_head
    report = m["parity_max_abs_diff"]
    assert all(case["logits"] <= m["tolerance"] for case in report.values())
    if scheme == "int8":  # int8 barely moves these logits; int4 may move an argmax
        assert all(case["argmax_agreement"] >= 0.75 for case in report.values())
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
