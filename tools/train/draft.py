"""`specrt train draft`: distil a small draft model from the target, with KL(p_target || q_draft).

Acceptance depends on how closely the draft's distribution q matches the target's p (the reference
text: "tune the draft model, not the draft length"), not on the text's likelihood, so the draft
learns the frozen target's own distributions on the training windows:

    loss = mean over positions of KL(p_target(. | x_<t) || q_draft(. | x_<t))

The draft is a small Llama with the target's vocabulary (and tokenizer, copied into the output dir),
or ``init``: an existing HF checkpoint of the same vocabulary to continue from. Held-out evaluation:
the mean KL and the greedy agreement argmax q == argmax p (what greedy verification accepts).

    specrt train draft --target T --data TEXT... --out DRAFT_DIR [--layers 2 --hidden 128 | --init DIR]
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .medusa import CHECKPOINT, TrainError, check_out_dir, prepare, training_loop


@dataclass(frozen=True)
class DraftTrainConfig:
    layers: int = 2  # decoder layers of a new draft (ignored with init)
    hidden: int = 128  # hidden size of a new draft (ignored with init)
    heads: int = 4  # attention heads of a new draft (head_dim = hidden / heads)
    steps: int = 400  # optimizer steps
    batch: int = 8  # windows per step
    seq: int = 128  # tokens per window
    lr: float = 3e-3  # peak learning rate (warm-up, then cosine to 10%)
    eval_every: int = 50  # steps between held-out evaluations
    eval_windows: int = 16  # held-out windows per evaluation
    save_every: int = 50  # steps between resume checkpoints (also every 2 minutes and on Ctrl-C)
    seed: int = 0
    threads: int = 1  # torch threads (may change on --resume)
    init: str = ""  # an HF checkpoint dir to start from ("" = a new random draft)
    freeze_embeddings: bool = False  # keep the (tied) embedding / LM head as initialised: cheaper steps
    features: str = ""  # a dir caching the target's outputs (tools/train/features.py): one target pass in all
    positions: int = 0  # with features: positions per window the KL trains on, drawn at random (0 = all)


def new_draft(target, cfg: DraftTrainConfig):
    """A small random Llama scoring the target's vocabulary."""
    import transformers as tf

    t = target.config
    config = tf.LlamaConfig(vocab_size=int(target.get_output_embeddings().weight.shape[0]), hidden_size=cfg.hidden,
                            intermediate_size=cfg.hidden * 8 // 3, num_hidden_layers=cfg.layers,
                            num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                            max_position_embeddings=int(getattr(t, "max_position_embeddings", 2048)),
                            bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id,
                            tie_word_embeddings=True)
    return tf.LlamaForCausalLM(config)


def kl_loss(draft, target, ids):
    """Mean KL(p_target || q_draft) per position over windows ``ids`` [B, T]."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        p_log = F.log_softmax(target(input_ids=ids).logits.float(), -1)
    q_log = F.log_softmax(draft(input_ids=ids).logits.float(), -1)
    return F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")


def cached_kl_loss(draft, batch, k: int = 0, rng: np.random.Generator | None = None):
    """(loss, KL) on a ``features.Batch``: cross-entropy to the target's cached distribution renormalised over
    its top K (the gradient of KL(p || q)), and that KL; on ``k`` positions per window drawn by ``rng`` (0 = all:
    the LM head over the vocabulary is most of a small draft's cost)."""
    from .features import positions, soft_ce, topk_entropy

    hidden = draft.get_decoder()(input_ids=batch.ids).last_hidden_state  # [B, T, H]
    rows = positions(rng, hidden.shape[1], k)
    top_ids, top_logp = batch.top_ids[:, rows], batch.top_logp[:, rows]
    loss = soft_ce(draft.get_output_embeddings()(hidden[:, rows]), top_ids, top_logp)
    return loss, float(loss.detach()) - topk_entropy(top_logp)


def evaluate_cached(draft, batches) -> dict:
    """``evaluate`` on held-out ``features.Batch``es: KL over the target's top K, greedy agreement."""
    import torch

    kls, agree, count = [], 0, 0
    draft.eval()
    with torch.no_grad():
        for b in batches:
            kls.append(cached_kl_loss(draft, b)[1])
            agree += int((draft(input_ids=b.ids).logits.argmax(-1) == b.top_ids[..., 0]).sum())
            count += b.ids.shape[1]
    draft.train()
    return {"kl": round(float(np.mean(kls)), 4), "greedy_agreement": round(agree / count, 4)}


def evaluate(draft, target, windows) -> dict:
    """Held-out mean KL and greedy agreement (argmax q == argmax p) over ``windows``."""
    import torch

    kls, agree, count = [], 0, 0
    draft.eval()
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w)[None]
            kls.append(float(kl_loss(draft, target, ids)))
            agree += int((draft(input_ids=ids).logits.argmax(-1) == target(input_ids=ids).logits.argmax(-1)).sum())
            count += ids.shape[1]
    draft.train()
    return {"kl": round(float(np.mean(kls)), 4), "greedy_agreement": round(agree / count, 4)}


def train(target_dir, data, out, cfg: DraftTrainConfig, heldout=None, resume: bool = False,
          stop_after: int | None = None, log=print, progress: bool = True, force: bool = False) -> dict:
    """Distil (or resume) and write the draft to ``out`` (HF dir + tokenizer + training.json); returns the record."""
    import torch
    from transformers import AutoModelForCausalLM

    target_dir, out = Path(target_dir), Path(out)
    check_out_dir(out, resume, force)
    setup = prepare(target_dir, data, heldout, cfg, log)
    target, train_ids, held_ids, windows = setup.model, setup.train_ids, setup.held_ids, setup.windows
    torch.manual_seed(cfg.seed)
    draft = (AutoModelForCausalLM.from_pretrained(cfg.init, dtype=torch.float32) if cfg.init
             else new_draft(target, cfg)).train()
    vocab = int(target.get_output_embeddings().weight.shape[0])
    if draft.get_output_embeddings().weight.shape[0] != vocab:
        raise TrainError(f"--init {cfg.init}: its vocabulary ({draft.get_output_embeddings().weight.shape[0]}) is "
                         f"not the target's ({vocab})")
    if cfg.freeze_embeddings:
        draft.get_input_embeddings().weight.requires_grad_(False)
        draft.get_output_embeddings().weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    rng = np.random.default_rng(cfg.seed)
    cached = setup.features
    held_batches = cached[1].eval_windows(cfg.eval_windows, cfg.seq) if cached else None

    def one_step(ids):  # ids [B, T], or a features.Batch with the target's cached outputs
        if cached:
            loss, kl = cached_kl_loss(draft, ids, cfg.positions, rng)
        else:
            loss = kl_loss(draft, target, ids)
            kl = float(loss.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss, {"kl": round(float(kl), 4)}

    def held_out():
        e = evaluate_cached(draft, held_batches) if cached else evaluate(draft, target, windows)
        return e, f"held-out KL {e['kl']}, greedy agreement {e['greedy_agreement']}"

    sample = (lambda r: cached[0].sample(r, cfg.batch, cfg.seq)) if cached else None
    history, seconds = training_loop("draft", cfg, out / CHECKPOINT, draft.state_dict, draft.load_state_dict, opt,
                                     rng, train_ids, one_step, held_out, resume, stop_after, log, progress, sample)
    final = next((h["eval"] for h in reversed(history) if "eval" in h), None)
    result = {"config": asdict(cfg), "steps_done": len(history), "finished": len(history) >= cfg.steps,
              "seconds": round(seconds, 1), "target": str(target_dir.resolve()), "heldout_split": setup.split,
              "train_documents": len(setup.train_docs), "heldout_documents": len(setup.held_docs),
              "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)), "heldout": final,
              "kl_over": f"the target's top {cached[0].top_ids.shape[1]} tokens" if cached else "the vocabulary",
              "parameters": sum(p.numel() for p in draft.parameters())}
    if result["finished"]:
        draft.eval().save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (target_dir / name).is_file():
                shutil.copy(target_dir / name, out / name)
        (out / "training.json").write_text(json.dumps({**result, "history": history}, indent=1))
        log(f"draft written to {out} ({result['parameters'] / 1e6:.2f}M params): held-out KL {final['kl']}, "
            f"greedy agreement with the target {final['greedy_agreement']}")
    return {**result, "history": history, "draft": draft}
