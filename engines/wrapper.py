"""The function every specrt target/draft graph computes, as a torch module.

One wrapper serves all supported architectures: Hugging Face decoder-only models in
transformers 5.x accept a 4D additive mask unchanged and a ``DynamicCache`` built from flat
past tensors, so only the architecture *list* is per-family, not the code.

Graph contract (names are the manifest's; B batch, Q new tokens, P past tokens):

    input_ids       int64  [B, Q]
    position_ids    int64  [B, Q]
    attention_mask  float  [B, 1, Q, P+Q]   additive: 0 = attend, large negative = masked
    past_key.{i}    float  [P, B, Hkv, D]   for every layer i (time-major: see below)
    past_value.{i}  float  [P, B, Hkv, D]
    ->
    logits          float32 [B, Q, V]
    new_key.{i}     float  [Q, B, Hkv, D]   only the Q new positions: the runtime owns the cache
    new_value.{i}   float  [Q, B, Hkv, D]
    hidden          float  [B, Q, H]        (optional) last hidden state, after the final norm
    aux_hidden      float  [B, Q, k*H]      (optional) hidden states entering layers ``aux_layers`` (EAGLE-3)

K/V are time-major so that the runtime's preallocated cache [max_len, B, Hkv, D] yields the
past as a contiguous prefix view (no copy per step, for any batch size). Measured on the demo
target at P=300/1000: head-major past plus the numpy copy it needs cost 1.1x/3x the step time
of time-major, which costs one in-graph transpose.
"""
from __future__ import annotations

import torch

from .. import contract
from ..contract import MASK_MIN  # noqa: F401  (export/ imports it from here)
from .manifest import ModelGeometry

# HF architecture name -> family note. Every entry is checked by tests/export/test_export.py (the first four)
# or tests/export/test_families.py: ORT vs torch parity at export, greedy equal to HF generate, tree logits.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "Llama, and Llama-style checkpoints (Llama 2/3, TinyLlama, ...)",
    "MistralForCausalLM": "Mistral",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5",
    "GPT2LMHeadModel": "GPT-2",
    "Qwen3ForCausalLM": "Qwen3 (q/k norms)",
    "GemmaForCausalLM": "Gemma",
    "Gemma2ForCausalLM": "Gemma 2 (logit soft-capping; sliding window on alternate layers: max_len <= window)",
    "Gemma3ForCausalLM": "Gemma 3 text (sliding window on most layers: max_len <= window)",
    "Phi3ForCausalLM": "Phi-3 (fused qkv)",
    "Olmo2ForCausalLM": "OLMo 2",
    "OlmoForCausalLM": "OLMo",
    "GraniteForCausalLM": "Granite",
    "GPTNeoXForCausalLM": "GPT-NeoX / Pythia (partial rotary)",
    "OPTForCausalLM": "OPT (learned positions)",
    "StableLmForCausalLM": "StableLM",
    "Starcoder2ForCausalLM": "StarCoder2",
}



class UnsupportedArchitecture(ValueError):
    pass


def check_architecture(model) -> str:
    """The model's architecture name, or UnsupportedArchitecture naming the supported ones."""
    return check_architecture_name(type(model).__name__)


def check_architecture_name(arch: str) -> str:
    """As ``check_architecture``, from the name a checkpoint's config.json lists (no weights loaded)."""
    if arch not in SUPPORTED_ARCHITECTURES:
        names = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedArchitecture(f"architecture {arch!r} is not supported; supported: {names}")
    return arch


class DecoderWrapper(torch.nn.Module):
    """Flat-tensor interface over a HF causal LM (see the module docstring for shapes)."""

    def __init__(self, model, with_hidden: bool = False, aux_layers=None):
        super().__init__()
        check_architecture(model)
        self.model = model.eval()
        self.with_hidden = with_hidden
        self.aux_layers = tuple(aux_layers) if aux_layers else None  # HF hidden_states indices: 0 = embeddings
        self.num_layers = model.config.get_text_config().num_hidden_layers

    def forward(self, input_ids, position_ids, attention_mask, *past):
        from transformers import DynamicCache

        heads_major = [p.permute(1, 2, 0, 3) for p in past]  # [P,B,H,D] -> [B,H,P,D]
        pairs = [(heads_major[2 * i], heads_major[2 * i + 1]) for i in range(self.num_layers)]
        cache = DynamicCache(pairs)
        past_len = past[0].shape[0]
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=self.with_hidden or self.aux_layers is not None,
        )
        new = []
        for layer in out.cache.layers:
            new.append(layer.keys[:, :, past_len:].permute(2, 0, 1, 3))  # [Q,B,H,D]
            new.append(layer.values[:, :, past_len:].permute(2, 0, 1, 3))
        result = [out.logits.float(), *new]
        if self.with_hidden:
            result.append(out.hidden_states[-1])
        if self.aux_layers is not None:
            result.append(torch.cat([out.hidden_states[i] for i in self.aux_layers], -1))
        return tuple(result)


def geometry(model) -> ModelGeometry:
    """Probe the model once (one token, empty past) to read exact cache shapes."""
    arch = check_architecture(model)
    wrapper = DecoderWrapper(model)
    cfg = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    ids = torch.zeros(1, 1, dtype=torch.long)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    empty = torch.zeros(0, 1, kv_heads, head_dim, dtype=dtype)
    with torch.no_grad():
        outs = wrapper(ids, ids, torch.zeros(1, 1, 1, 1, dtype=dtype), *([empty] * (2 * wrapper.num_layers)))
    k = outs[1]
    return ModelGeometry(arch, wrapper.num_layers, int(k.shape[2]), int(k.shape[3]), int(cfg.hidden_size),
                         int(outs[0].shape[-1]))


def chain_mask(past_len: int, q: int, dtype=torch.float32) -> torch.Tensor:
    """``contract.chain_mask`` as a torch tensor of ``dtype``: additive causal mask [1, 1, q, past_len + q].

    Built in float32 and cast (bfloat16 has no numpy dtype): the values 0 and MASK_MIN round the same way."""
    return torch.from_numpy(contract.chain_mask(past_len, q)).to(dtype)
