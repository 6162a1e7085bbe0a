"""`specrt export --eagle DIR` with EAGLE-3 heads as SafeAILab/EAGLE (``midlayer.*``, pytorch_model.bin) and
speculators (``layers.0.*``, ``transformer_layer_config``, norm_before_residual, recorded aux layers) write them,
synthesized with random weights and a reduced draft vocabulary: the exported graphs compute their head (a plain
torch re-implementation of their forward, HF's rotary embedding), greedy equals plain. And the target's
``aux_hidden`` output, in both graph kinds, is the HF hidden states entering the chosen layers."""
import json

import numpy as np
import pytest
import torch

import specrt
from specrt.contract import chain_mask
from specrt.engines import OrtEngine
from specrt.export.errors import ExportError
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, export_engine, export_graph
from tiny import EAGLE_TREE, make_model

V, DRAFT_V, LAYERS = 16, 11, 6
LAYER = ("hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
         "mlp.up_proj.weight", "mlp.down_proj.weight")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("eagle3_up") / "target", vocab_size=V, layers=LAYERS, scale=10.0,
                      eos_token_id=None)


def layer_config(target_dir) -> dict:
    t = json.loads((target_dir / "config.json").read_text())
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
            "vocab_size", "max_position_embeddings")
    return {**{k: t[k] for k in keys}, "rope_theta": 10000.0, "num_hidden_layers": 1, "model_type": "llama",
            "hidden_act": "silu"}


def their_state(cfg: dict, seed: int, prefix: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, i = h // nh, cfg["intermediate_size"]
    shapes = {"hidden_norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (nh * d, 2 * h), "self_attn.k_proj.weight": (nkv * d, 2 * h),
              "self_attn.v_proj.weight": (nkv * d, 2 * h), "self_attn.o_proj.weight": (h, nh * d),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    state = {prefix + k: (1 + 0.2 * torch.randn(s, generator=g)) if k.endswith("norm.weight")
             else 0.3 * torch.randn(s, generator=g) for k, s in shapes.items()}
    ids = torch.randperm(V, generator=g)[:DRAFT_V].sort().values  # [Vd] target ids of the draft vocabulary
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    state.update({"fc.weight": 0.2 * torch.randn(h, 3 * h, generator=g), "norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                  "lm_head.weight": torch.randn(DRAFT_V, h, generator=g), "d2t": ids - torch.arange(DRAFT_V),
                  "t2d": t2d, "embed_tokens.weight": torch.randn(V, h, generator=g)})
    return state


def write_safeailab(target_dir, out, seed=0, hidden=None):
    cfg = {**layer_config(target_dir), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_V}
    if hidden:
        cfg["hidden_size"] = hidden
    state = their_state(cfg, seed, "midlayer.")
    out.mkdir(parents=True)
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(cfg))
    return out, state, cfg


def write_speculators(target_dir, out, layers, seed=1):
    from safetensors.torch import save_file

    layer = layer_config(target_dir)
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
           "draft_vocab_size": DRAFT_V, "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": layers,
           "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["LlamaForCausalLM"]}}}
    state = their_state(layer, seed, "layers.0.")
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out, state, {**layer, "norm_before_residual": True}


def their_forward(state, cfg, prefix, embed, aux, ids):
    """Their EAGLE-3 head on one chain from an empty cache, in plain torch: aux [1, Q, 3H], ids [1, Q] -> logits
    [1, Q, V] with -inf outside the draft vocabulary (vLLM's compute_logits)."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    w = {k: state[prefix + k] for k in LAYER}
    eps, h, nh, nkv = cfg["rms_norm_eps"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, q = h // nh, ids.shape[1]

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    g = aux @ state["fc.weight"].T
    normed = rms(g, w["hidden_norm.weight"])
    residual = normed if cfg.get("norm_before_residual") else g
    x = torch.cat((rms(embed(ids), w["input_layernorm.weight"]), normed), -1)  # [1, Q, 2H]
    qs = (x @ w["self_attn.q_proj.weight"].T).view(1, q, nh, d).transpose(1, 2)
    ks = (x @ w["self_attn.k_proj.weight"].T).view(1, q, nkv, d).transpose(1, 2)
    vs = (x @ w["self_attn.v_proj.weight"].T).view(1, q, nkv, d).transpose(1, 2)
    rotary = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(tf.LlamaConfig(**cfg))
    cos, sin = rotary(x, torch.arange(q)[None])
    qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
    ks, vs = ks.repeat_interleave(nh // nkv, 1), vs.repeat_interleave(nh // nkv, 1)
    scores = qs @ ks.transpose(-1, -2) / d ** 0.5 + torch.triu(torch.full((q, q), float("-inf")), 1)
    att = (torch.softmax(scores, -1) @ vs).transpose(1, 2).reshape(1, q, nh * d)
    hs = residual + att @ w["self_attn.o_proj.weight"].T
    m = rms(hs, w["post_attention_layernorm.weight"])
    hs = hs + (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w[
        "mlp.down_proj.weight"].T
    draft = rms(hs, state["norm.weight"]) @ state["lm_head.weight"].T  # [1, Q, Vd]
    full = torch.full((1, q, V), float("-inf"))
    full[..., torch.arange(DRAFT_V) + state["d2t"]] = draft
    return full


def exported_logits(engine, aux, ids):
    m = json.loads((engine / "manifest.json").read_text())["eagle"]
    g = OrtEngine(engine / m["fc_file"]).run({"aux_hidden": aux.numpy()})["hidden"]
    q = ids.shape[1]
    empty = np.zeros((0, 1, m["num_kv_heads"], m["head_dim"]), np.float32)
    return OrtEngine(engine / m["file"]).run({"input_ids": ids.numpy(), "hidden": g, "position_ids": np.arange(q)[None],
                                              "attention_mask": chain_mask(0, q), "past_key.0": empty,
                                              "past_value.0": empty})["logits"]


@pytest.mark.parametrize("fmt", ["SafeAILab", "speculators"])
def test_exported_head_computes_their_head(target, tmp_path, fmt):
    layers = [1, 3, 4]
    if fmt == "SafeAILab":
        head, state, cfg = write_safeailab(target, tmp_path / "head")
        prefix, want_layers = "midlayer.", [2, 3, 3]  # not recorded: EAGLE-3's default for 6 layers
    else:
        head, state, cfg = write_speculators(target, tmp_path / "head", layers)
        prefix, want_layers = "layers.0.", layers
    engine = export_engine(target, tmp_path / "engine", log=lambda *_: None, eagle_dir=head, eagle_tree=EAGLE_TREE,
                           cfg=ExportConfig(gamma=3, max_len=48, prefill_chunk=16))
    m = json.loads((engine / "manifest.json").read_text())
    assert m["eagle"]["version"] == 3 and m["eagle"]["aux_hidden_layers"] == want_layers
    assert m["eagle"]["draft_vocab_size"] == DRAFT_V
    model = load_hf(target)
    g = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, V, (1, 6), generator=g), torch.randn(1, 6, 3 * cfg["hidden_size"], generator=g)
    with torch.no_grad():
        ref = their_forward(state, cfg, prefix, model.get_input_embeddings(), aux, ids).numpy()
    got = exported_logits(engine, aux, ids)
    inside = np.isfinite(ref)
    np.testing.assert_allclose(got[inside], ref[inside], atol=1e-3)
    assert (got[~inside] < -6e4).all()
    rt = specrt.load(engine)
    for prompt in ([5], [3, 1, 4, 1, 5, 9, 2, 6]):
        assert (rt.generate(prompt, max_new_tokens=12, method="eagle", gamma=1).token_ids
                == rt.generate(prompt, max_new_tokens=12, method="none").token_ids)


def test_their_head_for_another_target_is_refused(target, tmp_path):
    head, _, _ = write_safeailab(target, tmp_path / "EAGLE3-head", hidden=64)
    with pytest.raises(ExportError, match=r"EAGLE-?3? head .*EAGLE3-head.*hidden 64.*the target's are hidden 32"):
        export_engine(target, tmp_path / "engine", log=lambda *_: None, cfg=ExportConfig(max_len=48),
                      eagle_dir=head, eagle_tree=EAGLE_TREE)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("graph", ["traced", "fused"])
def test_aux_hidden_output_is_the_layers_inputs(tmp_path, graph):
    """aux_hidden of layers [0, 3, 1] (any order, 0 = the embeddings) equals HF's hidden_states, in both graph kinds."""
    model = load_hf(make_model(tmp_path / "t", vocab_size=V, hidden=64, layers=4))
    entry = export_graph(model, tmp_path / "t.onnx", ExportConfig(max_len=64, graph=graph, aux_layers=(0, 3, 1)))
    assert entry["aux_hidden_layers"] == [0, 3, 1] and entry["outputs"][-1]["shape"][-1] == 3 * 64
    assert entry["kv_layout"] == ("in_place" if graph == "fused" else "time_major")
    assert entry["parity_max_abs_diff"]["prefill"]["hidden"] < 1e-4  # aux_hidden checked against torch at export
