"""Train an EAGLE head (export/eagle_head.py) for a local HF target, on CPU; the target stays frozen.

Features f_t are the target's ``hidden`` output (last hidden state after the final norm). On a
window of T tokens the head reads (f_t, x_{t+1}) for t = 0..T-2 with causal attention (teacher
forcing: the true features) and predicts f_{t+1}. The loss is the EAGLE paper's:

    L = smooth_L1(f̂_{t+1}, f_{t+1}) + w_cls * CE(p_{t+1}, softmax(lm_head(f̂_{t+1})))

where p_{t+1} = softmax(lm_head(f_{t+1})) is the target's own next-token distribution (soft
labels: the head learns what the target will accept) and lm_head is the target's, frozen.
Held-out evaluation reports top-1/top-5 agreement of lm_head(f̂_{t+1}) with the target's greedy
token after position t+1 (what greedy verification accepts) and top-1 against the text.

A checkpoint (head, optimizer, step, data RNG, log) is written every ``save_every`` steps;
``resume=True`` continues the same run bit for bit (same config, same thread count).

    specrt train eagle --target T --data DIR_OR_FILES --out HEAD_DIR
    python -m specrt.tools.train.eagle --out /tmp/eagle      # a head for the demo target
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


from .medusa import CHECKPOINT, TrainError, check_out_dir, prepare, training_loop, training_record

__all__ = ["EagleTrainConfig", "TrainError", "eagle_loss", "evaluate", "train"]


@dataclass(frozen=True)
class EagleTrainConfig:
    steps: int = 400  # optimizer steps
    batch: int = 8  # windows per step
    seq: int = 256  # tokens per window
    lr: float = 1e-3  # peak AdamW learning rate (5% warm-up, cosine decay to 10%)
    w_cls: float = 0.1  # weight of the classification (CE) term; EAGLE uses 0.1
    eval_every: int = 50  # steps between held-out evaluations
    eval_windows: int = 16  # held-out windows per evaluation
    save_every: int = 50  # steps between checkpoints
    seed: int = 0  # data sampling and init seed
    threads: int = 1  # torch intra-op threads (resume needs the same count to be bit-exact)
    dtype: str = "fp16"  # weights of the written head: fp16 | fp32
    features: str = ""  # a dir caching the target's outputs (tools/train/features.py): one target pass in all
    cls_positions: int = 0  # with features: rows per window the CE term trains on, drawn at random (0 = all)


def head_forward(head, feats, ids):
    """Teacher-forced head over a window: feats [B, T, H], ids [B, T] -> (logits, predicted features) for
    rows t = 0..T-2 (row t predicts f_{t+1} and the token at t+2)."""
    pred = head_features(head, feats, ids)
    return head.lm_head(pred).float(), pred


def head_features(head, feats, ids):
    """``head_forward``'s predicted features alone: [B, T-1, H] (the LM head not applied)."""
    import torch

    from ...export.eagle_head import causal_mask

    b, t = ids.shape
    pos = torch.arange(t - 1)[None].expand(b, -1)
    past = head.empty_past(b, feats.dtype)
    return head.features(ids[:, 1:], feats[:, :-1], pos, causal_mask(0, t - 1, feats.dtype), past, past)[0]


def eagle_loss(head, feats, teacher_logits, ids, cfg: EagleTrainConfig):
    """feats [B, T, H], teacher_logits [B, T, V] (frozen target), ids [B, T]. Returns (loss, (l_feat, l_cls))."""
    import torch

    logits, pred = head_forward(head, feats, ids)  # [B, T-1, V], [B, T-1, H]
    l_feat = torch.nn.functional.smooth_l1_loss(pred, feats[:, 1:])
    teacher = torch.softmax(teacher_logits[:, 1:].float(), -1)  # [B, T-1, V] target's p after position t+1
    l_cls = -(teacher * torch.log_softmax(logits, -1)).sum(-1).mean()
    return l_feat + cfg.w_cls * l_cls, (float(l_feat.detach()), float(l_cls.detach()))


def cached_eagle_loss(head, batch, cfg: EagleTrainConfig, rng: np.random.Generator | None = None):
    """``eagle_loss`` on a ``features.Batch`` (the target's cached outputs; soft labels over its top K). With
    ``cfg.cls_positions`` the CE term (the LM head: most of a step's cost) sees that many rows per window,
    drawn by ``rng``; the feature term sees all."""
    import torch

    from .features import positions, soft_ce

    pred = head_features(head, batch.hidden, batch.ids)  # [B, T-1, H]
    l_feat = torch.nn.functional.smooth_l1_loss(pred, batch.hidden[:, 1:])
    rows = positions(rng, pred.shape[1], cfg.cls_positions) + 1  # [n'] target positions of the CE rows
    l_cls = soft_ce(head.lm_head(pred[:, rows - 1]), batch.top_ids[:, rows], batch.top_logp[:, rows])
    return l_feat + cfg.w_cls * l_cls, (float(l_feat.detach()), float(l_cls.detach()))


def evaluate_cached(head, batches) -> dict:
    """``evaluate`` on held-out ``features.Batch``es (the target's greedy token is its cached top 1)."""
    import torch

    hits1 = hits5 = text = count = 0
    with torch.no_grad():
        for b in batches:
            logits, _ = head_forward(head, b.hidden, b.ids)  # [1, T-1, V]
            greedy = b.top_ids[0, 1:, 0]  # [T-1]
            top = logits[0].topk(5, -1).indices  # [T-1, 5]
            hits1 += int((top[:, 0] == greedy).sum())
            hits5 += int((top == greedy[:, None]).any(-1).sum())
            text += int((top[:-1, 0] == b.ids[0, 2:]).sum())
            count += len(greedy)
    return {"top1": round(hits1 / count, 4), "top5": round(hits5 / count, 4),
            "top1_text": round(text / max(1, count - len(batches)), 4)}


def evaluate(model, head, windows) -> dict:
    """Top-1/top-5 agreement with the target's greedy token, and top-1 against the text."""
    import torch

    hits1 = hits5 = text = count = 0
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w)[None]  # [1, T]
            out = model(input_ids=ids, output_hidden_states=True)
            logits, _ = head_forward(head, out.hidden_states[-1], ids)  # [1, T-1, V]
            greedy = out.logits[0, 1:].argmax(-1)  # [T-1] target's token after position t+1
            top = logits[0].topk(5, -1).indices  # [T-1, 5]
            hits1 += int((top[:, 0] == greedy).sum())
            hits5 += int((top == greedy[:, None]).any(-1).sum())
            text += int((top[:-1, 0] == ids[0, 2:]).sum())
            count += len(greedy)
    return {"top1": round(hits1 / count, 4), "top5": round(hits5 / count, 4),
            "top1_text": round(text / max(1, count - len(windows)), 4)}


def train(target_dir, data, out, cfg: EagleTrainConfig, heldout=None, resume: bool = False,
          stop_after: int | None = None, log=print, progress: bool = True, force: bool = False) -> dict:
    """Train (or resume) and write ``out``; returns the result record (also in out/training.json)."""
    import torch

    from ...export.eagle_config import EagleConfig
    from ...export.eagle_head import EagleHead, save_head
    from ...export.hf_checkpoint import vocab_sha256

    target_dir, out = Path(target_dir), Path(out)
    check_out_dir(out, resume, force)
    setup = prepare(target_dir, data, heldout, cfg, log)
    model, train_ids, held_ids, windows = setup.model, setup.train_ids, setup.held_ids, setup.windows
    train_files, held, split = setup.train_docs, setup.held_docs, setup.split

    torch.manual_seed(cfg.seed)
    hcfg = EagleConfig.for_target(model, target_vocab_sha256=vocab_sha256(target_dir / "tokenizer.json"))
    head = EagleHead(hcfg).attach_target(model)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    rng = np.random.default_rng(cfg.seed)

    cached = setup.features
    held_batches = cached[1].eval_windows(cfg.eval_windows, cfg.seq) if cached else None

    def one_step(ids):  # ids [B, T], or a features.Batch with the target's cached outputs
        if cached:
            loss, (l_feat, l_cls) = cached_eagle_loss(head, ids, cfg, rng)
        else:
            with torch.no_grad():
                o = model(input_ids=ids, output_hidden_states=True)
            loss, (l_feat, l_cls) = eagle_loss(head, o.hidden_states[-1], o.logits, ids, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss, {"feat": round(l_feat, 4), "cls": round(l_cls, 4)}

    def held_out():
        e = evaluate_cached(head, held_batches) if cached else evaluate(model, head, windows)
        return e, f"held-out top-1 {e['top1']} (top-5 {e['top5']})"

    sample = (lambda r: cached[0].sample(r, cfg.batch, cfg.seq)) if cached else None
    history, seconds = training_loop("eagle", cfg, out / CHECKPOINT, head.trained_state,
                                     lambda state: head.load_state_dict(state, strict=False), opt, rng, train_ids,
                                     one_step, held_out, resume, stop_after, log, progress, sample)
    result = training_record(cfg, history, seconds, target_dir, train_files, held, train_ids, held_ids)
    result["heldout_split"] = split
    if result["finished"]:
        write_finished(out, lambda extra, dtype: save_head(head, out, extra=extra, dtype=dtype), result, history, cfg,
                       log, "EAGLE head")
    return {**result, "history": history, "head": head}


def write_finished(out: Path, save, result: dict, history: list, cfg, log, label: str) -> None:
    """A finished run's files: the head (``save(extra, dtype)``, its config recording accuracy and training)
    and training.json with the per-step history."""
    import torch

    final = result["accuracy"]
    extra = {"accuracy": final, "training": {k: v for k, v in result.items() if k != "accuracy"}}
    save(extra, torch.float16 if cfg.dtype == "fp16" else torch.float32)
    (out / "training.json").write_text(json.dumps({**result, "history": history}, indent=1))
    log(f"{label} written to {out}: held-out top-1 {final['top1']} (top-5 {final['top5']})")


def demo_parser(description: str, steps: int, lr: float) -> argparse.ArgumentParser:
    """The options of a demo-target trainer's ``main``: --target, --out, --steps, --lr, --threads, --resume."""
    ap = argparse.ArgumentParser(description=description)
    here = Path(__file__).resolve().parents[1] / "demo_models"
    ap.add_argument("--target", type=Path, default=here / "target")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    return ap


def main() -> None:
    from .demo import split_corpus

    a = demo_parser("Train an EAGLE head for the demo target on its corpus split.", EagleTrainConfig.steps,
                    EagleTrainConfig.lr).parse_args()
    train_files, held = split_corpus()
    cfg = EagleTrainConfig(steps=a.steps, lr=a.lr, eval_windows=32, eval_every=100, threads=a.threads)
    train(a.target, [str(f) for f in train_files], a.out, cfg, heldout=[str(f) for f in held], resume=a.resume)


if __name__ == "__main__":
    main()
