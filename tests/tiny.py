"""Tiny models with random weights and a character tokenizer, built inside the test run."""
from __future__ import annotations

from pathlib import Path

CHARS = "abcdefghijklmnopqrstuvwxyz .,:()=\n"


def make_tokenizer(out: Path, vocab_size: int) -> None:
    """A character-level fast tokenizer with ``vocab_size`` ids (id 0 is <eos>)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = (CHARS + "".join(chr(0x100 + i) for i in range(vocab_size)))[: vocab_size - 1]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")
    fast.save_pretrained(out)


def make_model(out: Path, arch: str = "llama", vocab_size: int = 32, hidden: int = 32, layers: int = 2,
               seed: int = 0, max_pos: int = 256, tokenizer: bool = True, scale: float = 1.0,
               eos_token_id: int | None = 0) -> Path:
    """Save a random-weight HF causal LM of family ``arch`` to ``out``; returns ``out``.

    ``scale`` multiplies the output embedding so logits are peaked (scale > 1) or flat (< 1).
    """
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_pos, **common)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cls_cfg, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[arch]
        cfg = cls_cfg(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      tie_word_embeddings=False, **common)
        model = cls(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(out)
    if tokenizer:
        make_tokenizer(out, vocab_size)
    return out


ARCHS = ["llama", "qwen2", "mistral", "gpt2"]  # the architectures every export test covers
FUSED_ARCHS = ["llama", "qwen2", "mistral"]  # ... and those with a fused graph (export/fused_graph.py)

# ---- a tiny target with Medusa heads and with an EAGLE head, trained on text it wrote ----------------
HEADS_V = 16  # vocabulary of the heads' target
HEADS_TARGET = dict(arch="llama", vocab_size=HEADS_V, seed=0, scale=10.0, eos_token_id=None)
MEDUSA_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]  # 12 nodes
EAGLE_TREE = {"nodes": 12, "depth": 4, "topk": 3}


def sample_corpus(target_dir, out, n=64, length=60, seed=0, V=HEADS_V):
    """Text sampled from the target itself (the tiny tokenizer is character-level)."""
    import torch
    from tokenizers import Tokenizer

    from specrt.export.hf_checkpoint import load_hf

    model = load_hf(target_dir)
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    torch.manual_seed(seed)
    with torch.no_grad():
        ids = torch.randint(1, V, (n, 4))
        for _ in range(length):
            nxt = torch.multinomial(torch.softmax(model(ids).logits[:, -1], -1), 1)
            ids = torch.cat([ids, nxt], 1)
    out.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(ids.tolist()):
        (out / f"s{i}.txt").write_text(tok.decode([x for x in row if x > 0]))
    return out
