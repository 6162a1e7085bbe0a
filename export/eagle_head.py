"""The EAGLE head (EAGLE-1 style): the torch module, its files, and its ONNX graph (its config and
error: eagle_config.py; its Llama layer: eagle_layers.py; SafeAILab's head dirs: eagle_upstream.py).

EAGLE autoregresses at the feature level. Its features are the target's ``hidden`` output (the
last hidden state after the final norm, the vector the target's LM head reads; exported by
``ExportConfig.with_hidden``). At position t the head reads the feature f_t (which the target's
LM head turns into the distribution of token t+1) together with the token x_{t+1} actually
placed there, and predicts the next feature f_{t+1}:

    z_t     = fc([f_t ; embed(x_{t+1})])           2H -> H
    f̂_{t+1} = LlamaDecoderLayer(z)_t              one layer, causal self-attention, its own KV cache
    logits  = lm_head(f̂_{t+1})                    the target's FROZEN LM head: predicts x_{t+2}

Because f is taken after the target's final norm, the target's logits are exactly lm_head(f):
no norm is applied again to the predicted feature. ``embed`` and ``lm_head`` are frozen copies
of the target's input embedding and LM head; they are not written to the head dir (they are
copied from the target when the head is loaded), only ``fc`` and the decoder layer are.

Head dir (written by `specrt train eagle`):
    config.json        {"format": "specrt-eagle-head", "hidden_size", "vocab_size", "num_heads", ...}
    model.safetensors  fc + layer weights (fp16 by default)

Head graph (``eagle.onnx``), the decoders' time-major contract (export/wrapper.py) plus features:
    input_ids       int64  [B, Q]          x_{t+1}
    hidden          float  [B, Q, H]       f_t
    position_ids    int64  [B, Q]          t (the head's own positions; RoPE)
    attention_mask  float  [B, 1, Q, P+Q]  additive: 0 = attend, MASK_MIN = masked (tree masks work)
    past_key.0      float  [P, B, Hkv, D]
    past_value.0    float  [P, B, Hkv, D]
    ->
    logits          float32 [B, Q, V]      lm_head(f̂_{t+1}): the head's distribution of x_{t+2}
    new_key.0       float  [Q, B, Hkv, D]
    new_value.0     float  [Q, B, Hkv, D]
    next_hidden     float  [B, Q, H]       f̂_{t+1}: fed back as the next step's `hidden`
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .eagle_config import FORMAT, EagleConfig, EagleError
from .eagle_layers import DecoderLayer
from .eagle_upstream import is_upstream_eagle, read_upstream_config, read_upstream_state
from .head_files import read_head_dir, write_head_dir

TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}  # max |ORT - torch| on logits and features at export, per dtype
INPUTS = ["input_ids", "hidden", "position_ids", "attention_mask", "past_key.0", "past_value.0"]
OUTPUTS = ["logits", "new_key.0", "new_value.0", "next_hidden"]


class EagleHead(torch.nn.Module):
    """``forward(input_ids, hidden, position_ids, attention_mask, past_key, past_value)`` -> (logits,
    new_key, new_value, predicted features); see the module docstring for shapes."""

    TRAINED = ("fc.", "layer.")  # prefixes of the parameters the head owns (and saves)

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = torch.nn.Embedding(cfg.vocab_size, h)
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(cfg)
        self.lm_head = torch.nn.Linear(h, cfg.vocab_size, bias=False)
        self.embed.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    def attach_target(self, model) -> "EagleHead":
        """Copy the target's input embedding and LM head (frozen) into the head."""
        with torch.no_grad():
            self.embed.weight.copy_(model.get_input_embeddings().weight)
            self.lm_head.weight.copy_(model.get_output_embeddings().weight)
        return self

    def trained_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if k.startswith(self.TRAINED)}

    def features(self, input_ids, hidden, position_ids, attention_mask, past_key, past_value):
        embedded = self.embed(input_ids).to(hidden.dtype)
        z = self.fc(torch.cat((embedded, hidden) if self.cfg.embed_first else (hidden, embedded), -1))
        return self.layer(z, position_ids, attention_mask, past_key, past_value)

    def forward(self, input_ids, hidden, position_ids, attention_mask, past_key, past_value):
        feat, new_k, new_v = self.features(input_ids, hidden, position_ids, attention_mask, past_key, past_value)
        return self.lm_head(feat).float(), new_k, new_v, feat

    def empty_past(self, batch: int = 1, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(0, batch, self.cfg.num_kv_heads, self.cfg.head_dim, dtype=dtype)


def causal_mask(past_len: int, q: int, dtype=torch.float32) -> torch.Tensor:
    from ..engines.wrapper import chain_mask

    return chain_mask(past_len, q, dtype)


# ---- files ----------------------------------------------------------------------------------------
def save_head(head: EagleHead, out: str | Path, extra: dict | None = None, dtype=torch.float16) -> Path:
    """Write config.json + model.safetensors (the trained weights only, cast to ``dtype``)."""
    return write_head_dir(out, head.trained_state(), head.cfg, FORMAT, dtype, extra)


def read_head_config(head_dir: str | Path) -> tuple[EagleConfig, dict]:
    """specrt's head dir, or an EAGLE-1/2 head as SafeAILab/EAGLE writes it (export/eagle_upstream.py)."""
    if is_upstream_eagle(head_dir):
        return read_upstream_config(head_dir)
    return read_head_dir(head_dir, FORMAT, EagleConfig, EagleError, "an EAGLE head", "head", "specrt train eagle")


def check_head_match(cfg: EagleConfig, hidden_size: int, vocab_size: int, vocab_sha256: str | None = None,
                     where: str = "EAGLE head") -> None:
    if (cfg.hidden_size, cfg.vocab_size) != (hidden_size, vocab_size):
        raise EagleError(f"{where} was trained for another target: hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
                         f"the target's are hidden {hidden_size}, vocab {vocab_size}")
    if vocab_sha256 and cfg.target_vocab_sha256 and cfg.target_vocab_sha256 != vocab_sha256:
        raise EagleError(f"{where} was trained for another target: tokenizer vocabulary sha256 "
                         f"{cfg.target_vocab_sha256[:12]} differs from the target's {vocab_sha256[:12]}")


def load_head(head_dir: str | Path, target_model, dtype=torch.float32) -> tuple[EagleHead, dict]:
    """(head in eval mode with the target's embedding and LM head attached, raw config dict)."""
    from safetensors.torch import load_file

    cfg, raw = read_head_config(head_dir)
    emb = target_model.get_output_embeddings().weight
    check_head_match(cfg, int(emb.shape[1]), int(emb.shape[0]), where=f"EAGLE head {head_dir}")
    head = EagleHead(cfg).attach_target(target_model)
    if is_upstream_eagle(head_dir):
        state = read_upstream_state(head_dir)
    else:
        state = load_file(str(Path(head_dir) / "model.safetensors"))
    want = set(head.trained_state())
    if set(state) != want:
        raise EagleError(f"{head_dir}: weights do not match config.json (missing {sorted(want - set(state))[:3]}, "
                         f"unexpected {sorted(set(state) - want)[:3]})")
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return head.to(dtype).eval(), raw


# ---- ONNX -----------------------------------------------------------------------------------------
class _HeadGraph(torch.nn.Module):
    def __init__(self, head: EagleHead):
        super().__init__()
        self.head = head

    def forward(self, input_ids, hidden, position_ids, attention_mask, past_key, past_value):
        return self.head(input_ids, hidden, position_ids, attention_mask, past_key, past_value)


def parity_cases(cfg: EagleConfig, tdtype, seed: int = 0) -> list[dict]:
    """Feeds checked at export: a 7-token prefill on an empty past, a decode step, and a 6-node tree."""
    from ..contract import MASK_MIN

    g = torch.Generator().manual_seed(seed)
    cases = []
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    for past, q, tree_mask in ((0, 7, None), (7, 1, None), (8, 6, tree)):
        mask = causal_mask(past, q, tdtype)
        if tree_mask is not None:
            mask[0, 0, :, past:] = torch.where(tree_mask, 0.0, MASK_MIN).to(tdtype)
        depth = tree_mask.sum(1) - 1 if tree_mask is not None else torch.arange(q)
        cases.append({
            "input_ids": torch.randint(0, cfg.vocab_size, (1, q), generator=g),
            "hidden": torch.randn(1, q, cfg.hidden_size, generator=g).to(tdtype),
            "position_ids": (past + depth)[None].long(),
            "attention_mask": mask,
            "past_key.0": torch.randn(past, 1, cfg.num_kv_heads, cfg.head_dim, generator=g).to(tdtype),
            "past_value.0": torch.randn(past, 1, cfg.num_kv_heads, cfg.head_dim, generator=g).to(tdtype),
        })
    return cases


def export_head_graph(head: EagleHead, path: Path, dtype: str = "fp32", opset: int = 17) -> dict:
    """Export the head graph, check ORT against torch on ``parity_cases``; return its manifest section."""
    from ..engines.ort import OrtEngine

    cfg = head.cfg
    tdtype = torch.float16 if dtype == "fp16" else torch.float32
    graph = _HeadGraph(head.to(tdtype).eval())
    cases = parity_cases(cfg, tdtype)
    example = cases[2]
    t0 = time.time()
    axes = {"input_ids": {0: "batch", 1: "q"}, "hidden": {0: "batch", 1: "q"}, "position_ids": {0: "batch", 1: "q"},
            "attention_mask": {0: "batch", 2: "q", 3: "total"}, "past_key.0": {0: "past", 1: "batch"},
            "past_value.0": {0: "past", 1: "batch"}, "logits": {0: "batch", 1: "q"},
            "new_key.0": {0: "q", 1: "batch"}, "new_value.0": {0: "q", 1: "batch"}}
    with torch.no_grad():
        torch.onnx.export(graph, tuple(example[n] for n in INPUTS), str(path), input_names=INPUTS,
                          output_names=OUTPUTS, dynamic_axes={**axes, "next_hidden": {0: "batch", 1: "q"}},
                          opset_version=opset, dynamo=False)
    engine = OrtEngine(path)
    diff = 0.0
    for feeds in cases:
        with torch.no_grad():
            ref = [t.float().numpy() for t in graph(*(feeds[n] for n in INPUTS))]
        got = engine.run({n: feeds[n].numpy() for n in INPUTS})
        for name, r in zip(OUTPUTS, ref):
            diff = max(diff, float(np.abs(got[name].astype(np.float32) - r).max()))
    if diff > TOLERANCE[dtype]:
        raise EagleError(f"EAGLE head graph parity check failed: max |ORT - torch| {diff:.2e} > {TOLERANCE[dtype]:.0e}")
    kv = "float16" if dtype == "fp16" else "float32"
    past = ["past", "batch", cfg.num_kv_heads, cfg.head_dim]
    new = ["q", "batch", cfg.num_kv_heads, cfg.head_dim]
    return {"file": path.name, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "dtype": dtype,
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "q"]},
                       {"name": "hidden", "dtype": kv, "shape": ["batch", "q", cfg.hidden_size]},
                       {"name": "position_ids", "dtype": "int64", "shape": ["batch", "q"]},
                       {"name": "attention_mask", "dtype": kv, "shape": ["batch", 1, "q", "total"]},
                       {"name": "past_key.0", "dtype": kv, "shape": past},
                       {"name": "past_value.0", "dtype": kv, "shape": past}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "q", cfg.vocab_size]},
                        {"name": "new_key.0", "dtype": kv, "shape": new},
                        {"name": "new_value.0", "dtype": kv, "shape": new},
                        {"name": "next_hidden", "dtype": kv, "shape": ["batch", "q", cfg.hidden_size]}],
            "parameters": sum(v.numel() for v in head.trained_state().values() if v.is_floating_point()),
            "export_seconds": round(time.time() - t0, 1), "parity_max_abs_diff": diff, "tolerance": TOLERANCE[dtype]}
