"""The frozen target's outputs on a token stream, computed ONCE and reused by every training step.

A trainer whose target is frozen recomputes the same target forward pass for every window it
draws; on a real target (SmolLM2-135M: 30 layers, a 49,152-token vocabulary) that pass costs more
than the proposer's own step. ``build_cache`` runs the target once per document (each document in
its own context, from its first token) and keeps, per position t of the stream:

    hidden    the target's last hidden state (after the final norm: what EAGLE-1 reads), fp16 [N, H]
    top_ids   the target's K most likely next tokens after position t, int32 [N, K] (top_ids[:, 0]:
              its greedy token)
    top_logp  their log-probabilities under the full softmax, fp16 [N, K]

Soft targets are then the target's distribution renormalised over its top K (``soft_ce``); with
K = 32 that keeps > 0.95 of the probability mass on self-generated text.

    >>> cache = build_cache(model, [ids_a, ids_b], k=32)             # doctest: +SKIP
    >>> batch = cache.sample(np.random.default_rng(0), 8, 256)      # doctest: +SKIP
    >>> batch.ids.shape, batch.hidden.shape, batch.top_ids.shape    # doctest: +SKIP
    (torch.Size([8, 256]), torch.Size([8, 256, 576]), torch.Size([8, 256, 32]))
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOP_K = 32  # target tokens kept per position
EVAL_SEED = 12345  # the held-out windows' starts (as ``tools/train/medusa.py``'s ``prepare``)


@dataclass
class Batch:
    """Training windows with the target's outputs at every position (torch tensors)."""

    ids: object  # int64 [B, T]
    hidden: object  # float32 [B, T, H]
    top_ids: object  # int64 [B, T, K]
    top_logp: object  # float32 [B, T, K]


@dataclass
class FeatureCache:
    ids: np.ndarray  # int64 [N]: every document's tokens followed by EOS
    hidden: np.ndarray  # float16 [N, H]
    top_ids: np.ndarray  # int32 [N, K]
    top_logp: np.ndarray  # float16 [N, K]

    def windows(self, starts, seq: int) -> Batch:
        """The windows [s, s + seq) for s in ``starts``."""
        import torch

        take = lambda a, dtype: torch.from_numpy(np.stack([a[s : s + seq] for s in starts]).astype(dtype))
        return Batch(take(self.ids, np.int64), take(self.hidden, np.float32), take(self.top_ids, np.int64),
                     take(self.top_logp, np.float32))

    def sample(self, rng: np.random.Generator, batch: int, seq: int) -> Batch:
        """``batch`` random windows (drawn as ``medusa.sample_windows`` draws them)."""
        return self.windows(rng.integers(0, len(self.ids) - seq, batch), seq)

    def eval_windows(self, n: int, seq: int) -> list[Batch]:
        """``n`` fixed single-window batches for held-out evaluation."""
        starts = np.random.default_rng(EVAL_SEED).integers(0, len(self.ids) - seq, n)
        return [self.windows([s], seq) for s in starts]

    def save(self, path: Path) -> None:
        np.savez(path, ids=self.ids, hidden=self.hidden, top_ids=self.top_ids, top_logp=self.top_logp)

    @classmethod
    def load(cls, path: Path) -> "FeatureCache":
        with np.load(path) as z:
            return cls(z["ids"], z["hidden"], z["top_ids"], z["top_logp"])


def build_cache(model, docs: list[np.ndarray], k: int = TOP_K, max_len: int = 1024, log=print,
                partial: Path | None = None) -> FeatureCache:
    """Run the frozen ``model`` (HF causal LM) once per document (int64 [n_i] each; longer than ``max_len``: in
    pieces, each from a fresh context) and keep its outputs (module docstring). ``partial``: a file where the
    pieces done so far are saved every 16 pieces, and read back by a later call on the same documents (a stopped
    build continues there)."""
    import torch

    pieces = [d[i : i + max_len] for d in docs for i in range(0, len(d), max_len)]
    parts: list = []  # (hidden, top_ids, top_logp) per piece done
    if partial is not None and Path(partial).is_file():
        with np.load(partial) as z:
            n_done = int(z["pieces"])
            if np.array_equal(z["ids"], np.concatenate(pieces[:n_done])):
                bounds = np.cumsum([0] + [len(p) for p in pieces[:n_done]])
                parts = [(z["hidden"][a:b], z["top_ids"][a:b], z["top_logp"][a:b])
                         for a, b in zip(bounds[:-1], bounds[1:])]
                log(f"  target features: continuing after {n_done} documents ({partial})")
    t0, done = time.time(), 0
    with torch.no_grad():
        for n in range(len(parts), len(pieces)):
            piece = pieces[n]
            out = model(input_ids=torch.from_numpy(piece)[None], output_hidden_states=True)
            logp = torch.log_softmax(out.logits[0].float(), -1)  # [n, V]
            top = logp.topk(min(k, logp.shape[-1]), -1)
            parts.append((out.hidden_states[-1][0].to(torch.float16).numpy(), top.indices.to(torch.int32).numpy(),
                          top.values.to(torch.float16).numpy()))
            done += len(piece)
            if (n + 1) % 16 == 0 or n + 1 == len(pieces):
                log(f"  target features: {n + 1}/{len(pieces)} documents, {done} tokens this run, "
                    f"{done / (time.time() - t0):.0f} tok/s")
                if partial is not None:
                    np.savez(partial, pieces=n + 1, ids=np.concatenate(pieces[: n + 1]),
                             **{name: np.concatenate([p[i] for p in parts]) for i, name in
                                enumerate(("hidden", "top_ids", "top_logp"))})
    hidden, top_ids, top_logp = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return FeatureCache(np.concatenate(pieces), hidden, top_ids, top_logp)


def cached_features(model, docs: list[np.ndarray], path: Path | None, log=print) -> FeatureCache:
    """The cache of documents ``docs`` (int64 [n_i] each, EOS included) at ``path`` if it holds exactly their
    stream, else built (and saved there)."""
    ids = np.concatenate(docs)
    if path is not None and Path(path).is_file():
        cache = FeatureCache.load(Path(path))
        if np.array_equal(cache.ids, ids):
            log(f"target features: {path} ({len(ids)} tokens)")
            return cache
        log(f"target features: {path} holds another token stream; computing them again")
    partial = None
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        partial = Path(path).with_suffix(".partial.npz")
    cache = build_cache(model, docs, log=log, partial=partial)
    if path is not None:
        cache.save(Path(path))
        partial.unlink(missing_ok=True)
    return cache


def positions(rng: np.random.Generator | None, n: int, k: int):
    """``k`` of the rows 0..n-1, drawn by ``rng`` and sorted (all of them when k is 0 or >= n): int64 tensor."""
    import torch

    if 0 < k < n:
        return torch.from_numpy(np.sort(rng.choice(n, k, replace=False)))
    return torch.arange(n)


def soft_ce(logits, top_ids, top_logp):
    """Cross-entropy of ``logits`` [.., V] against the target's distribution renormalised over its top K
    (``top_ids`` int64 [.., K], ``top_logp`` [.., K]); mean over positions. Its gradient is KL's."""
    import torch

    p = torch.softmax(top_logp.float(), -1)  # [.., K]
    logq = torch.log_softmax(logits.float(), -1).gather(-1, top_ids)  # [.., K]
    return -(p * logq).sum(-1).mean()


def topk_entropy(top_logp) -> float:
    """Mean entropy of the renormalised top-K target distributions: soft_ce minus this is the KL."""
    import torch

    logp = torch.log_softmax(top_logp.float(), -1)
    return float(-(logp.exp() * logp).sum(-1).mean())
