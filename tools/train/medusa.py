"""Train Medusa heads (Medusa-1: frozen backbone) for a local HF target, on CPU.

Head k at position t reads the target's last hidden state h_t and learns the token at t+1+k.
Two objectives, mixed by ``distill`` (loss = distill * KL(target || head) + (1 - distill) * CE):
    self-distillation  the target's own next-token distribution at position t+k (computed in
                       the same frozen forward pass): the heads learn what the target will
                       accept, not what the text happened to say;
    ground truth       the text's token at t+1+k.
Head k's loss is weighted decay^(k-1) (Medusa's λ_k). Held-out evaluation reports, per head,
top-1/top-5 agreement with the target's greedy token (what greedy verification accepts), top-1
against the text, and the accuracy of each candidate rank (the input of ``greedy_tree``).

A checkpoint (heads, optimizer, step, data RNG, log) is written every ``save_every`` steps;
``resume=True`` continues the same run bit for bit (same config, same thread count).

    specrt train medusa --target T --data DIR_OR_FILES --heads 4 --out HEADS_DIR
    python -m specrt.tools.train.medusa --out tools/demo_models/medusa      # the demo heads
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .data import DataError, training_data

CHECKPOINT = "checkpoint.pt"


class TrainError(ValueError):
    pass


@dataclass
class TrainingSetup:
    """What every trainer starts from: the frozen target and the data (``prepare``)."""

    model: object  # the target, fp32, eval mode, no gradients
    train_ids: np.ndarray  # int64 [T] training token stream
    held_ids: np.ndarray  # int64 [T'] held-out token stream
    train_docs: list  # the documents behind them (tools/train/data.py)
    held_docs: list
    split: str  # how the held-out part was chosen
    windows: list  # fixed held-out evaluation windows of cfg.seq tokens
    features: tuple | None = None  # (train, held-out) FeatureCache: the target's outputs computed once


def check_out_dir(out: Path, resume: bool, force: bool) -> None:
    """A finished result already in ``out`` (its config.json) is replaced only with ``force`` (or continued with
    ``resume``): a user's earlier training is not overwritten by accident."""
    if not (resume or force) and (out / "config.json").is_file():
        raise TrainError(f"{out} already holds a trained result (config.json): pass --force to replace it, or "
                         "--resume to continue its run")


def prepare(target_dir: Path, data, heldout, cfg, log) -> TrainingSetup:
    """Load and freeze the target, read and split the data, fix the evaluation windows; TrainError if unusable."""
    import torch
    from tokenizers import Tokenizer

    from ...export.hf_checkpoint import load_hf

    if not (target_dir / "tokenizer.json").is_file():
        raise TrainError(f"{target_dir} has no tokenizer.json")
    torch.set_num_threads(cfg.threads)
    model = load_hf(target_dir).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    eos = (model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0) or 0
    try:
        train_ids, held_ids, train_docs, held_docs, split = training_data(target_dir, data, heldout, tok, eos,
                                                                          cfg.seq, log)
    except DataError as e:
        raise TrainError(str(e)) from None
    eval_rng = np.random.default_rng(12345)
    windows = [held_ids[s : s + cfg.seq] for s in eval_rng.integers(0, len(held_ids) - cfg.seq, cfg.eval_windows)]
    features = None
    if getattr(cfg, "features", ""):  # the target's outputs once, in cfg.features/{train,heldout}.npz
        from .data import document_ids
        from .features import cached_features

        features = tuple(cached_features(model, document_ids(tok, docs, eos), Path(cfg.features) / f"{name}.npz", log)
                         for name, docs in (("train", train_docs), ("heldout", held_docs)))
    return TrainingSetup(model, train_ids, held_ids, train_docs, held_docs, split, windows, features)


def warmup_cosine_lr(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay from ``peak`` to 10% of it."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))


def sample_windows(rng: np.random.Generator, ids: np.ndarray, batch: int, seq: int):
    """``batch`` random training windows of ``seq`` tokens: int64 tensor [batch, seq]."""
    import torch

    starts = rng.integers(0, len(ids) - seq, batch)
    return torch.from_numpy(np.stack([ids[s : s + seq] for s in starts]))


def load_resume_state(ckpt: Path, cfg, log) -> dict:
    """The checkpoint a ``--resume`` run continues from; its config must equal ``cfg`` (steps aside)."""
    import torch

    if not ckpt.is_file():
        raise TrainError(f"--resume: no checkpoint at {ckpt}")
    state = torch.load(ckpt, weights_only=False)
    saved = type(cfg)(**state["config"])
    changed = [f"{k}={getattr(saved, k)!r} (now {getattr(cfg, k)!r})" for k in asdict(cfg)
               if k not in RESUME_MAY_CHANGE and getattr(saved, k) != getattr(cfg, k)]
    if changed:
        raise TrainError("--resume: the checkpoint was trained with " + ", ".join(changed) +
                         f"; only {' and '.join(sorted(RESUME_MAY_CHANGE))} may change on resume")
    log(f"resuming from step {state['step']} ({ckpt})")
    return state


def training_record(cfg, history: list, seconds: float, target_dir: Path, train_files, held, train_ids,
                    held_ids) -> dict:
    """The summary a head trainer writes to training.json (and returns): config, data, last held-out eval."""
    import torch

    final = next((h["eval"] for h in reversed(history) if "eval" in h), None)
    return {"config": asdict(cfg), "steps_done": len(history), "finished": len(history) >= cfg.steps,
            "seconds": round(seconds, 1), "target": str(target_dir.resolve()), "train_files": len(train_files),
            "heldout_files": len(held), "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
            "torch": torch.__version__, "accuracy": final, "initial_loss": history[0]["loss"] if history else None,
            "final_loss": history[-1]["loss"] if history else None}


RESUME_MAY_CHANGE = {"steps", "threads"}  # options a resumed run may change: they do not change the result


class StepCheckpoints:
    """When a training loop writes its resume checkpoint: every ``save_every`` steps, at the last step, at least
    every ``save_seconds`` of wall time, and at the step boundary right after Ctrl-C, after which the run stops
    with KeyboardInterrupt (``--resume`` then continues it bit for bit). A context manager: inside it, SIGINT
    (on the main thread) only sets ``interrupted``; a second Ctrl-C interrupts at once."""

    def __init__(self, save_every: int, end: int, log, save_seconds: float = 120.0):
        self.save_every, self.end, self.log, self.save_seconds = save_every, end, log, save_seconds
        self.interrupted = False
        self._last = time.monotonic()
        self._old = None

    def __enter__(self) -> "StepCheckpoints":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True

    def due(self, step: int) -> bool:
        return (step % self.save_every == 0 or step == self.end or self.interrupted
                or time.monotonic() - self._last > self.save_seconds)

    def saved(self, step: int, ckpt: Path) -> None:
        self._last = time.monotonic()
        if self.interrupted:
            self.log(f"interrupted: checkpoint of step {step} written to {ckpt}; --resume continues the run")
            raise KeyboardInterrupt


def training_loop(name: str, cfg, ckpt: Path, weights, load, opt, rng, train_ids, one_step, evaluate,
                  resume: bool, stop_after: int | None, log, progress: bool, sample=None) -> tuple[list, float]:
    """The loop every trainer shares: resume from ``ckpt``, then steps with the learning-rate schedule,
    held-out evaluations and resume checkpoints (``StepCheckpoints``). Returns (history, training seconds).

    weights() -> the state to checkpoint; load(state) restores it; one_step(ids [B, T]) -> (loss tensor,
    extra record fields), backward and optimizer step included; evaluate() -> (eval dict, a log line).
    sample(rng) -> what one_step takes instead of ids (default: windows of ``train_ids``), e.g. a
    ``features.Batch`` of cached target outputs.
    """
    from tqdm import tqdm

    step, history, seconds = 0, [], 0.0  # steps done, per-step records, training seconds so far
    if resume:
        state = load_resume_state(ckpt, cfg, log)
        load(state["weights"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["rng"]
        step, history, seconds = state["step"], state["history"], state["seconds"]
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = tqdm(initial=step, total=cfg.steps, desc=name, disable=not progress)
    t0 = time.time()
    with StepCheckpoints(cfg.save_every, end, log) as checkpoints:
        while step < end:
            ids = sample(rng) if sample else sample_windows(rng, train_ids, cfg.batch, cfg.seq)  # [B, T]
            for g in opt.param_groups:
                g["lr"] = warmup_cosine_lr(step, cfg.steps, cfg.lr)
            loss, extra = one_step(ids)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            record = {"step": step, "loss": round(loss.item(), 4), **extra}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                record["seconds"] = round(seconds + time.time() - t0, 1)  # training time so far (wall-time comparisons)
                record["eval"], line = evaluate()
                bar.write(f"step {step}: loss {loss.item():.3f}; {line}")
            history.append(record)
            if checkpoints.due(step):
                seconds += time.time() - t0
                t0 = time.time()
                save_resume_state(ckpt, cfg, weights(), opt, step, rng, history, seconds)
                checkpoints.saved(step, ckpt)
    bar.close()
    return history, seconds


def save_resume_state(ckpt: Path, cfg, weights: dict, opt, step: int, rng, history: list, seconds: float) -> None:
    import torch

    ckpt.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": asdict(cfg), "weights": weights, "opt": opt.state_dict(), "step": step,
                "rng": rng.bit_generator.state, "history": history, "seconds": seconds}, ckpt)


@dataclass(frozen=True)
class TrainConfig:
    heads: int = 4  # K heads
    layers: int = 1  # residual blocks per head
    steps: int = 400  # optimizer steps
    batch: int = 8  # windows per step
    seq: int = 256  # tokens per window
    positions: int = 0  # positions per window the heads train on, drawn at random (0 = all); the target sees all
    lr: float = 1e-3  # peak AdamW learning rate (5% warm-up, cosine decay to 10%)
    distill: float = 1.0  # weight of self-distillation; 1 - distill goes to ground-truth CE
    decay: float = 0.8  # head k's loss weight is decay^(k-1)
    eval_every: int = 50  # steps between held-out evaluations
    eval_windows: int = 16  # held-out windows per evaluation
    save_every: int = 50  # steps between checkpoints
    seed: int = 0  # data sampling and init seed
    threads: int = 1  # torch intra-op threads (resume needs the same count to be bit-exact)
    dtype: str = "fp16"  # weights of the written heads: fp16 | fp32


def heads_loss(heads, hidden, teacher_logits, ids, cfg: TrainConfig, rng: np.random.Generator):
    """hidden [B, T, H], teacher_logits [B, T, V] (frozen target), ids [B, T]. Returns (loss, per-head losses).

    Trains on positions t < T-1-K (every head has its label t+1+k inside the window), or on
    ``cfg.positions`` of them drawn by ``rng`` (the same for the whole batch).
    """
    import torch

    n = ids.shape[1] - 1 - cfg.heads
    if 0 < cfg.positions < n:
        t = torch.from_numpy(np.sort(rng.choice(n, cfg.positions, replace=False)))  # [n'] positions
    else:
        t = torch.arange(n)
    logits = heads(hidden[:, t])  # [B, n', K, V]
    total, per_head = 0.0, []
    for k in range(1, cfg.heads + 1):
        logp = torch.log_softmax(logits[:, :, k - 1].float(), -1)  # [B, n', V] head k at t: token t+1+k
        loss = 0.0
        if cfg.distill > 0:
            teacher_logp = torch.log_softmax(teacher_logits[:, t + k].float(), -1)  # [B, n', V] target at t+k
            kl = (teacher_logp.exp() * (teacher_logp - logp)).sum(-1).mean()  # KL(target || head)
            loss = loss + cfg.distill * kl
        if cfg.distill < 1:
            gt = ids[:, t + 1 + k]  # [B, n'] the text's tokens
            loss = loss + (1 - cfg.distill) * -logp.gather(-1, gt[..., None]).mean()
        per_head.append(float(loss.detach()))
        total = total + cfg.decay ** (k - 1) * loss
    return total, per_head


def evaluate(model, heads, windows, cfg: TrainConfig, ranks: int = 10) -> dict:
    """Per head: top-1/top-5 agreement with the target's greedy token, top-1 vs the text, per-rank accuracy."""
    import torch

    hits = np.zeros((cfg.heads, ranks))  # [K, R] rank-r candidate == target's greedy token
    text_hits, counts = np.zeros(cfg.heads), np.zeros(cfg.heads)
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w)[None]  # [1, T]
            out = model(input_ids=ids, output_hidden_states=True)
            greedy = out.logits[0].argmax(-1)  # [T] target's next token after each position
            logits = heads(out.hidden_states[-1])[0]  # [T, K, V]
            for k in range(1, cfg.heads + 1):
                n = ids.shape[1] - 1 - k
                top = logits[:n, k - 1].topk(ranks, -1).indices  # [n, R]
                hits[k - 1] += (top == greedy[k : k + n, None]).sum(0).numpy()
                text_hits[k - 1] += (top[:, 0] == ids[0, k + 1 : k + 1 + n]).sum().item()
                counts[k - 1] += n
    by_rank = hits / counts[:, None]
    return {"top1": by_rank[:, 0].round(4).tolist(), "top5": by_rank[:, :5].sum(1).round(4).tolist(),
            "top1_text": (text_hits / counts).round(4).tolist(), "by_rank": by_rank.round(4).tolist()}


def train(target_dir, data, out, cfg: TrainConfig, heldout=None, resume: bool = False, stop_after: int | None = None,
          log=print, progress: bool = True, force: bool = False) -> dict:
    """Train (or resume) and write ``out``; returns the result record (also in out/training.json).

    ``stop_after``: stop after this step (a checkpoint is written there), e.g. to split a run.
    """
    import torch

    from ...export.hf_checkpoint import vocab_sha256
    from ...export.medusa_config import HeadsConfig
    from ...export.medusa_heads import MedusaHeads, save_heads

    target_dir, out = Path(target_dir), Path(out)
    check_out_dir(out, resume, force)
    setup = prepare(target_dir, data, heldout, cfg, log)
    model, train_ids, held_ids, windows = setup.model, setup.train_ids, setup.held_ids, setup.windows
    train_files, held, split = setup.train_docs, setup.held_docs, setup.split
    text_cfg = model.config.get_text_config()

    torch.manual_seed(cfg.seed)
    hcfg = HeadsConfig(cfg.heads, cfg.layers, int(text_cfg.hidden_size), int(model.get_output_embeddings().weight.shape[0]),
                       type(model).__name__, vocab_sha256(target_dir / "tokenizer.json"))
    heads = MedusaHeads(hcfg)
    heads.init_from_lm_head(model.get_output_embeddings().weight)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = np.random.default_rng(cfg.seed)

    def one_step(ids):
        with torch.no_grad():
            o = model(input_ids=ids, output_hidden_states=True)
        loss, per_head = heads_loss(heads, o.hidden_states[-1], o.logits, ids, cfg, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss, {"per_head": [round(x, 4) for x in per_head]}

    def held_out():
        e = evaluate(model, heads, windows, cfg)
        return e, f"held-out top-1 per head {e['top1']} (top-5 {e['top5']})"

    history, seconds = training_loop("medusa", cfg, out / CHECKPOINT, heads.state_dict, heads.load_state_dict, opt,
                                     rng, train_ids, one_step, held_out, resume, stop_after, log, progress)
    result = training_record(cfg, history, seconds, target_dir, train_files, held, train_ids, held_ids)
    result["heldout_split"] = split
    done, final = result["finished"], result["accuracy"]
    if done:
        extra = {"accuracy": final, "training": {k: v for k, v in result.items() if k != "accuracy"}}
        save_heads(heads, out, extra=extra, dtype=torch.float16 if cfg.dtype == "fp16" else torch.float32)
        (out / "training.json").write_text(json.dumps({**result, "history": history}, indent=1))
        log(f"heads written to {out}: held-out top-1 per head {final['top1']}")
    return {**result, "history": history, "heads": heads}


def demo_files() -> tuple[list[Path], list[Path]]:
    """The demo target's own corpus split (tools/train/demo.py): train files, held-out files."""
    from .demo import split_corpus

    return split_corpus()


def write_card(out: Path, r: dict) -> None:
    """tools/demo_models/medusa/README.md: what the heads are, how they were trained, per-head accuracy."""
    c, acc = r["config"], r["accuracy"]
    params = sum(v.numel() for v in r["heads"].state_dict().values())
    rows = "\n".join(f"| {k + 1} | t+{k + 2} | {acc['top1'][k]:.3f} | {acc['top5'][k]:.3f} | {acc['top1_text'][k]:.3f} |"
                     for k in range(c["heads"]))
    text = f"""# specrt demo Medusa heads

{c['heads']} Medusa-1 heads for the demo target (`../target`): each is one residual block
(`h + SiLU(A h + b)`, A zero-initialised) and a {r['heads'].cfg.hidden_size}x{r['heads'].cfg.vocab_size} output
layer initialised from the target's LM head; the target stays frozen. {params / 1e6:.2f}M parameters,
stored in {c['dtype']} (`model.safetensors`), sizes and accuracy in `config.json`, full log in `training.json`.

- Data: the demo target's own corpus split (tools/train/demo.py `split_corpus()`: the Python
  standard library, {r['train_files']} train files / {r['heldout_files']} held-out files;
  {r['train_tokens']} / {r['heldout_tokens']} tokens).
- Objective: self-distillation (KL from the target's next-token distribution at t+k to head k
  at t), weight 0.8^(k-1) per head; {c['steps']} AdamW steps of {c['batch']} windows x {c['seq']} tokens,
  the heads trained on {c['positions'] or c['seq']} random positions per window; peak lr {c['lr']}; seed {c['seed']};
  torch {r['torch']}, {c['threads']} CPU thread(s), {r['seconds']:.0f} s.

Held-out accuracy ({c['eval_windows']} windows of {c['seq']} tokens from the held-out files). "agreement" =
the head's candidate is the token the greedy target produces at that position (what greedy tree
verification accepts); "text" = the held-out text's own token.

| head | predicts | top-1 agreement | top-5 agreement | top-1 text |
|---|---|---|---|---|
{rows}

Per-rank agreement (rank 0..9 per head) is `config.json`'s `accuracy.by_rank`; the default trees in
trees.py are built from it.

Reproduce: `python -m specrt.tools.train.medusa --steps {c['steps']} --heads {c['heads']} --positions {c['positions']}`.
Demo heads for speculative decoding, not a useful model.
"""
    (out / "README.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description="Train the demo Medusa heads on the demo target's corpus split.")
    here = Path(__file__).resolve().parents[1] / "demo_models"
    ap.add_argument("--target", type=Path, default=here / "target")
    ap.add_argument("--out", type=Path, default=here / "medusa")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--heads", type=int, default=TrainConfig.heads)
    ap.add_argument("--positions", type=int, default=64, help="positions per window the heads train on")
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    train_files, held = demo_files()
    cfg = TrainConfig(heads=a.heads, steps=a.steps, positions=a.positions, eval_windows=32, eval_every=100)
    r = train(a.target, [str(f) for f in train_files], a.out, cfg, heldout=[str(f) for f in held], resume=a.resume)
    if r["finished"]:
        write_card(a.out, r)
        (a.out / CHECKPOINT).unlink()  # 50 MB of optimizer state: not part of the committed heads


if __name__ == "__main__":
    main()
