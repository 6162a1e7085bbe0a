"""`specrt export --eagle DIR` with an EAGLE-1/2 head in SafeAILab/EAGLE's layout (a Llama config of one layer,
pytorch_model.bin with fc.* and layers.0.*, no input norm on layer 0, fc over [embed; feature]), synthesized with
random weights: the exported head computes their head (an HF LlamaDecoderLayer without its input norm), greedy
equals plain, sampling is exact; a head for another base model is refused naming both."""
import json

import numpy as np
import pytest
import torch

import specrt
from tiny import EAGLE_TREE, make_model
from specrt.engines import OrtEngine
from specrt.export.errors import ExportError
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, export_engine
from stat_harness import P_MIN, exact_joint, p_values, run_trials

LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def their_config(target_dir) -> dict:
    t = json.loads((target_dir / "config.json").read_text())
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
            "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    return {**{k: t[k] for k in keys if k in t}, "rope_theta": 10000.0, "num_hidden_layers": 1,
            "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def write_their_head(target_dir, out, seed=0, hidden=None):
    """A random head saved the way SafeAILab/EAGLE saves its ea_layer (plus the base embedding, as they do)."""
    import transformers as tf

    cfg = their_config(target_dir)
    if hidden:
        cfg["hidden_size"] = hidden
    torch.manual_seed(seed)
    layer = tf.models.llama.modeling_llama.LlamaDecoderLayer(tf.LlamaConfig(**cfg), 0)
    h = cfg["hidden_size"]
    state = {"fc.weight": torch.randn(h, 2 * h) * 0.2, "fc.bias": torch.randn(h) * 0.1,
             "embed_tokens.weight": torch.randn(cfg["vocab_size"], h)}
    with torch.no_grad():
        for k in LAYER:
            state[f"layers.0.{k}"] = layer.state_dict()[k] + 0.05 * torch.randn_like(layer.state_dict()[k])
    out.mkdir(parents=True)
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(cfg))
    return out, state, cfg


def their_forward(state, cfg, target, ids, feats):
    """SafeAILab's head on one window from an empty cache: fc(cat(embed(x), f)) -> a Llama layer without input
    norm -> the target's LM head. ids [1, Q], feats [1, Q, H] -> logits [1, Q, V]."""
    import transformers as tf

    config = tf.LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    layer = tf.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    layer.load_state_dict({k: state[f"layers.0.{k}"] for k in LAYER}, strict=False)
    layer.input_layernorm = torch.nn.Identity()  # their index-0 layer has none
    rotary = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    q = ids.shape[1]
    x = torch.nn.functional.linear(torch.cat((target.get_input_embeddings()(ids), feats), -1), state["fc.weight"],
                                   state["fc.bias"])
    pos = torch.arange(q)[None]
    mask = torch.triu(torch.full((q, q), torch.finfo(torch.float32).min), 1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    return target.get_output_embeddings()(out)


@pytest.fixture(scope="module")
def their_engine(eagle_trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_upstream")
    head, state, cfg = write_their_head(eagle_trained["target"], root / "EAGLE-head")
    engine = export_engine(eagle_trained["target"], root / "engine", log=lambda *_: None,
                           cfg=ExportConfig(gamma=3, max_len=48, prefill_chunk=16), eagle_dir=head, eagle_tree=EAGLE_TREE)
    return engine, state, cfg


def test_exported_head_computes_their_head(their_engine, eagle_trained):
    engine, state, cfg = their_engine
    target = load_hf(eagle_trained["target"])
    q, h = 6, cfg["hidden_size"]
    g = torch.Generator().manual_seed(1)
    ids, feats = torch.randint(0, cfg["vocab_size"], (1, q), generator=g), torch.randn(1, q, h, generator=g)
    with torch.no_grad():
        ref = their_forward(state, cfg, target, ids, feats).numpy()
    from specrt.contract import chain_mask

    m = json.loads((engine / "manifest.json").read_text())["eagle"]
    empty = np.zeros((0, 1, m["num_kv_heads"], m["head_dim"]), np.float32)
    got = OrtEngine(engine / "eagle.onnx").run({"input_ids": ids.numpy(), "hidden": feats.numpy(),
                                                "position_ids": np.arange(q)[None], "attention_mask": chain_mask(0, q),
                                                "past_key.0": empty, "past_value.0": empty})["logits"]
    np.testing.assert_allclose(got, ref, atol=1e-3)


def test_their_head_decodes_greedy_and_exact(their_engine, eagle_trained):
    engine, _, _ = their_engine
    rt = specrt.load(engine)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert (rt.generate(prompt, max_new_tokens=16, method="eagle", gamma=1).token_ids
            == rt.generate(prompt, max_new_tokens=16, method="none").token_ids)
    V = rt.manifest.target.geometry.vocab_size
    counts, _ = run_trials(rt, prompt, 1500, V, method="eagle", gamma=1, temperature=1.0)
    pv = p_values(counts, exact_joint(load_hf(eagle_trained["target"]), prompt, {"temperature": 1.0}, V))
    assert min(pv.values()) > P_MIN, pv


def test_their_head_for_another_base_model_is_refused(eagle_trained, tmp_path):
    head, _, _ = write_their_head(eagle_trained["target"], tmp_path / "EAGLE-head", hidden=64)
    with pytest.raises(ExportError, match=r"EAGLE head .*EAGLE-head.*hidden 64.*the target's are hidden 32.*target .*target"):
        export_engine(eagle_trained["target"], tmp_path / "engine", log=lambda *_: None, cfg=ExportConfig(max_len=48),
                      eagle_dir=head, eagle_tree=EAGLE_TREE)
    assert not (tmp_path / "engine").exists()
