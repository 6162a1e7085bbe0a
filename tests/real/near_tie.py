"""When a real model's greedy output counts as the reference's greedy output: its choice, near-ties aside.

Greedy decoding emits, at each position, the argmax of the logits given the sequence so far. So an output is
the reference's greedy output exactly when every one of its tokens is the reference's argmax given the same
prefix; the reference's logits at every position of an output come from one teacher-forced run (HF: one
forward over prompt + output, the logits ``generate(do_sample=False)`` takes its argmax of at each step).

Two correct implementations compute a model's logits up to rounding: fp32 ONNX Runtime and PyTorch differ by
~1e-4 on SmolLM2's real text (the export's parity check bounds more), a verify pass of Q tokens and a decode
pass of one by less. Where the reference's two best logits are closer than that, either token is a correct
greedy choice. So:

    RULE: at every generated position, the token must be the reference's argmax given the same prefix; where
    the reference's top-1 minus top-2 logit margin is below ``MARGIN``, it may instead be the runner-up.

``MARGIN`` = 1e-2, a hundred times the fp32 ORT-vs-PyTorch difference measured along SmolLM2's greedy paths
(6.9e-5 and 1.1e-4) and eight times the largest the export's parity check saw on random inputs (1.2e-3): a
flip needs a margin below twice the difference, so no real mismatch is forgiven. Every position is checked
(after a near-tie flip, the output's own prefix is the one the reference is asked about).
"""
from __future__ import annotations

import numpy as np

MARGIN = 1e-2


def margins_of(logits) -> tuple[np.ndarray, np.ndarray]:
    """logits [N, V] -> (top-1 minus top-2 [N], the two best ids [N, 2], best first)."""
    x = np.array(logits, dtype=np.float64)  # a copy: the best is masked out to find the second
    rows = np.arange(len(x))
    first = x.argmax(-1)
    top1 = x[rows, first]
    x[rows, first] = -np.inf
    second = x.argmax(-1)  # (argmax, not argpartition: qemu's AVX2 emulation miscomputes numpy's AVX2 argselect
    return top1 - x[rows, second], np.stack([first, second], -1)  # and argsort kernels, tests/emulated/)


def assert_greedy_choices(tokens: list[int], logits, label: str = "") -> int:
    """The RULE: ``tokens`` [N] generated, ``logits`` [N, V] the reference's at each of them (given the
    tokens before). Returns how many near-tie flips it allowed."""
    assert len(tokens) == len(logits) and len(tokens) > 0, (label, len(tokens), len(logits))
    margins, top2 = margins_of(logits)
    flips = 0
    for i, t in enumerate(tokens):
        if t == top2[i, 0]:
            continue
        assert t == top2[i, 1] and margins[i] < MARGIN, (
            f"{label}: token {i} is {t}, but the reference's greedy choice there is {top2[i, 0]} (runner-up "
            f"{top2[i, 1]}, margin {margins[i]:.2e} >= {MARGIN}); output {tokens}")
        flips += 1
    return flips


def hf_logits(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The HF model's logits [len(tokens), V] at each generated position, one forward over prompt + tokens."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([prompt + tokens[:-1]]), logits_to_keep=len(tokens)).logits[0]
    return out.float().numpy()


def plain_logits(rt, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Plain decoding's logits [len(tokens), V] on ``rt``'s target along ``tokens``: the prompt prefilled,
    then one decode step per token, as method "none" runs them."""
    from reference import fresh_runner

    runner = fresh_runner(rt.target, rt.manifest.max_len)
    out = [runner.prefill(0, prompt)[0]]
    for t in tokens[:-1]:
        p = runner.forward([0], [[t]], record=False)
        runner.commit(p)
        out.append(p.logits[0, 0])
    return np.stack(out)
