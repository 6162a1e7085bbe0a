"""For the tests: a target's logits recomputed from scratch on a new cache, and a driver of the decode core."""
from __future__ import annotations

import numpy as np

from specrt.runtime.core import DecodeCore, SequenceRequest
from specrt.runtime.api import runner_for_graph
from specrt.runtime.runner import HostRunner


def fresh_runner(graph, max_len: int = 64, max_batch: int = 1) -> HostRunner:
    """A new batch-1 runner (empty cache) over a ``Runtime`` graph (``rt.target`` / ``rt.draft``)."""
    return runner_for_graph(graph.engine, graph.spec, max_len, max_batch)


def fresh_logits(graph, seq, max_len: int = 64) -> np.ndarray:
    """The graph's next-token logits [V] after ``seq``, from scratch."""
    return fresh_runner(graph, max_len).prefill(0, seq)[0]


def tree_logits(runner: HostRunner, prefix, tokens, tree) -> np.ndarray:
    """Prefill ``prefix`` into slot 0 of an empty ``runner``, then ONE pass over ``tokens`` [N] laid on
    ``tree`` (node 0 = root); returns logits [N, V] (nothing of the tree is committed)."""
    runner.release(0)
    runner.prefill(0, prefix)
    return runner.forward([0], [tokens], blocks=[tree.mask], depths=[tree.depths]).logits[0]


def run_all(gen: DecodeCore, requests: list[SequenceRequest]) -> dict:
    """Admit in order whenever a slot is free, step until all finish; request_id -> (ids, text, finish, stats)."""
    pending, done, streamed = list(requests), {}, {r.request_id: [] for r in requests}

    def take(update):
        streamed[update.request_id] += [e.token_id for e in update.events if e.token_id is not None]
        if update.finish_reason:
            assert update.token_ids == streamed[update.request_id]  # the events carried every token
            done[update.request_id] = (update.token_ids, update.text, update.finish_reason, update.stats)

    while pending or gen.rows:
        while pending and gen.free_slots:
            take(gen.add(pending.pop(0)))
        updates, report = gen.step()
        if report is not None:
            assert report.batch_size == len(updates) and report.positions >= report.batch_size  # (packed: any)
        for u in updates:
            take(u)
    return done


def requests_for(params_list):
    return [SequenceRequest(f"r{i}", p, params) for i, (p, params) in enumerate(params_list)]


def assert_batched_rows_equal_batch1(rt, method: str, prompts, max_new, sampled: bool = False, max_batch: int = 3,
                                     gamma=None) -> dict:
    """Rows of different prompt lengths, finishing at different steps, decoded together in one core:
    each row's tokens equal its own batch-1 ``rt.generate`` (greedy; or seeded sampled at a fixed γ)."""
    from specrt.runtime.core import CoreConfig
    from specrt.runtime.sampling import SamplingParams

    params = [SamplingParams(max_new_tokens=m, **({"temperature": 1.0, "top_k": 8 if i % 2 else 0, "seed": 100 + i}
                                                  if sampled else {})) for i, m in enumerate(max_new)]
    core = rt.new_core(CoreConfig(max_batch=max_batch, method=method, gamma=gamma))
    done = run_all(core, requests_for(zip(prompts, params)))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ref = rt.generate(prompt, max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_k=p.top_k,
                          seed=p.seed, method=method, gamma=gamma)
        assert done[f"r{i}"][0] == ref.token_ids, (method, i, sampled)
        assert done[f"r{i}"][3]["method"] == method
    assert not core.rows and not core.target.lengths.any()
    return done


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straightforward float64 reference of the documented semantics (full sorts, loops)."""
    out = []
    for row in np.asarray(logits, dtype=np.float64):
        if temperature == 0:
            p = np.zeros_like(row)
            p[np.argmax(row)] = 1
            out.append(p)
            continue
        p = np.exp((row - row.max()) / temperature)
        p /= p.sum()
        if top_k:
            kth = np.sort(p)[::-1][min(top_k, len(p)) - 1]
            p = np.where(p >= kth, p, 0)
            p /= p.sum()
        if top_p < 1:  # keep x if the mass of tokens strictly more probable than x is < top_p
            _, group = np.unique(-p, return_inverse=True)  # tie groups, most probable first
            group_mass = np.bincount(group, weights=p)
            keep = (np.cumsum(group_mass) - group_mass)[group] < top_p
            p = np.where(keep, p, 0)
            p /= p.sum()
        if min_p:
            p = np.where(p >= min_p * p.max(), p, 0)
            p /= p.sum()
        out.append(p)
    return np.array(out)


def reference_penalize(logits, seq, prompt_len, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0):
    """Straightforward reference of the documented penalties for ONE row of logits after ``seq``."""
    x = np.array(logits, dtype=np.float64)
    output = list(seq[prompt_len:])
    for tok in set(seq):
        if repetition_penalty != 1:
            x[tok] = x[tok] / repetition_penalty if x[tok] > 0 else x[tok] * repetition_penalty
    for tok in set(output):
        x[tok] -= frequency_penalty * output.count(tok) + presence_penalty
    return x


def assert_head_cache_matches_fresh(rt, prompt, feature: str = "hidden", rows_ahead: int = 12) -> None:
    """EAGLE: after sampled rounds the head's cache equals the head run afresh on the target's ``feature`` of the
    emitted tokens (rows 0..L-2, restored after every round; a prompt of two prefill chunks)."""
    from types import SimpleNamespace

    from specrt.runtime.core import CoreConfig
    from specrt.runtime.sampling import SamplingParams

    core = rt.new_core(CoreConfig(max_batch=1, method="eagle", gamma=1, calibrate=False))
    core.add(SequenceRequest("r", prompt, SamplingParams(temperature=1.0, seed=3, max_new_tokens=20)))
    row, head = core.rows[0], core.proposer.runner
    while len(row.seq) < len(prompt) + rows_ahead:
        core.step()
    assert row.counts.rounds >= 2
    core.proposer._catch_up(row)  # the rows buffered since the last draft
    n = int(head.lengths[row.slot])
    assert n == len(row.seq) - 1  # the head holds rows 0..L-2
    _, feats = fresh_runner(rt.target).prefill(0, row.seq[:n], feature)  # [n, F] true features of rows 0..n-1
    fresh = rt.proposer("eagle", 1)
    fresh_row = SimpleNamespace(slot=0, seq=row.seq[: n + 1], request=SimpleNamespace(request_id="fresh"))
    fresh.start(fresh_row, feats)
    fresh._catch_up(fresh_row)
    assert np.abs(fresh.runner.data[:, :n, 0] - head.data[:, :n, row.slot]).max() < 1e-4
    core.remove("r")



def assert_greedy_equals_hf_past_window(model_dir, engine_dir, max_len: int = 2048, prompt_tokens: int = 600,
                                        new_tokens: int = 32, methods=("none", "ngram"), log=print) -> dict:
    """Export the HF dir ``model_dir`` (traced graph) at ``max_len`` to ``engine_dir`` and assert its greedy
    output equals HF ``generate(do_sample=False)`` on a ``prompt_tokens``-token prompt (Python source read by
    the model's tokenizer), ``new_tokens`` new tokens, for each of ``methods``. Meant for a model with
    sliding windows shorter than the prompt (Gemma 3 270M: 512): every new token is past them.

    Returns {"export_seconds", "windows" (the manifest's per-layer windows), "prompt", "tokens", "past_window"
    (how many prompt + new tokens lie past the smallest window)}."""
    import inspect
    import time
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer

    import specrt
    from specrt.export.hf_checkpoint import load_hf
    from specrt.export.onnx_export import ExportConfig, export_engine

    t0 = time.time()
    engine = export_engine(model_dir, engine_dir, cfg=ExportConfig(max_len=max_len, graph="traced"), log=log,
                           force=True)
    export_seconds = time.time() - t0
    text = inspect.getsource(inspect)  # a long, fixed text
    prompt = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(text).ids[:prompt_tokens]
    assert len(prompt) == prompt_tokens and prompt_tokens + new_tokens <= max_len
    model = load_hf(model_dir)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                            min_new_tokens=new_tokens, eos_token_id=None)[0, len(prompt):].tolist()
    del model
    rt = specrt.load(engine)
    windows = list(rt.manifest.target.windows or [])
    for method in methods:
        out = rt.generate(prompt, max_new_tokens=new_tokens, method=method).token_ids
        assert out == hf[: len(out)] and out, (method, out, hf)
    smallest = min((w for w in windows if w), default=max_len)
    return {"export_seconds": round(export_seconds, 1), "windows": windows, "prompt": prompt_tokens, "tokens": hf,
            "past_window": prompt_tokens + new_tokens - smallest}


class FixedCost:
    """A target's pass costs fixed for a test of the policy: ``curve(n)`` seconds for a pass over n positions in all,
    whatever its rows (``PassCost``'s interface); recorded calls change nothing."""

    def __init__(self, curve):
        self.curve = curve  # n positions -> seconds

    def __bool__(self) -> bool:
        return True

    def seconds(self, rows: int, positions=None):
        if isinstance(positions, np.ndarray):
            return np.array([self.curve(int(n)) for n in positions.ravel()]).reshape(positions.shape)
        return self.curve(rows if positions is None else positions)

    def record(self, rows: int, positions: int, seconds: float) -> None:
        pass

    def known(self, rows: int, positions: int) -> bool:
        return True


def fix_costs(core: DecodeCore, curve) -> None:
    """Every policy of ``core`` prices passes by ``FixedCost(curve)`` (the calls so far recorded real timings)."""
    cost = FixedCost(curve)
    for policy in core.policies.values():
        policy.target_cost = cost
