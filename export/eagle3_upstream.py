"""EAGLE-3 heads as SafeAILab/EAGLE and as speculators (the format vLLM loads) write them, read into ``Eagle3Head``.

SafeAILab (``eagle3`` cnets): ``config.json`` is a Llama config of the draft layer (hidden_size,
num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta, vocab_size,
``draft_vocab_size``, architectures ``LlamaForCausalLMEagle3``); weights (``model.safetensors`` or
``pytorch_model.bin``): ``fc.weight`` [H, 3H], ``midlayer.{hidden_norm, input_layernorm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2H],
``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight`` [Vd, H], ``d2t`` int64 [Vd] and ``t2d`` bool [V]. The residual is the raw feature
(norm_before_residual False). Their target fuses layers 2, L//2, L-3 (not recorded in the config).

speculators (``"speculators_model_type": "eagle3"``): the layer's Llama config under
``transformer_layer_config``; ``draft_vocab_size``, ``norm_before_residual`` (default True, as vLLM
reads it) and optionally ``eagle_aux_hidden_state_layer_ids`` at the top level; the same weights
with the layer under ``layers.0.`` instead of ``midlayer.``. ``embed_tokens.weight``, if present in
either, is the base model's and is not read (specrt attaches the target's).
"""
from __future__ import annotations

import json
from pathlib import Path

from .eagle_config import Eagle3Config, EagleError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER_KEYS = ("hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
              "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
PREFIX = {"SafeAILab/EAGLE-3": "midlayer.", "speculators": "layers.0."}  # where each format keeps the layer


def _config(head_dir) -> dict | None:
    path = Path(head_dir) / "config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def upstream_kind(head_dir) -> str | None:
    """"SafeAILab/EAGLE-3" | "speculators" | None (not an upstream EAGLE-3 dir)."""
    raw = _config(head_dir)
    if raw is None or raw.get("format") is not None or not any((Path(head_dir) / f).is_file() for f in WEIGHT_FILES):
        return None
    if raw.get("speculators_model_type") == "eagle3":
        return "speculators"
    arch = " ".join(raw.get("architectures") or [])
    if "hidden_size" in raw and ("Eagle3" in arch or "draft_vocab_size" in raw):
        return "SafeAILab/EAGLE-3"
    return None


def read_upstream3_config(head_dir):
    raw, kind = _config(head_dir), upstream_kind(head_dir)
    layer = (raw.get("transformer_layer_config") or {}) if kind == "speculators" else raw
    if not isinstance(layer, dict) or "hidden_size" not in layer:
        raise EagleError(f"{head_dir}: {kind} EAGLE-3 config without the layer's hidden_size")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise EagleError(f"{head_dir}: {layer['num_hidden_layers']} draft layers; specrt's EAGLE-3 head has one")
    scaling = layer.get("rope_scaling") or {}
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise EagleError(f"{head_dir}: rope_scaling {scaling} is not supported by specrt's EAGLE-3 head (plain RoPE)")
    heads = int(layer["num_attention_heads"])
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or []
    try:
        cfg = Eagle3Config(hidden_size=int(layer["hidden_size"]), vocab_size=int(layer["vocab_size"]), num_heads=heads,
                           num_kv_heads=int(layer.get("num_key_value_heads") or heads),
                           intermediate_size=int(layer["intermediate_size"]),
                           rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                           rope_theta=float(layer.get("rope_theta", 10000.0)),
                           draft_vocab_size=int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or 0),
                           aux_layers=[int(i) for i in aux],
                           norm_before_residual=bool(raw.get("norm_before_residual", kind == "speculators")))
    except (KeyError, TypeError, ValueError) as e:
        raise EagleError(f"{head_dir}: incomplete {kind} EAGLE-3 config ({e})") from None
    return cfg, {**raw, "accuracy": None, "source_format": kind}


def read_upstream3_state(head_dir) -> dict:
    """Their weights under specrt's names (``fc.*``, ``midlayer.*``, ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d``)."""
    import torch

    d, prefix = Path(head_dir), PREFIX[upstream_kind(head_dir)]
    if (d / WEIGHT_FILES[0]).is_file():
        from safetensors.torch import load_file

        state = load_file(str(d / WEIGHT_FILES[0]))
    else:
        state = torch.load(d / WEIGHT_FILES[1], map_location="cpu", weights_only=True)
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
             **{f"midlayer.{k}": prefix + k for k in LAYER_KEYS}}
    missing = [theirs for theirs in names.values() if theirs not in state]
    if missing:
        raise EagleError(f"{head_dir}: not an EAGLE-3 head (missing {missing[:3]})")
    # d2t / t2d may be absent where the draft vocabulary is the target's (load_head3 checks)
    return {ours: state[theirs] for ours, theirs in names.items()} | {k: state[k] for k in ("d2t", "t2d") if k in state}
