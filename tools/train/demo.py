"""Train specrt's demo model pair on the Python standard library's own source.

Reproducible on a 2-core CPU: a fixed, recorded corpus (every stdlib ``.py`` file outside
site-packages and test folders, sorted; every 20th file held out), fixed seeds, fixed step
counts. Writes Hugging Face checkpoints (fp16 safetensors) plus a model card per model.

    python tools/train/demo.py all --out tools/demo_models            # tokenizer, target, draft, distill
    python tools/train/demo.py target --out tools/demo_models --steps 1600

The target is a Llama (h256, 8 layers); the draft is ~10x smaller (h128, 2 layers) and
shares the tokenizer. Stages can run as separate processes (the draft does not need the
target), so ``all`` runs them one after another and ``target``/``draft`` can run side by side;
``distill`` then fine-tunes the draft toward the trained target (acceptance is what matters).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
HOLDOUT_EVERY = 20  # every 20th corpus file (sorted order) is held out
EOS = "<|endoftext|>"


@dataclass
class ModelSpec:
    hidden: int  # hidden size
    layers: int  # decoder layers
    heads: int  # attention heads (= kv heads)
    intermediate: int  # MLP width
    tied: bool  # tie input and output embeddings
    steps: int  # optimizer steps
    lr: float  # peak learning rate (cosine decay to 10%)
    batch: int  # sequences per step
    seq: int  # tokens per sequence
    seed: int  # torch + data seed


DISTILL_STEPS = 300  # draft fine-tuning steps against the target's distribution (stage "distill")
DISTILL_BATCH = 8  # sequences per distillation step (each needs a target forward pass too)
DISTILL_LR = 1e-3  # peak learning rate of the distillation stage

SPECS = {
    "target": ModelSpec(256, 8, 4, 688, False, 1600, 1.5e-3, 16, 256, 1234),
    "draft": ModelSpec(128, 2, 2, 344, True, 800, 3e-3, 16, 256, 4321),
}


def corpus_files() -> list[Path]:
    """Sorted stdlib .py files outside site-packages and test folders."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & EXCLUDED_DIRS)]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def split_corpus() -> tuple[list[Path], list[Path]]:
    files = corpus_files()
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    return train, held


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def corpus_record(out: Path) -> dict:
    train, held = split_corpus()
    h = hashlib.sha256()
    for f in train + held:
        h.update(read(f).encode())
    rec = {
        "stdlib": sysconfig.get_paths()["stdlib"],
        "python": f"{os.sys.version_info.major}.{os.sys.version_info.minor}.{os.sys.version_info.micro}",
        "train_files": len(train),
        "heldout_files": len(held),
        "chars": sum(len(read(f)) for f in train + held),
        "sha256": h.hexdigest(),
        "heldout": [str(f.relative_to(sysconfig.get_paths()["stdlib"])) for f in held],
    }
    (out / "corpus.json").write_text(json.dumps(rec, indent=1))
    return rec


def train_tokenizer(out: Path, vocab: int = 4096) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    train, _ = split_corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in train), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    fast.save_pretrained(out / "tokenizer")
    corpus_record(out)


def encode_split(tok_dir: Path) -> tuple[np.ndarray, np.ndarray, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    train, held = split_corpus()

    def enc(files):
        ids = tok([read(f) for f in files], add_special_tokens=False)["input_ids"]
        return np.concatenate([np.array(x + [tok.eos_token_id], dtype=np.int64) for x in ids])

    return enc(train), enc(held), len(tok)


def train_model(kind: str, out: Path, steps: int | None, threads: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = SPECS[kind]
    if steps is not None:
        spec.steps = steps
    torch.set_num_threads(threads)
    torch.manual_seed(spec.seed)
    train_ids, held_ids, vocab = encode_split(out / "tokenizer")
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.heads, max_position_embeddings=2048,
                      tie_word_embeddings=spec.tied, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, betas=(0.9, 0.95))
    rng = np.random.default_rng(spec.seed)
    eval_rng = np.random.default_rng(0)
    eval_starts = eval_rng.integers(0, len(held_ids) - spec.seq - 1, size=64)
    eval_batch = torch.from_numpy(np.stack([held_ids[s:s + spec.seq + 1] for s in eval_starts]))

    def lr_at(step: int) -> float:
        warm = 100
        if step < warm:
            return spec.lr * (step + 1) / warm
        frac = (step - warm) / max(1, spec.steps - warm)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    @torch.no_grad()
    def held_out_loss() -> float:
        model.eval()
        losses = [model(input_ids=b[None, :-1], labels=b[None, :-1]).loss.item() for b in eval_batch]
        model.train()
        return float(np.mean(losses))

    log = []
    t0 = time.time()
    model.train()
    for step in range(spec.steps):
        starts = rng.integers(0, len(train_ids) - spec.seq - 1, size=spec.batch)
        batch = torch.from_numpy(np.stack([train_ids[s:s + spec.seq] for s in starts]))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step < 3 or step == spec.steps - 1:
            ev = held_out_loss() if (step % 400 == 0 or step == spec.steps - 1) else None
            log.append({"step": step, "loss": round(loss.item(), 4), "heldout": ev,
                        "elapsed_s": round(time.time() - t0, 1)})
            print(kind, log[-1], flush=True)
    final = held_out_loss()
    dest = out / kind
    model.half().save_pretrained(dest)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(out / "tokenizer").save_pretrained(dest)
    result = {"kind": kind, "params": n_params, "spec": asdict(spec), "heldout_loss": round(final, 4),
              "train_tokens": spec.steps * spec.batch * spec.seq, "seconds": round(time.time() - t0),
              "torch": torch.__version__, "log": log}
    (dest / "training.json").write_text(json.dumps(result, indent=1))
    write_card(dest, result, json.loads((out / "corpus.json").read_text()))


def distill_draft(out: Path, steps: int | None, threads: int) -> None:
    """Fine-tune the trained draft toward the target: loss = KL(p_target || q_draft) at T=1.

    Acceptance depends on how closely q matches p, not on ground-truth likelihood, so the draft
    is distilled from the frozen target on the same training windows (seeded).
    """
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    spec = SPECS["draft"]
    steps = steps or DISTILL_STEPS
    torch.set_num_threads(threads)
    torch.manual_seed(spec.seed + 1)
    train_ids, held_ids, _ = encode_split(out / "tokenizer")
    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(out / "draft", dtype=torch.float32).train()
    opt = torch.optim.AdamW(draft.parameters(), lr=DISTILL_LR, weight_decay=0.1, betas=(0.9, 0.95))
    rng = np.random.default_rng(spec.seed + 1)
    eval_starts = np.random.default_rng(0).integers(0, len(held_ids) - spec.seq - 1, size=64)
    eval_batch = torch.from_numpy(np.stack([held_ids[s:s + spec.seq + 1] for s in eval_starts]))

    @torch.no_grad()
    def held_out() -> tuple[float, float]:
        draft.eval()
        ce, agree = [], []
        for b in eval_batch:
            d = draft(input_ids=b[None, :-1], labels=b[None, :-1])
            t = target(input_ids=b[None, :-1]).logits
            ce.append(d.loss.item())
            agree.append((d.logits.argmax(-1) == t.argmax(-1)).float().mean().item())
        draft.train()
        return float(np.mean(ce)), float(np.mean(agree))

    log, t0 = [], time.time()
    for step in range(steps):
        starts = rng.integers(0, len(train_ids) - spec.seq - 1, size=DISTILL_BATCH)
        batch = torch.from_numpy(np.stack([train_ids[s:s + spec.seq] for s in starts]))
        lr = DISTILL_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.no_grad():
            p_log = F.log_softmax(target(input_ids=batch).logits, -1)
        q_log = F.log_softmax(draft(input_ids=batch).logits, -1)
        loss = F.kl_div(q_log, p_log, log_target=True, reduction="batchmean") / spec.seq
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log.append({"step": step, "kl": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)})
            print("distill", log[-1], flush=True)
    ce, agree = held_out()
    draft.half().save_pretrained(out / "draft")
    record = json.loads((out / "draft" / "training.json").read_text())
    record["distillation"] = {"steps": steps, "lr": DISTILL_LR, "batch": DISTILL_BATCH, "seq": spec.seq,
                              "seed": spec.seed + 1, "heldout_loss": round(ce, 4),
                              "heldout_greedy_agreement_with_target": round(agree, 4),
                              "seconds": round(time.time() - t0), "log": log}
    (out / "draft" / "training.json").write_text(json.dumps(record, indent=1))
    card = out / "draft" / "README.md"
    card.write_text(card.read_text().replace("Reproduce:", (
        f"- Then distilled from the demo target for {steps} steps (KL(p_target || q_draft), peak lr {DISTILL_LR}):\n"
        f"  held-out cross-entropy **{ce:.4f}**, greedy (argmax) agreement with the target on held-out text "
        f"**{agree:.3f}**.\n\nReproduce:")))


def write_card(dest: Path, r: dict, corpus: dict) -> None:
    s = r["spec"]
    text = f"""# specrt demo {r['kind']} model

LlamaForCausalLM, {r['params'] / 1e6:.2f}M parameters (hidden {s['hidden']}, {s['layers']} layers,
{s['heads']} heads, MLP {s['intermediate']}, tied embeddings: {s['tied']}), byte-level BPE vocabulary
shared with the other demo model. Weights stored in fp16.

- Corpus: the Python {corpus['python']} standard library's `.py` files outside site-packages and test
  folders ({corpus['train_files']} train files, {corpus['heldout_files']} held-out files,
  {corpus['chars']} characters, sha256 {corpus['sha256'][:16]}...). The held-out list is in corpus.json.
- Training: {s['steps']} AdamW steps of {s['batch']}x{s['seq']} tokens ({r['train_tokens']} tokens),
  peak lr {s['lr']} with cosine decay, seed {s['seed']}, torch {r['torch']} on CPU, {r['seconds']} s.
- Held-out cross-entropy (64 windows of {s['seq']} tokens from the held-out files): **{r['heldout_loss']}** nats/token.

Reproduce: `python tools/train/demo.py all --out tools/demo_models`.
A demo model for speculative decoding, not a useful code model.
"""
    (dest / "README.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["tokenizer", "target", "draft", "distill", "all"])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "demo_models")
    ap.add_argument("--steps", type=int, default=None, help="override the stage's step count")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage in ("tokenizer", "all"):
        train_tokenizer(a.out)
    if a.stage in ("target", "all"):
        train_model("target", a.out, a.steps, a.threads)
    if a.stage in ("draft", "all"):
        train_model("draft", a.out, a.steps, a.threads)
    if a.stage in ("distill", "all"):
        distill_draft(a.out, a.steps, a.threads)


if __name__ == "__main__":
    main()
