"""What a Medusa heads dir describes: the heads' config, its format name, its error.

The lowest of the Medusa modules: the heads module (medusa_heads.py) and the reader of FasterDecoding's
heads dirs (medusa_upstream.py) both build these configs.
"""
from __future__ import annotations

from dataclasses import dataclass

FORMAT = "specrt-medusa-heads"  # config.json "format" of specrt's heads dirs


class HeadsError(ValueError):
    """A heads dir is missing, corrupt, or was trained for a different target."""


@dataclass(frozen=True)
class HeadsConfig:
    num_heads: int  # K: head k predicts the token k+1 positions after the hidden state's position
    num_layers: int  # residual blocks per head
    hidden_size: int  # H: the target's hidden size
    vocab_size: int  # V: the target's vocabulary size
    target_architecture: str = ""  # HF class of the target the heads were trained on
    target_vocab_sha256: str = ""  # hash of the target tokenizer's vocabulary ("" = unknown)
