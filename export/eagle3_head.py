"""The EAGLE-3 head (arXiv 2503.01840): the torch module, its files, and its two ONNX graphs.

EAGLE-3 reads a fusion of low, middle and high target features instead of the top one, and
predicts tokens directly (no feature regression). Row t reads g_t and the token x_{t+1} placed
after it:

    g_t     = fc([a_t ; b_t ; c_t])              3H -> H, no bias: a, b, c = the target's hidden
                                                 states entering layers ``aux_layers`` (the target
                                                 graph's ``aux_hidden`` output)
    h_t     = Layer(norm(embed(x_{t+1})), g_t)   one Llama layer whose attention reads the 2H-wide
                                                 concat(input_layernorm(embed), hidden_norm(g));
                                                 residual g (or hidden_norm(g): norm_before_residual)
    logits  = lm_head(norm(h_t))                 its own final norm and LM head over a draft
                                                 vocabulary of Vd tokens: the distribution of x_{t+2}

While drafting, the head's own output h_t (before ``norm``) is the next row's g (not the fused
target features): ``next_hidden``. Draft id i is target id i + d2t[i] (``d2t`` int64 [Vd] offsets,
``t2d`` bool [V] = which target ids are in the draft vocabulary: SafeAILab's format); the head graph
maps its logits to the target's vocabulary (ids outside the draft vocabulary get MASK_MIN), so the
runtime reads target ids only. ``embed`` is a frozen copy of the target's input embedding (not
saved); ``fc``, the layer, ``norm``, ``lm_head``, ``d2t`` and ``t2d`` are the head's own.

Graphs: ``eagle.onnx`` has eagle_head.py's contract (input_ids, hidden [B, Q, H] = g, position_ids,
attention_mask, past_key.0/past_value.0 -> logits [B, Q, V], new_key.0/new_value.0, next_hidden = h);
``eagle_fc.onnx`` is the fc alone (aux_hidden [B, Q, 3H] -> hidden [B, Q, H]), run on the target's
features before they enter the head. Head dir: config.json (format ``specrt-eagle-head``,
``version: 3``) + model.safetensors; SafeAILab's and speculators' EAGLE-3 dirs: eagle3_upstream.py.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..contract import MASK_MIN
from .eagle3_upstream import read_upstream3_config, read_upstream3_state, upstream_kind
from .eagle_config import FORMAT, Eagle3Config, EagleError, default_aux_layers
from .eagle_head import TOLERANCE, check_head_match, export_head_graph
from .eagle_layers import MLP, Attention, RMSNorm
from .head_files import read_head_dir, write_head_dir

FC_INPUTS, FC_OUTPUTS = ["aux_hidden"], ["hidden"]  # the fc graph's I/O


class Eagle3Layer(torch.nn.Module):
    """EAGLE-3's ``midlayer``: a Llama layer over concat(norm(embedding), norm(feature)) (SafeAILab's names)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, width_in=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embedded, g, position_ids, mask, past_k, past_v):
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        x = torch.cat((self.input_layernorm(embedded), normed), -1)  # [B, Q, 2H]
        a, new_k, new_v = self.self_attn(x, position_ids, mask, past_k, past_v)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), new_k, new_v


class Eagle3Head(torch.nn.Module):
    """``forward(input_ids, hidden, position_ids, attention_mask, past_key, past_value)`` -> (logits [B, Q, V],
    new_key, new_value, h [B, Q, H]); ``fuse(aux [B, Q, 3H])`` -> g [B, Q, H]. See the module docstring."""

    TRAINED = ("fc.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d")  # what the head owns (and saves)

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h, v, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab
        self.embed = torch.nn.Embedding(v, h)
        self.embed.weight.requires_grad_(False)
        self.fc = torch.nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = torch.nn.Linear(h, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # [Vd] target id = draft id + d2t
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool) if vd == v else torch.zeros(v, dtype=torch.bool))
        self.register_buffer("inv", torch.arange(v), persistent=False)  # [V] draft index of each target id (Vd: none)
        self.identity = vd == v

    def set_vocab_map(self, d2t: torch.Tensor) -> "Eagle3Head":
        """Use draft -> target offsets ``d2t`` [Vd]; rebuilds ``t2d`` and the graph's gather index."""
        v, vd = self.cfg.vocab_size, self.cfg.draft_vocab
        ids = torch.arange(vd) + d2t.long()  # [Vd] target ids
        if d2t.shape != (vd,) or int(ids.min()) < 0 or int(ids.max()) >= v or len(set(ids.tolist())) != vd:
            raise EagleError(f"d2t does not map {vd} draft ids onto distinct target ids < {v}")
        with torch.no_grad():
            self.d2t.copy_(d2t.long())
            self.t2d.zero_()
            self.t2d[ids] = True
            self.inv.fill_(vd)
            self.inv[ids] = torch.arange(vd)
        self.identity = bool((ids == torch.arange(vd)).all()) and vd == v
        return self

    def attach_target(self, model, init: bool = False) -> "Eagle3Head":
        """Copy the target's input embedding (frozen); ``init``: also start lm_head (its draft-vocabulary rows)
        and norm from the target's LM head and final norm (training starts there)."""
        with torch.no_grad():
            self.embed.weight.copy_(model.get_input_embeddings().weight)
            if init:
                self.lm_head.weight.copy_(model.get_output_embeddings().weight[self.draft_ids()])
                final = getattr(getattr(model, "model", None), "norm", None)
                if final is not None and getattr(final, "weight", None) is not None:
                    self.norm.weight.copy_(final.weight)
        return self

    def trained_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if k.startswith(self.TRAINED)}

    def fuse(self, aux):
        return self.fc(aux)

    def to_target(self, logits):
        """Draft-vocabulary logits [B, Q, Vd] -> target-vocabulary [B, Q, V] (MASK_MIN outside the draft vocabulary)."""
        if self.identity:
            return logits
        pad = torch.full_like(logits[..., :1], MASK_MIN)
        return torch.cat((logits, pad), -1)[..., self.inv]

    def step(self, input_ids, hidden, position_ids, attention_mask, past_key, past_value):
        """``forward`` with the logits over the draft vocabulary [B, Q, Vd] (training reads these)."""
        embedded = self.embed(input_ids).to(hidden.dtype)
        h, new_k, new_v = self.midlayer(embedded, hidden, position_ids, attention_mask, past_key, past_value)
        return self.lm_head(self.norm(h)).float(), new_k, new_v, h

    def forward(self, input_ids, hidden, position_ids, attention_mask, past_key, past_value):
        logits, new_k, new_v, h = self.step(input_ids, hidden, position_ids, attention_mask, past_key, past_value)
        return self.to_target(logits), new_k, new_v, h

    def draft_ids(self) -> torch.Tensor:
        """int64 [Vd]: the target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab) + self.d2t

    def empty_past(self, batch: int = 1, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(0, batch, self.cfg.num_kv_heads, self.cfg.head_dim, dtype=dtype)


def draft_vocab_from_ids(ids: np.ndarray, vocab_size: int, size: int) -> torch.Tensor:
    """d2t [size] of the ``size`` most frequent target ids in ``ids`` (ties: smaller id), ascending (SafeAILab's rule)."""
    counts = np.bincount(np.asarray(ids).ravel(), minlength=vocab_size)[:vocab_size]  # [V]
    top = np.sort(np.lexsort((np.arange(vocab_size), -counts))[:size])  # [Vd] target ids
    return torch.from_numpy(top - np.arange(size)).long()


# ---- files ----------------------------------------------------------------------------------------
def save_head3(head: Eagle3Head, out: str | Path, extra: dict | None = None, dtype=torch.float16) -> Path:
    """Write config.json + model.safetensors (the head's own weights cast to ``dtype``; d2t/t2d as ints)."""
    return write_head_dir(out, head.trained_state(), head.cfg, FORMAT, dtype, extra)


def is_eagle3(head_dir) -> bool:
    """An EAGLE-3 head dir: specrt's with ``version: 3``, or SafeAILab's / speculators' (eagle3_upstream.py)."""
    path = Path(head_dir) / "config.json"
    if upstream_kind(head_dir) is not None:
        return True
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return False
    return raw.get("format") == FORMAT and raw.get("version", 1) == 3


def read_head3_config(head_dir) -> tuple[Eagle3Config, dict]:
    if upstream_kind(head_dir) is not None:
        return read_upstream3_config(head_dir)
    return read_head_dir(head_dir, FORMAT, Eagle3Config, EagleError, "an EAGLE-3 head", "head",
                         "specrt train eagle --version 3")


def resolve_aux_layers(cfg: Eagle3Config, num_layers: int) -> list[int]:
    """The head's fused layers for an L-layer target (its recorded ones, else EAGLE-3's default); EagleError if invalid."""
    layers = list(cfg.aux_layers) or default_aux_layers(num_layers)
    if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
        raise EagleError(f"EAGLE-3 head fuses layers {layers}: needs 3 layer indices in 0..{num_layers - 1}")
    return layers


def load_head3(head_dir, target_model, dtype=torch.float32) -> tuple[Eagle3Head, dict]:
    """(head in eval mode with the target's embedding attached and its layers resolved, raw config)."""
    from safetensors.torch import load_file

    cfg, raw = read_head3_config(head_dir)
    emb = target_model.get_output_embeddings().weight
    check_head_match(cfg, int(emb.shape[1]), int(emb.shape[0]), where=f"EAGLE-3 head {head_dir}")
    layers = resolve_aux_layers(cfg, int(target_model.config.get_text_config().num_hidden_layers))
    cfg = Eagle3Config(**{**asdict(cfg), "aux_layers": layers})
    head = Eagle3Head(cfg).attach_target(target_model)
    state = read_upstream3_state(head_dir) if upstream_kind(head_dir) else load_file(str(Path(head_dir) / "model.safetensors"))
    if cfg.draft_vocab == cfg.vocab_size:  # a full draft vocabulary: the identity map where none is stored
        state = {"d2t": head.d2t.clone(), "t2d": torch.ones(cfg.vocab_size, dtype=torch.bool), **state}
    want = set(head.trained_state())
    if set(state) != want:
        raise EagleError(f"{head_dir}: weights do not match config.json (missing {sorted(want - set(state))[:3]}, "
                         f"unexpected {sorted(set(state) - want)[:3]})")
    shapes = {k: tuple(v.shape) for k, v in head.trained_state().items()}
    bad = [k for k, v in state.items() if tuple(v.shape) != shapes[k]]
    if bad:
        raise EagleError(f"{head_dir}: {bad[0]} is {tuple(state[bad[0]].shape)}, config.json implies {shapes[bad[0]]}")
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False)
    head.set_vocab_map(state["d2t"])
    return head.to(dtype).eval(), raw


# ---- ONNX -----------------------------------------------------------------------------------------
class _FcGraph(torch.nn.Module):
    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.fc = head.fc

    def forward(self, aux):
        return self.fc(aux)


def export_fc_graph(head: Eagle3Head, path: Path, dtype: str = "fp32", opset: int = 17) -> float:
    """Export the fc graph, check ORT against torch on random features; returns the max abs difference."""
    from ..engines.ort import OrtEngine

    tdtype = torch.float16 if dtype == "fp16" else torch.float32
    graph = _FcGraph(head.to(tdtype).eval())
    g = torch.Generator().manual_seed(1)
    cases = [torch.randn(1, q, 3 * head.cfg.hidden_size, generator=g).to(tdtype) for q in (7, 1)]
    with torch.no_grad():
        torch.onnx.export(graph, (cases[0],), str(path), input_names=FC_INPUTS, output_names=FC_OUTPUTS,
                          dynamic_axes={"aux_hidden": {0: "batch", 1: "q"}, "hidden": {0: "batch", 1: "q"}},
                          opset_version=opset, dynamo=False)
        engine = OrtEngine(path)
        diff = max(float(np.abs(engine.run({"aux_hidden": x.numpy()})["hidden"].astype(np.float32)
                                - graph(x).float().numpy()).max()) for x in cases)
    if diff > TOLERANCE[dtype]:
        raise EagleError(f"EAGLE-3 fc graph parity check failed: max |ORT - torch| {diff:.2e} > {TOLERANCE[dtype]:.0e}")
    return diff


def export_head3_graphs(head: Eagle3Head, out: Path, dtype: str = "fp32", opset: int = 17) -> dict:
    """eagle.onnx (checked as eagle_head.export_head_graph checks EAGLE-1's) + eagle_fc.onnx; the manifest section."""
    t0 = time.time()
    section = export_head_graph(head, out / "eagle.onnx", dtype, opset)
    fc_diff = export_fc_graph(head, out / "eagle_fc.onnx", dtype, opset)
    cfg = head.cfg
    return {**section, "version": 3, "fc_file": "eagle_fc.onnx", "aux_hidden_layers": list(cfg.aux_layers),
            "draft_vocab_size": cfg.draft_vocab, "fc_parity_max_abs_diff": fc_diff,
            "export_seconds": round(time.time() - t0, 1)}
