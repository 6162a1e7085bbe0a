"""EAGLE-1/2 heads as SafeAILab/EAGLE writes them, read into specrt's ``EagleHead``.

Their head dir: ``config.json`` (a Llama config of the draft layer: hidden_size, num_attention_heads,
num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta, vocab_size, num_hidden_layers = 1)
and ``pytorch_model.bin`` or ``model.safetensors`` with ``fc.weight`` / ``fc.bias`` and the layer as
``layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight``
(``embed_tokens.weight``, if present, is the base model's and is not read: specrt attaches the
target's). Their layer 0 has no input norm and their fc reads ``cat(embed(x_{t+1}), f_t)``; the
features are the base model's last hidden state after its final norm and the predicted feature goes
to the base LM head without a norm: specrt's head with ``input_norm=False, embed_first=True``.
"""
from __future__ import annotations

import json
from pathlib import Path

from .eagle3_upstream import upstream_kind
from .eagle_config import EagleConfig, EagleError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight")


def _config(head_dir) -> dict | None:
    path = Path(head_dir) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def is_upstream_eagle(head_dir) -> bool:
    """A SafeAILab head dir: a Llama-style config (not specrt's format) beside one of their weight files."""
    raw = _config(head_dir)
    return (raw is not None and raw.get("format") is None and "hidden_size" in raw
            and any((Path(head_dir) / f).is_file() for f in WEIGHT_FILES) and upstream_kind(head_dir) is None)


def read_upstream_config(head_dir):
    raw = _config(head_dir)
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise EagleError(f"{head_dir}: {raw['num_hidden_layers']} draft layers; specrt's EAGLE head has one")
    heads = int(raw["num_attention_heads"])
    cfg = EagleConfig(hidden_size=int(raw["hidden_size"]), vocab_size=int(raw["vocab_size"]), num_heads=heads,
                      num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                      intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                      rope_theta=float(raw.get("rope_theta", 10000.0)), input_norm=False, embed_first=True)
    return cfg, {**raw, "accuracy": None, "source_format": "SafeAILab/EAGLE"}


def read_upstream_state(head_dir) -> dict:
    """Their weights under specrt's names (``fc.*``, ``layer.*``)."""
    import torch

    d = Path(head_dir)
    if (d / WEIGHT_FILES[0]).is_file():
        from safetensors.torch import load_file

        state = load_file(str(d / WEIGHT_FILES[0]))
    else:
        state = torch.load(d / WEIGHT_FILES[1], map_location="cpu", weights_only=True)
    missing = [k for k in ("fc.weight", "fc.bias", *(f"layers.0.{k}" for k in LAYER_KEYS)) if k not in state]
    if missing:
        raise EagleError(f"{head_dir}: not an EAGLE-1/2 head (missing {missing[:3]})")
    out = {"fc.weight": state["fc.weight"], "fc.bias": state["fc.bias"]}
    out.update({f"layer.{k}": state[f"layers.0.{k}"] for k in LAYER_KEYS})
    return out
