"""Medusa-1 heads as FasterDecoding/Medusa writes them: their config and weights under specrt's names
(medusa_heads.load_heads builds a ``MedusaHeads`` of them).

Their heads dir: ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and
``base_model_name_or_path``, and ``medusa_lm_head.pt`` (or ``.safetensors``): the state dict of
``nn.ModuleList([nn.Sequential(*[ResBlock] * L, nn.Linear(H, V, bias=False))] * K)``, keys
``{k}.{j}.linear.weight`` / ``.bias`` (j < L; their list repeats ONE ResBlock, so all j share it)
and ``{k}.{L}.weight`` for the output layer. The function is specrt's head exactly:
``W_k · ResBlock^L(h)`` with ``ResBlock(x) = x + SiLU(A x + b)``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .medusa_config import HeadsConfig, HeadsError

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def is_upstream_medusa(heads_dir: str | Path) -> bool:
    d = Path(heads_dir)
    return any((d / f).is_file() for f in WEIGHT_FILES) and (d / "config.json").is_file()


def read_upstream_config(heads_dir: str | Path) -> tuple[HeadsConfig, dict]:
    """(config with sizes read from the weights, raw config.json) of a FasterDecoding heads dir."""
    d = Path(heads_dir)
    try:
        raw = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HeadsError(f"{d / 'config.json'} is not valid JSON: {e}") from None
    if "medusa_num_heads" not in raw:
        raise HeadsError(f"{d / 'config.json'}: no medusa_num_heads (not a Medusa heads dir)")
    k, layers = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
    state = read_state(d)
    out = state.get(f"0.{layers}.weight")
    if out is None:
        raise HeadsError(f"{d}: no output layer '0.{layers}.weight' for medusa_num_layers={layers}")
    cfg = HeadsConfig(num_heads=k, num_layers=layers, hidden_size=int(out.shape[1]), vocab_size=int(out.shape[0]))
    return cfg, {**raw, "accuracy": None, "source_format": "FasterDecoding/Medusa"}


def read_state(d: Path) -> dict:
    if (d / WEIGHT_FILES[0]).is_file():
        from safetensors.torch import load_file

        return load_file(str(d / WEIGHT_FILES[0]))
    return torch.load(d / WEIGHT_FILES[1], map_location="cpu", weights_only=True)


def read_upstream_state(heads_dir: str | Path, cfg: HeadsConfig) -> dict:
    """Their weights under ``MedusaHeads``' names (``blocks.{k}.{j}.linear.*``, ``lm_heads.{k}.weight``)."""
    state = read_state(Path(heads_dir))
    mapped = {}
    for k in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            for p in ("weight", "bias"):
                mapped[f"blocks.{k}.{j}.linear.{p}"] = state[f"{k}.{j}.linear.{p}"]
        mapped[f"lm_heads.{k}.weight"] = state[f"{k}.{cfg.num_layers}.weight"]
    return mapped


def base_model_of(heads_dir: str | Path) -> str | None:
    """The base model a FasterDecoding heads dir names (``base_model_name_or_path``), else None."""
    path = Path(heads_dir) / "config.json"
    if not is_upstream_medusa(heads_dir):
        return None
    try:
        return json.loads(path.read_text()).get("base_model_name_or_path")
    except json.JSONDecodeError:
        return None
