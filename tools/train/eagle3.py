"""Train an EAGLE-3 head (export/eagle3_head.py) for a local HF target, on CPU; the target stays frozen.

Features are the target's hidden states entering three layers (low, middle, high: eagle3_head's
``default_aux_layers``), fused by the head's fc. Training-time test (TTT, the EAGLE-3 paper): on a
window of T tokens the head is unrolled for k steps exactly as it drafts at inference:

    step 0    row t reads (g_t = fc(aux_t), x_{t+1}) at position t, causal over the rows: predicts x_{t+2}
    step j    row t reads (h_t of step j-1, x_{t+1+j}) at position t+j and attends to the step-0 rows
              0..t (the committed rows) and to its own rows of steps 1..j (its ancestors in the draft
              tree): predicts x_{t+2+j}

so deeper steps learn from the head's own predicted features. Loss (no feature regression, as
EAGLE-3): sum_j decay^j · CE(p, q_j) with p the target's next-token distribution at that position
(soft labels) restricted to the draft vocabulary, over the positions whose target argmax is in it.
With ``draft_vocab`` > 0 the draft vocabulary is the most frequent training tokens (SafeAILab's rule).
With ``ttt_positions`` > 0 the steps j >= 1 run on that many random rows of the window only (a row's
chain reads only its own earlier steps and step 0, so this is exact for those rows), which makes
deep unrolling cheap.
Held-out evaluation: top-1/top-5 agreement of step 0 with the target's greedy token (comparable to
EAGLE-1's), top-1 against the text, and top-1 per step (``top1_by_step``).

Checkpoints, ``--resume`` (bit for bit) and the held-out split are tools/train/medusa.py's.

    specrt train eagle --version 3 --target T --data DIR_OR_FILES --out HEAD_DIR [--ttt-steps 5]
    python -m specrt.tools.train.eagle3 --out /tmp/eagle3      # a head for the demo target
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .eagle import demo_parser, write_finished
from .medusa import CHECKPOINT, TrainError, check_out_dir, prepare, training_loop, training_record

__all__ = ["Eagle3TrainConfig", "TrainError", "ttt_forward", "ttt_loss", "evaluate", "train"]


@dataclass(frozen=True)
class Eagle3TrainConfig:
    steps: int = 400  # optimizer steps
    batch: int = 8  # windows per step
    seq: int = 256  # tokens per window
    lr: float = 1e-3  # peak AdamW learning rate (5% warm-up, cosine decay to 10%)
    ttt_steps: int = 5  # k: drafting steps unrolled per window (training-time test)
    ttt_positions: int = 0  # rows per window that steps 1..k-1 train on, drawn at random (0 = all): cheaper deep steps
    step_decay: float = 0.8  # step j's loss weight is step_decay^j (SafeAILab's 0.8)
    draft_vocab: int = 0  # Vd: the head's vocabulary, the most frequent training tokens (0 = the target's)
    aux_layers: tuple = ()  # the 3 target layers fused (HF hidden_states indices); () = EAGLE-3's default
    eval_every: int = 50  # steps between held-out evaluations
    eval_windows: int = 16  # held-out windows per evaluation
    save_every: int = 50  # steps between checkpoints
    seed: int = 0  # data sampling and init seed
    threads: int = 1  # torch intra-op threads (resume needs the same count to be bit-exact)
    dtype: str = "fp16"  # weights of the written head: fp16 | fp32

    def __post_init__(self):
        object.__setattr__(self, "aux_layers", tuple(self.aux_layers))  # a checkpoint's JSON list compares equal


def ttt_mask(blocks: list, dtype):
    """Additive mask [1, 1, n, P + n] of one TTT step over the keys of steps 0..j. blocks: per step i <= j the rows
    (window positions t, int [n_i]) it computed, the last = this step's queries. A query of row t sees step 0's
    rows <= t (the committed rows) and, of every later step, its own row t (its ancestors in the draft tree)."""
    import torch

    from ...contract import MASK_MIN

    t = blocks[-1][:, None]  # [n, 1]
    visible = [blocks[0][None] <= t] + [rows[None] == t for rows in blocks[1:]]  # [n, n_i] each
    return torch.where(torch.cat(visible, 1), 0.0, MASK_MIN).to(dtype)[None, None]


def target_features(model, ids, layers):
    """The frozen target on ids [B, T]: (aux [B, T, 3H] of ``layers``, logits [B, T, V])."""
    import torch

    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1), out.logits


def ttt_forward(head, aux, ids, k: int, subset=None) -> list:
    """The head unrolled k steps over a window: aux [B, T, 3H], ids [B, T] -> per step j (rows, logits): the rows t
    it computed (int [n_j]: 0..T-2-j, or those in ``subset`` for j >= 1) and their draft-vocabulary logits
    [B, n_j, Vd] (row t of step j predicts the token at t+2+j)."""
    rows = ids.shape[1] - 1
    return unroll(head.step, head.fuse(aux[:, :rows]), ids, k, head.empty_past(ids.shape[0], aux.dtype), subset)


def unroll(step, g, ids, k: int, empty, subset=None) -> list:
    """Any EAGLE head drafting k steps over a window as TTT trains it: step(ids, g, positions, mask, past_k,
    past_v) -> (logits, new_k, new_v, h); g [B, T-1, H] the rows' first features, empty [0, B, Hkv, D].
    ``subset`` (int, ascending; None = all rows): the rows steps 1..k-1 compute. A row's chain of steps only
    reads its own earlier steps and step 0, so a subset computes exactly what all rows compute there."""
    import torch

    b, rows = g.shape[0], ids.shape[1] - 1
    past_k = past_v = empty
    blocks, out, h = [], [], g  # per step its rows; per step (rows, logits); the last step's features
    for j in range(min(k, rows)):
        t = torch.arange(rows - j)  # [n] this step's rows
        if j and subset is not None:
            t = subset[subset < rows - j]
        feats = h if j == 0 else h[:, torch.searchsorted(blocks[-1], t)]  # [B, n, H] row t: step j-1's h_t
        blocks.append(t)
        logits, new_k, new_v, h = step(ids[:, t + 1 + j], feats, (t + j)[None].expand(b, -1),
                                       ttt_mask(blocks, g.dtype), past_k, past_v)
        out.append((t, logits))
        past_k, past_v = torch.cat((past_k, new_k)), torch.cat((past_v, new_v))
    return out


def ttt_loss(head, aux, teacher_logits, ids, cfg: Eagle3TrainConfig, subset=None):
    """Returns (loss, per-step CE list). teacher_logits [B, T, V]: the frozen target's; subset: the rows steps >= 1
    train on (None = all)."""
    import torch

    teacher = teacher_logits[:, 1:].float()  # [B, T-1, V] the target's logits after position t+1
    keep_all = head.t2d[teacher.argmax(-1)].float()  # [B, T-1] positions whose target argmax the head can propose
    p_all = torch.softmax(teacher[..., head.draft_ids()], -1)  # [B, T-1, Vd]
    total, per_step = 0.0, []
    for j, (t, logits) in enumerate(ttt_forward(head, aux, ids, cfg.ttt_steps, subset)):
        p, keep = p_all[:, t + j], keep_all[:, t + j]  # step j's row t: the target at position t+1+j
        ce = (-(p * torch.log_softmax(logits, -1)).sum(-1) * keep).sum() / keep.sum().clamp(min=1.0)
        per_step.append(float(ce.detach()))
        total = total + cfg.step_decay ** j * ce
    return total, per_step


def evaluate(model, head, windows, k: int) -> dict:
    """Step 0's top-1/top-5 agreement with the target's greedy token and top-1 against the text; top-1 per step."""
    import torch

    hits1 = hits5 = text = count = 0
    by_step, by_count = np.zeros(k), np.zeros(k)
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w)[None]  # [1, T]
            aux, logits = target_features(model, ids, head.cfg.aux_layers)
            greedy = logits[0, 1:].argmax(-1)  # [T-1] target's token after position t+1
            steps = [head.draft_ids()[s.topk(5, -1).indices] for _, s in ttt_forward(head, aux, ids, k)]
            top = steps[0][0]  # [T-1, 5] target ids of the 5 best draft ids
            hits1 += int((top[:, 0] == greedy).sum())
            hits5 += int((top == greedy[:, None]).any(-1).sum())
            text += int((top[:-1, 0] == ids[0, 2:]).sum())
            count += len(greedy)
            for j, s in enumerate(steps):
                by_step[j] += int((s[0, :, 0] == greedy[j : j + s.shape[1]]).sum())
                by_count[j] += s.shape[1]
    return {"top1": round(hits1 / count, 4), "top5": round(hits5 / count, 4),
            "top1_text": round(text / max(1, count - len(windows)), 4),
            "top1_by_step": (by_step / np.maximum(by_count, 1)).round(4).tolist()}


def deep_rows(rng: np.random.Generator, cfg: Eagle3TrainConfig):
    """The rows (ascending int tensor) steps >= 1 train on this step, drawn by ``rng``; None = every row."""
    import torch

    rows = cfg.seq - 1
    if not 0 < cfg.ttt_positions < rows:
        return None
    return torch.from_numpy(np.sort(rng.choice(rows, cfg.ttt_positions, replace=False)))


def new_head(model, cfg: Eagle3TrainConfig, train_ids, vocab_sha: str):
    """The head to train: the target's default layers, its draft vocabulary, lm_head and norm from the target."""
    from ...export.eagle3_head import Eagle3Head, draft_vocab_from_ids
    from ...export.eagle_config import Eagle3Config

    vocab = int(model.get_output_embeddings().weight.shape[0])
    if not 0 <= cfg.draft_vocab <= vocab:
        raise TrainError(f"draft_vocab {cfg.draft_vocab} outside 0..{vocab} (the target's vocabulary)")
    over = {"aux_layers": list(cfg.aux_layers)} if cfg.aux_layers else {}
    hcfg = Eagle3Config.for_target(model, target_vocab_sha256=vocab_sha,
                                   draft_vocab_size=cfg.draft_vocab if cfg.draft_vocab < vocab else 0, **over)
    layers = int(model.config.get_text_config().num_hidden_layers)
    if len(hcfg.aux_layers) != 3 or not all(0 <= i < layers for i in hcfg.aux_layers):
        raise TrainError(f"aux_layers {list(hcfg.aux_layers)}: needs 3 layer indices in 0..{layers - 1}")
    head = Eagle3Head(hcfg)
    if hcfg.draft_vocab_size:
        head.set_vocab_map(draft_vocab_from_ids(train_ids, vocab, hcfg.draft_vocab_size))
    return head.attach_target(model, init=True)


def train(target_dir, data, out, cfg: Eagle3TrainConfig, heldout=None, resume: bool = False,
          stop_after: int | None = None, log=print, progress: bool = True, force: bool = False) -> dict:
    """Train (or resume) and write ``out``; returns the result record (also in out/training.json)."""
    import torch

    from ...export.eagle3_head import save_head3
    from ...export.hf_checkpoint import vocab_sha256

    if cfg.ttt_steps < 1:
        raise TrainError(f"ttt_steps must be >= 1, got {cfg.ttt_steps}")
    target_dir, out = Path(target_dir), Path(out)
    check_out_dir(out, resume, force)
    setup = prepare(target_dir, data, heldout, cfg, log)
    model = setup.model
    torch.manual_seed(cfg.seed)
    head = new_head(model, cfg, setup.train_ids, vocab_sha256(target_dir / "tokenizer.json"))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    rng = np.random.default_rng(cfg.seed)

    def one_step(ids):
        aux, logits = target_features(model, ids, head.cfg.aux_layers)
        loss, per_step = ttt_loss(head, aux, logits, ids, cfg, deep_rows(rng, cfg))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss, {"per_step": [round(x, 4) for x in per_step]}

    def held_out():
        e = evaluate(model, head, setup.windows, cfg.ttt_steps)
        return e, f"held-out top-1 {e['top1']} (top-5 {e['top5']}; by step {e['top1_by_step']})"

    history, seconds = training_loop("eagle3", cfg, out / CHECKPOINT, head.trained_state,
                                     lambda state: head.load_state_dict(state, strict=False), opt, rng,
                                     setup.train_ids, one_step, held_out, resume, stop_after, log, progress)
    result = training_record(cfg, history, seconds, target_dir, setup.train_docs, setup.held_docs, setup.train_ids,
                             setup.held_ids)
    result["heldout_split"] = setup.split
    if result["finished"]:
        write_finished(out, lambda extra, dtype: save_head3(head, out, extra=extra, dtype=dtype), result, history, cfg,
                       log, "EAGLE-3 head")
    return {**result, "history": history, "head": head}


def main() -> None:
    from .demo import split_corpus

    ap = demo_parser("Train an EAGLE-3 head for the demo target on its corpus split.", Eagle3TrainConfig.steps,
                     Eagle3TrainConfig.lr)
    ap.add_argument("--ttt-steps", type=int, default=Eagle3TrainConfig.ttt_steps)
    ap.add_argument("--draft-vocab", type=int, default=0)
    ap.add_argument("--ttt-positions", type=int, default=0)
    ap.add_argument("--aux-layers", type=int, nargs=3, default=None, help="default: EAGLE-3's (2, L//2, L-3)")
    a = ap.parse_args()
    train_files, held = split_corpus()
    cfg = Eagle3TrainConfig(steps=a.steps, lr=a.lr, ttt_steps=a.ttt_steps, ttt_positions=a.ttt_positions,
                            draft_vocab=a.draft_vocab,
                            aux_layers=tuple(a.aux_layers or ()), eval_windows=32, eval_every=100, threads=a.threads)
    train(a.target, [str(f) for f in train_files], a.out, cfg, heldout=[str(f) for f in held], resume=a.resume)


if __name__ == "__main__":
    main()
