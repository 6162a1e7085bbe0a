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

Per-layer sliding windows (Mistral's on every layer; Gemma 2/3's, Qwen2's ``max_window_layers`` on some)
are applied INSIDE the graph from ``position_ids`` (``layer_masks``): the contract's mask stays the full
causal / tree / batch mask whatever the model, and a cache row t holds position t.

K/V are time-major so that the runtime's preallocated cache [max_len, B, Hkv, D] yields the
past as a contiguous prefix view (no copy per step, for any batch size). Measured on the demo
target at P=300/1000: head-major past plus the numpy copy it needs cost 1.1x/3x the step time
of time-major, which costs one in-graph transpose.
"""
from __future__ import annotations

import contextlib

import torch

from .. import contract
from ..contract import MASK_MIN, window_hides
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
    "Gemma2ForCausalLM": "Gemma 2 (logit soft-capping; sliding window on alternate layers, applied in the graph)",
    "Gemma3ForCausalLM": "Gemma 3 text (sliding window on 5 of every 6 layers, applied in the graph)",
    "Phi3ForCausalLM": "Phi-3 (fused qkv)",
    "Olmo2ForCausalLM": "OLMo 2",
    "OlmoForCausalLM": "OLMo",
    "GraniteForCausalLM": "Granite",
    "GPTNeoXForCausalLM": "GPT-NeoX / Pythia (partial rotary)",
    "OPTForCausalLM": "OPT (learned positions)",
    "StableLmForCausalLM": "StableLM",
    "Starcoder2ForCausalLM": "StarCoder2",
    "SmolLM3ForCausalLM": "SmolLM3 (no rotary embedding on every 4th layer: no_rope_layers)",
    "PhiForCausalLM": "Phi-1 / Phi-1.5 / Phi-2 (parallel attention and MLP, partial rotary)",
    "FalconForCausalLM": "Falcon (multi-query or grouped K/V, parallel attention; rotary, not ALiBi)",
    "HeliumForCausalLM": "Helium (interleaved rotary)",
    "CohereForCausalLM": "Cohere Command-R (interleaved rotary, LayerNorm, logit scale)",
}



class UnsupportedArchitecture(ValueError):
    pass


def check_architecture(model) -> str:
    """The model's architecture name, or UnsupportedArchitecture naming the supported ones (or, for a
    supported one, the configuration option the graph cannot express)."""
    arch = check_architecture_name(type(model).__name__)
    cfg = model.config.get_text_config()
    if getattr(cfg, "alibi", False):  # Falcon-RW
        raise UnsupportedArchitecture(f"{arch} with alibi=True is not supported: HF builds ALiBi biases from a 2D "
                                      "padding mask, the graph contract passes the 4D attention mask")
    if getattr(cfg, "use_bidirectional_attention", False):  # EmbeddingGemma
        raise UnsupportedArchitecture(f"{arch} with use_bidirectional_attention=True is not a causal LM")
    attention_windows(cfg)  # layer types it cannot express
    return arch


def check_architecture_name(arch: str) -> str:
    """As ``check_architecture``, from the name a checkpoint's config.json lists (no weights loaded)."""
    if arch not in SUPPORTED_ARCHITECTURES:
        names = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedArchitecture(f"architecture {arch!r} is not supported; supported: {names}")
    return arch


def attention_windows(config) -> tuple:
    """Per decoder layer, the sliding window HF's masks give it (None: full attention): ``layer_types``'
    "sliding_attention" layers get ``sliding_window`` (Gemma 2/3, Qwen2/3, SmolLM3: their configs derive
    layer_types from the pattern, ``max_window_layers`` or ``use_sliding_window``); a config without
    layer_types has ``sliding_window`` on every layer (Mistral, Phi-3, StarCoder2) or none.

    Example: Gemma 3 270M (sliding_window 512, 18 layers, every 6th global) ->
    (512, 512, 512, 512, 512, None, 512, 512, 512, 512, 512, None, 512, 512, 512, 512, 512, None).
    """
    cfg = config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (window,) * cfg.num_hidden_layers
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedArchitecture(f"{type(cfg).__name__}: layer types {sorted(unknown)} are not supported "
                                      "(full_attention and sliding_attention are)")
    return tuple(window if t == "sliding_attention" else None for t in types[: cfg.num_hidden_layers])


@contextlib.contextmanager
def traceable_repeat_interleave():
    """While torch.onnx traces: ``repeat_interleave`` by an int along one dim written as stack + flatten (the
    same values). Its TorchScript symbolic infers a wrong rank on dynamic shapes, and the graph of an
    interleaved rotary (Cohere, Helium: ``cos.repeat_interleave(2, dim=-1)``) then fails to build ("All tensors
    must have the same rank"). E.g. [a, b] -> [a, a, b, b] either way. Outside tracing: nothing is patched."""
    if not torch.jit.is_tracing():
        yield
        return
    originals = torch.repeat_interleave, torch.Tensor.repeat_interleave

    def traceable(original):
        def interleave(x, *args, **kwargs):
            repeats = args[0] if args else kwargs.get("repeats")
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if not isinstance(repeats, int) or dim is None:
                return original(x, *args, **kwargs)
            d = dim % x.dim()
            return torch.stack([x] * repeats, d + 1).flatten(d, d + 1)
        return interleave

    torch.repeat_interleave, torch.Tensor.repeat_interleave = map(traceable, originals)
    try:
        yield
    finally:
        torch.repeat_interleave, torch.Tensor.repeat_interleave = originals


class DecoderWrapper(torch.nn.Module):
    """Flat-tensor interface over a HF causal LM (see the module docstring for shapes)."""

    def __init__(self, model, with_hidden: bool = False, aux_layers=None):
        super().__init__()
        check_architecture(model)
        self.model = model.eval()
        self.with_hidden = with_hidden
        self.aux_layers = tuple(aux_layers) if aux_layers else None  # HF hidden_states indices: 0 = embeddings
        cfg = model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.windows = attention_windows(cfg)  # per layer: its sliding window, None = full attention
        self.by_layer_type = getattr(cfg, "layer_types", None) is not None  # HF takes a mask per layer type

    def forward(self, input_ids, position_ids, attention_mask, *past):
        from transformers import DynamicCache

        heads_major = [p.permute(1, 2, 0, 3) for p in past]  # [P,B,H,D] -> [B,H,P,D]
        pairs = [(heads_major[2 * i], heads_major[2 * i + 1]) for i in range(self.num_layers)]
        cache = DynamicCache(pairs)
        past_len = past[0].shape[0]
        with traceable_repeat_interleave():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=self.layer_masks(attention_mask, position_ids, past_len),
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

    def layer_masks(self, attention_mask, position_ids, past_len):
        """What HF gets as ``attention_mask``: the contract's mask [B, 1, Q, P+Q] itself without windows; else
        with the window applied from the positions (past column t holds position t, new column P+i holds
        ``position_ids[:, i]``; ``contract.window_hides``), as one mask where every layer has that window
        (Mistral) or as HF's per-layer-type mapping {"full_attention": mask, "sliding_attention": windowed}.

        Example, window 2, P = 3, one new token at position 3: the mask row [0, 0, 0, 0] becomes [m, m, 0, 0]
        (m = MASK_MIN): keys at positions 2 and 3 stay."""
        window = next((w for w in self.windows if w is not None), None)  # config.sliding_window: one value
        if window is None:
            return attention_mask
        past_pos = torch.arange(past_len, device=position_ids.device).expand(position_ids.shape[0], -1)
        key_pos = torch.cat([past_pos, position_ids], -1)  # [B, P+Q]
        windowed = attention_mask.masked_fill(window_hides(key_pos, position_ids, window)[:, None], MASK_MIN)
        if not self.by_layer_type:
            return windowed
        return {"full_attention": attention_mask, "sliding_attention": windowed}


def geometry(model) -> ModelGeometry:
    """Probe the model once (one token, empty cache) to read exact cache shapes (HF's own: Falcon's
    multi-query K/V have 1 head whatever its config says)."""
    from transformers import DynamicCache

    arch = check_architecture(model)
    cfg = model.config.get_text_config()
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=ids, cache=DynamicCache(), use_cache=True)
    k = out.cache.layers[0].keys  # [1, Hkv, 1, D]
    return ModelGeometry(arch, cfg.num_hidden_layers, int(k.shape[1]), int(k.shape[3]), int(cfg.hidden_size),
                         int(out.logits.shape[-1]))


def chain_mask(past_len: int, q: int, dtype=torch.float32) -> torch.Tensor:
    """``contract.chain_mask`` as a torch tensor of ``dtype``: additive causal mask [1, 1, q, past_len + q].

    Built in float32 and cast (bfloat16 has no numpy dtype): the values 0 and MASK_MIN round the same way."""
    return torch.from_numpy(contract.chain_mask(past_len, q)).to(dtype)
