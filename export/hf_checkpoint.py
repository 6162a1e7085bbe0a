"""The local Hugging Face checkpoint dirs an export reads: the model, its tokenizer files, and the
checks made on them before any graph is exported (architecture, a draft's vocabulary)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from ..engines.manifest import check_vocab
from .errors import ExportError

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")  # copied to an engine dir (transformers 5 saves the chat template apart)


def load_hf(model_dir: str | Path, dtype: str = "fp32"):
    """Load a local HF causal LM (never the hub)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir} is not a Hugging Face model dir (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype], local_files_only=True)
    return model.eval()


def vocab_sha256(tokenizer_json: Path) -> str:
    """Hash of the token -> id map (added tokens included), independent of other tokenizer settings."""
    tok = json.loads(tokenizer_json.read_text())
    vocab = dict(tok["model"]["vocab"])
    vocab.update({a["content"]: a["id"] for a in tok.get("added_tokens", [])})
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()


def copy_tokenizer(model_dir: Path, dest: Path) -> None:
    """The checkpoint's tokenizer files (those it has of ``TOKENIZER_FILES``) into ``dest``."""
    dest.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, dest / name)


def eos_ids(model_dir: Path, model) -> list[int]:
    ids = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update([e] if isinstance(e, int) else (e or []))
    return sorted(ids)


def check_checkpoint_architecture(model_dir: Path) -> None:
    """Refuse an unsupported architecture from the checkpoint's config.json, before loading any weights."""
    from ..engines.wrapper import check_architecture_name

    config = model_dir / "config.json"
    if not config.is_file():
        raise ExportError(f"{model_dir} is not a Hugging Face model dir (no config.json)")
    for arch in json.loads(config.read_text()).get("architectures") or []:
        check_architecture_name(arch)


def check_draft_vocab(target_dir: Path, draft_dir: Path) -> None:
    """A draft must score the same token ids as the target: the same vocabulary size and tokenizer."""
    if not (draft_dir / "tokenizer.json").is_file():
        raise ExportError(f"draft {draft_dir} has no tokenizer.json: cannot check it shares the target's vocabulary")
    sizes = [json.loads((d / "config.json").read_text()).get("vocab_size") if (d / "config.json").is_file() else None
             for d in (target_dir, draft_dir)]
    check_vocab(*sizes, vocab_sha256(target_dir / "tokenizer.json"), vocab_sha256(draft_dir / "tokenizer.json"))
