"""What an EAGLE head dir describes: the EAGLE-1 and EAGLE-3 head configs, their format name, their error.

The lowest of the EAGLE modules: the head modules (eagle_head.py, eagle3_head.py) and the readers of
other projects' head dirs (eagle_upstream.py, eagle3_upstream.py) all build these configs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

FORMAT = "specrt-eagle-head"  # config.json "format" of specrt's head dirs (both versions)


class EagleError(ValueError):
    """A head dir is missing, corrupt, or was trained for a different target."""


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int  # H: the target's hidden size (feature width)
    vocab_size: int  # V: the target's vocabulary
    num_heads: int = 4  # attention heads of the head's decoder layer
    num_kv_heads: int = 4  # key/value heads (GQA when < num_heads)
    intermediate_size: int = 0  # MLP width (0 = 2 * hidden_size; for_target copies the target's)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_architecture: str = ""  # HF class of the target the head was trained on
    target_vocab_sha256: str = ""  # hash of the target tokenizer's vocabulary ("" = unknown)
    input_norm: bool = True  # the decoder layer norms its input (SafeAILab's EAGLE-1/2 layer 0 does not)
    embed_first: bool = False  # fc reads [embed; feature] (SafeAILab's order) instead of [feature; embed]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def for_target(cls, model, **over) -> "EagleConfig":
        """The head shaped like one layer of ``model`` (a HF causal LM)."""
        c = model.config.get_text_config()
        h = int(c.hidden_size)
        heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0) or 4)
        kv = int(getattr(c, "num_key_value_heads", 0) or heads)
        inter = int(getattr(c, "intermediate_size", 0) or getattr(c, "n_inner", 0) or 4 * h)
        eps = float(getattr(c, "rms_norm_eps", 0) or 1e-6)
        base = dict(hidden_size=h, vocab_size=int(model.get_output_embeddings().weight.shape[0]), num_heads=heads,
                    num_kv_heads=kv, intermediate_size=inter, rms_norm_eps=eps,
                    target_architecture=type(model).__name__)
        return cls(**{**base, **over})


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's feature layers for an L-layer target: the hidden states entering layers 2, L//2 and
    L-3 (HF ``hidden_states`` indices; 0 = the embeddings), clamped into 0..L-1 for small targets."""
    return sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # H: the target's hidden size (the head's width; fc reads 3H)
    vocab_size: int  # V: the target's vocabulary
    num_heads: int = 4  # attention heads of the head's layer
    num_kv_heads: int = 4  # key/value heads (GQA when < num_heads)
    intermediate_size: int = 0  # MLP width (0 = 2 * hidden_size; for_target copies the target's)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    draft_vocab_size: int = 0  # Vd: the head's own LM head width (0 = the target's vocabulary)
    aux_layers: list = field(default_factory=list)  # the 3 target layers fused (empty = default_aux_layers(L))
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(g) instead of g (speculators)
    target_architecture: str = ""  # HF class of the target the head was trained on
    target_vocab_sha256: str = ""  # hash of the target tokenizer's vocabulary ("" = unknown)
    version: int = 3  # head format version (EAGLE-1 dirs have none: 1)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def for_target(cls, model, **over) -> "Eagle3Config":
        """The head shaped like one layer of ``model`` (a HF causal LM), fusing its default layers."""
        base = {k: v for k, v in asdict(EagleConfig.for_target(model)).items() if k in cls.__dataclass_fields__}
        layers = default_aux_layers(int(model.config.get_text_config().num_hidden_layers))
        return cls(**{**base, "aux_layers": layers, **over})
