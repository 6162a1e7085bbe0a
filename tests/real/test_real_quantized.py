"""SmolLM2-135M-Instruct, int8 and int4 engines: close to the fp32 model, by the floors their manifest documents.

Over every position of a few HumanEval prompts (teacher-forced: each prompt run once through the engine, in
prefill chunks, and once through the fp32 PyTorch model), the mean KL(p_fp32 || p_quantized) of the
next-token distributions (T = 1, nats) must not exceed the documented KL bound, and the top-1 agreement
(the share of *decided* positions, where PyTorch's top-1 logit leads its runner-up by ``TOP1_MARGIN`` or
more, at which both argmaxes agree; near-ties say nothing) must reach the documented floor. The bounds are
the ones the export judged the engine by and wrote into its manifest (``documented_floors``), so the test,
the export and the docs cannot drift apart; the text here is not the export's calibration text.
"""
import json

import numpy as np
import pytest
import torch

from reference import fresh_runner

TOP1_MARGIN = 1.0  # nats: a position is decided when torch's top-1 logit leads by this (export/parity.py's)

pytestmark = pytest.mark.real


def documented_floors(manifest: dict) -> tuple[float, float]:
    """(largest allowed mean KL, smallest allowed top-1 agreement) from manifest.json's
    ``models.target.parity.bounds``: its ``kl_mean`` and ``top1`` (export/parity.py's Bounds)."""
    parity = manifest["models"]["target"].get("parity")
    assert parity is not None, "manifest.json has no models.target.parity: the export wrote no parity report"
    return float(parity["bounds"]["kl_mean"]), float(parity["bounds"]["top1"])


def position_logits(rt, ids: list[int]) -> np.ndarray:
    """The engine's logits [len(ids), V] at every position of ``ids`` (prefill chunks on a fresh cache)."""
    runner = fresh_runner(rt.target, rt.manifest.max_len)
    out = []
    for i in range(0, len(ids), runner.prefill_chunk):
        p = runner.forward([0], [ids[i : i + runner.prefill_chunk]], record=False)
        runner.commit(p)
        out.append(p.logits[0])
    return np.concatenate(out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_and_top1(rt, hf, texts) -> tuple[float, float]:
    """(mean KL(p_torch || p_engine), top-1 agreement on decided positions) over every position of ``texts``."""
    kls, agree = [], []
    for text in texts:
        ids = rt.encode(text)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].double().numpy()  # [P, V]
        got = position_logits(rt, ids)
        lr, lg = log_softmax(ref), log_softmax(got)
        kls.append((np.exp(lr) * (lr - lg)).sum(-1))
        top2 = np.sort(np.partition(ref, -2, axis=-1)[:, -2:], axis=-1)
        decided = top2[:, 1] - top2[:, 0] >= TOP1_MARGIN
        agree.append((ref.argmax(-1) == got.argmax(-1))[decided])
    return float(np.concatenate(kls).mean()), float(np.concatenate(agree).mean())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_kl_and_top1_within_documented_floors(smollm2_rt, smollm2_hf, code_prompts, kind):
    rt = smollm2_rt(kind)
    kl_max, top1_min = documented_floors(json.loads((rt.manifest.root / "manifest.json").read_text()))
    kl, top1 = kl_and_top1(rt, smollm2_hf, code_prompts.values())
    assert kl <= kl_max, f"{kind}: mean KL {kl:.4f} > documented {kl_max}"
    assert top1 >= top1_min, f"{kind}: top-1 agreement {top1:.3f} < documented {top1_min}"
