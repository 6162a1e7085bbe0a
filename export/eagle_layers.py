"""The Llama pieces EAGLE heads are built of (HF parameter names): RMSNorm, attention over a time-major
past, the gated MLP, and the decoder layer of the EAGLE-1 head (eagle_head.py; EAGLE-3's own layer,
eagle3_head.py, reuses the first three)."""
from __future__ import annotations

import math

import torch

from .eagle_config import EagleConfig


class RMSNorm(torch.nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(torch.nn.Module):
    """Llama self-attention (parameter names as HF's LlamaAttention) over a time-major past."""

    def __init__(self, cfg: EagleConfig, width_in: int = 0):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        w = width_in or h  # q/k/v input width (EAGLE-3's layer reads [embedding ; feature]: 2H)
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = torch.nn.Linear(w, self.nh * d, bias=False)
        self.k_proj = torch.nn.Linear(w, self.nkv * d, bias=False)
        self.v_proj = torch.nn.Linear(w, self.nkv * d, bias=False)
        self.o_proj = torch.nn.Linear(self.nh * d, h, bias=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [D/2]
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, position_ids, mask, past_k, past_v):
        b, q, _ = x.shape
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, Q, D/2]
        emb = torch.cat((freqs, freqs), -1)[:, :, None]  # [B, Q, 1, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        qs = self.q_proj(x).view(b, q, self.nh, self.d)
        ks = self.k_proj(x).view(b, q, self.nkv, self.d)
        vs = self.v_proj(x).view(b, q, self.nkv, self.d)
        qs = qs * cos + _rotate_half(qs) * sin
        ks = ks * cos + _rotate_half(ks) * sin
        new_k, new_v = ks.permute(1, 0, 2, 3), vs.permute(1, 0, 2, 3)  # [Q, B, Hkv, D]
        keys = torch.cat((past_k, new_k), 0).permute(1, 2, 0, 3)  # [B, Hkv, P+Q, D]
        vals = torch.cat((past_v, new_v), 0).permute(1, 2, 0, 3)
        if self.nh != self.nkv:
            keys = keys.repeat_interleave(self.nh // self.nkv, dim=1)  # [B, Hq, P+Q, D]
            vals = vals.repeat_interleave(self.nh // self.nkv, dim=1)
        scores = qs.transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(self.d) + mask  # [B, Hq, Q, P+Q]
        att = torch.softmax(scores.float(), -1).to(x.dtype) @ vals  # [B, Hq, Q, D]
        return self.o_proj(att.transpose(1, 2).reshape(b, q, self.nh * self.d)), new_k, new_v


class MLP(torch.nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size or 2 * cfg.hidden_size
        self.gate_proj = torch.nn.Linear(h, i, bias=False)
        self.up_proj = torch.nn.Linear(h, i, bias=False)
        self.down_proj = torch.nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    """One Llama decoder layer (pre-norm attention + gated MLP, HF parameter names)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.input_norm else None
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, position_ids, mask, past_k, past_v):
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        a, new_k, new_v = self.self_attn(normed, position_ids, mask, past_k, past_v)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), new_k, new_v
