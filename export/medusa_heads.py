"""Medusa heads (Medusa-1 style): the torch module, its files, and its ONNX graph (its config and error:
medusa_config.py; FasterDecoding's heads dirs: medusa_upstream.py).

Head k (k = 1..K) reads the target's last hidden state h_t (after the final norm) at position t,
whose own LM head predicts token t+1, and predicts token t+1+k:

    head_k(h) = W_k · R_k(h),   R_k = ResBlock^L,   ResBlock(x) = x + SiLU(A x + b)

A is zero-initialised (each block starts as the identity) and W_k starts as a copy of the
target's LM head, as in Medusa; the target itself stays frozen.

Heads dir (written by `specrt train medusa`):
    config.json        {"format": "specrt-medusa-heads", "num_heads", "num_layers", "hidden_size",
                        "vocab_size", "target": {...}, "accuracy": {...}, ...}
    model.safetensors  the weights (fp16 by default)

Heads graph (`medusa.onnx` in an engine dir):
    hidden          model dtype [B, H]      the target's `hidden` at the last accepted position
    ->
    medusa_logits   float32     [B, K, V]   logits of heads 1..K
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .head_files import read_head_dir, write_head_dir
from .medusa_config import FORMAT, HeadsConfig, HeadsError
from .medusa_upstream import is_upstream_medusa, read_upstream_config, read_upstream_state

TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}  # max |ORT - torch| on head logits at export, per dtype


class ResBlock(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        torch.nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.linear(x))


class MedusaHeads(torch.nn.Module):
    """K heads; ``forward(hidden [..., H]) -> logits [..., K, V]``."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)])
            for _ in range(cfg.num_heads))
        self.lm_heads = torch.nn.ModuleList(
            torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_heads))

    def init_from_lm_head(self, weight: torch.Tensor) -> None:
        """Copy the target's LM head weight [V, H] into every head's output layer."""
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(weight)

    def forward(self, hidden):
        return torch.stack([lm(block(hidden)) for block, lm in zip(self.blocks, self.lm_heads)], dim=-2)

    def first(self, n: int) -> "MedusaHeads":
        """A module with heads 1..n only (sharing these weights): a tree of depth n needs no more."""
        out = MedusaHeads(replace(self.cfg, num_heads=n))
        out.blocks, out.lm_heads = self.blocks[:n], self.lm_heads[:n]
        return out


def save_heads(heads: MedusaHeads, out: str | Path, extra: dict | None = None, dtype=torch.float16) -> Path:
    """Write config.json + model.safetensors (weights cast to ``dtype``)."""
    return write_head_dir(out, heads.state_dict(), heads.cfg, FORMAT, dtype, extra)


def read_heads_config(heads_dir: str | Path) -> tuple[HeadsConfig, dict]:
    """specrt's heads dir, or a Medusa-1 checkpoint as FasterDecoding/Medusa writes it (export/medusa_upstream.py)."""
    if is_upstream_medusa(heads_dir):
        return read_upstream_config(heads_dir)
    return read_head_dir(heads_dir, FORMAT, HeadsConfig, HeadsError, "a Medusa heads", "heads", "specrt train medusa")


def load_heads(heads_dir: str | Path, dtype=torch.float32) -> tuple[MedusaHeads, dict]:
    """(heads module in eval mode, raw config dict); either format of ``read_heads_config``."""
    from safetensors.torch import load_file

    if is_upstream_medusa(heads_dir):
        return load_upstream_heads(heads_dir, dtype)
    cfg, raw = read_heads_config(heads_dir)
    heads = MedusaHeads(cfg)
    state = load_file(str(Path(heads_dir) / "model.safetensors"))
    missing, unexpected = heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise HeadsError(f"{heads_dir}: weights do not match config.json (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    return heads.to(dtype).eval(), raw


def load_upstream_heads(heads_dir: str | Path, dtype=torch.float32) -> tuple[MedusaHeads, dict]:
    """specrt heads holding a FasterDecoding checkpoint's weights (eval mode), and its raw config."""
    cfg, raw = read_upstream_config(heads_dir)
    state = read_upstream_state(heads_dir, cfg)
    heads = MedusaHeads(cfg)
    try:
        heads.load_state_dict({n: t.float() for n, t in state.items()})
    except (RuntimeError, KeyError) as e:
        raise HeadsError(f"{heads_dir}: weights do not match medusa_num_heads/medusa_num_layers ({e})") from None
    return heads.to(dtype).eval(), raw


def check_heads_match(cfg: HeadsConfig, hidden_size: int, vocab_size: int, vocab_sha256: str | None = None,
                      where: str = "heads") -> None:
    """Heads must read the target's hidden size and score its vocabulary; raises ``HeadsError``."""
    if cfg.hidden_size != hidden_size:
        raise HeadsError(f"{where} were trained for another target: hidden size {cfg.hidden_size}, "
                         f"but the target's is {hidden_size}")
    if cfg.vocab_size != vocab_size:
        raise HeadsError(f"{where} were trained for another target: vocabulary size {cfg.vocab_size}, "
                         f"but the target's is {vocab_size}")
    if vocab_sha256 and cfg.target_vocab_sha256 and cfg.target_vocab_sha256 != vocab_sha256:
        raise HeadsError(f"{where} were trained for another target: tokenizer vocabulary sha256 "
                         f"{cfg.target_vocab_sha256[:12]} differs from the target's {vocab_sha256[:12]}")


class _HeadsGraph(torch.nn.Module):
    def __init__(self, heads: MedusaHeads):
        super().__init__()
        self.heads = heads

    def forward(self, hidden):
        return self.heads(hidden).float()


def export_heads_graph(heads: MedusaHeads, path: Path, dtype: str, opset: int = 17) -> dict:
    """Export the heads graph, check ORT against torch, return its manifest section (without the tree)."""
    from ..engines.ort import OrtEngine

    cfg = heads.cfg
    tdtype = torch.float16 if dtype == "fp16" else torch.float32
    graph = _HeadsGraph(heads.to(tdtype).eval())
    g = torch.Generator().manual_seed(0)
    example = torch.randn(3, cfg.hidden_size, generator=g).to(tdtype)
    with torch.no_grad():
        ref = graph(example).numpy()
    t0 = time.time()
    with torch.no_grad():
        torch.onnx.export(graph, (example,), str(path), input_names=["hidden"], output_names=["medusa_logits"],
                          dynamic_axes={"hidden": {0: "batch"}, "medusa_logits": {0: "batch"}},
                          opset_version=opset, dynamo=False)
    got = OrtEngine(path).run({"hidden": example.numpy()})["medusa_logits"]
    diff = float(np.abs(got - ref).max())
    if diff > TOLERANCE[dtype]:
        raise HeadsError(f"heads graph parity check failed: max |ORT - torch| {diff:.2e} > {TOLERANCE[dtype]:.0e}")
    kv = "float16" if dtype == "fp16" else "float32"
    return {"file": path.name, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "dtype": dtype,
            "inputs": [{"name": "hidden", "dtype": kv, "shape": ["batch", cfg.hidden_size]}],
            "outputs": [{"name": "medusa_logits", "dtype": "float32",
                         "shape": ["batch", cfg.num_heads, cfg.vocab_size]}],
            "parameters": sum(p.numel() for p in heads.parameters()),
            "export_seconds": round(time.time() - t0, 1), "parity_max_abs_diff": diff,
            "tolerance": TOLERANCE[dtype]}
