"""Verification cost T(Q)/T(1) of quantized fused graphs, per quantization config, and their decode/verify gap.

    python -m specrt.tools.bench.verify_curve SOURCE [--layers N] --config int4 --config w8a8 --config w8a8+pad \\
        [--config "int4|int4,acc=1"] [--qs 1,2,4,5,8,16] [--past 128] [--threads 2] [--rounds 8] \\
        [--calls 3] [--clock wall|cpu] [--no-quality] [--out docs/bench/verify-curve.json]

SOURCE is an HF checkpoint dir (its fused fp32 graph is built, ``--layers N`` keeps the first N decoder
layers for fast exploration) or a fused fp32 ``.onnx`` (kv_layout in_place, unquantized). Each config is
export/quantize.py's ``parse_options`` string (``fp32``: the graph unquantized), ``+pad`` at its end
applying export/decode_pad.py (one padding row in every attention call); ``A|B`` is a two-graph
design: decode steps (Q = 1) on A's graph, verify passes (Q > 1) on B's. Every graph runs through an
``InPlaceRunner`` at ``--threads`` intra-op threads after ``--past`` cached tokens, the way decoding
calls it. Timing: ``--rounds`` rounds; in each, every config in turn (the order rotating), every Q, a
warm-up call and ``--calls`` timed ones; reported per (config, Q): the fastest call over all rounds and
the median of the per-round fastest (the spread says how busy the machine was), T(Q)/T(1) from the fastest.
``--clock cpu`` times the calling thread's CPU time instead of elapsed time (``--threads 1``): on a busy
machine the only clock preemption does not distort.

Per config, besides time (``--no-quality`` skips these): the decode/verify gap, max |Δlogit| between 5
one-token decode steps (greedy continuation of a prompt) and one verify pass of the same 5 tokens, with
the decode step run as Q = 1 (``gap_q1``) and as a 2-row call whose second row is padding (``gap_q2``:
the verify numerics for decode steps); and the distance from the fp32 graph on the prompt's prefill
logits (mean KL(fp32 || config), top-1 agreement).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from ...export.parity import CALIBRATION_TEXT

QS = (1, 2, 4, 5, 8, 16)
PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nclass Stack:\n    def __init__(self):\n"
          "        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n"
          "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg")
GAP_TOKENS = 5  # tokens per decode/verify comparison (a verify pass of gamma 4)


def fp32_graph(source: Path, layers: int | None, max_len: int, out: Path) -> Path:
    """The unquantized fused graph of ``source`` (an HF dir, or a fused fp32 .onnx returned as is)."""
    if source.suffix == ".onnx":
        return source
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    from ...export.fused_graph import build_fused_graph

    extra = {"num_hidden_layers": layers} if layers else {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **extra).eval()
    path = out / "fp32.onnx"
    onnx.save(build_fused_graph(model, max_len), str(path), save_as_external_data=True, location="fp32.onnx.data")
    return path


def quantized_graph(fp32: Path, spec: str, out: Path, calibration_ids) -> Path:
    """``fp32`` quantized as ``spec`` says (smoothing statistics on ``calibration_ids``), in a file of its own."""
    import onnx

    from ...export.decode_pad import pad_attention
    from ...export.quantize import parse_options, quantize_proto

    base, pad = spec.removesuffix("+pad"), spec.endswith("+pad")
    if base == "fp32" and not pad:
        return fp32
    path = out / f"q{len(list(out.glob('q*.onnx')))}.onnx"
    proto = onnx.load(str(fp32))
    if base != "fp32":
        proto = quantize_proto(proto, parse_options(base), calibration_ids)
    if pad:
        pad_attention(proto)
    onnx.save(proto, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def graph_facts(path: Path) -> tuple[int, int]:
    """(KV capacity, vocabulary) of a fused graph: its rotary cache's rows, its embedding's rows."""
    import onnx

    from ...export.fused_call import graph_max_len

    proto = onnx.load(str(path), load_external_data=False)
    return graph_max_len(proto), next(int(i.dims[0]) for i in proto.graph.initializer if i.name == "embed")


def make_runner(path: Path, threads: int, max_len: int):
    """An ``InPlaceRunner`` of one slot on the fused graph at ``path`` (geometry read from its inputs)."""
    from ...engines.ort import OrtEngine
    from ...runtime.in_place import InPlaceRunner

    engine = OrtEngine(path, threads=threads)
    past = [i for i in engine.session.get_inputs() if i.name.startswith("past_key.")]
    _, kv_heads, _, head_dim = past[0].shape
    vocab = engine.session.get_outputs()[0].shape[-1]
    return InPlaceRunner(engine, len(past), kv_heads, head_dim, max_len, vocab)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}  # cpu: this thread's CPU time (--threads 1)


def timed_calls(runner, q: int, past: int, calls: int, clock=time.perf_counter) -> list[float]:
    """Seconds of ``calls`` [1, q] passes after ``past`` stale cache entries (one untimed warm-up first)."""
    ids = np.zeros((1, q), np.int64)
    out = []
    for i in range(calls + 1):
        runner.set_length(0, past)
        t0 = clock()
        runner.forward([0], ids, record=False)
        if i:
            out.append(clock() - t0)
    return out


def measure_curves(runners: dict, qs, past: int, rounds: int, calls: int, clock=time.perf_counter, log=print) -> dict:
    """name -> {"q", "min_s", "median_round_s", "ratio"}; ``runners``: name -> (decode runner, verify runner)."""
    names = list(runners)
    samples = {n: {q: [] for q in qs} for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            decode, verify = runners[name]
            for q in qs:
                samples[name][q].append(min(timed_calls(decode if q == 1 else verify, q, past, calls, clock)))
        log(f"round {r + 1}/{rounds}")
    curves = {}
    for name in names:
        best = np.array([min(samples[name][q]) for q in qs])
        curves[name] = {"q": list(qs), "min_s": best.tolist(),
                        "median_round_s": [float(np.median(samples[name][q])) for q in qs],
                        "ratio": (best / best[0]).round(3).tolist()}
    return curves


def prompt_ids(source: Path, vocab: int, text: str = PROMPT, n: int = 96) -> np.ndarray:
    """``text``'s token ids (the checkpoint's tokenizer, or a tokenizer.json beside the .onnx; random ids
    when there is none)."""
    tok = source.parent / "tokenizer.json" if source.suffix == ".onnx" else source / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer

        return np.array(Tokenizer.from_file(str(tok)).encode(text).ids[:n], np.int64)
    return np.random.default_rng(len(text)).integers(1, vocab, n)


def prefill(runner, ids: np.ndarray) -> np.ndarray:
    """Reset slot 0, run ``ids`` [P] in one call, commit; returns its logits [P, V]."""
    runner.set_length(0, 0)
    p = runner.forward([0], ids[None])
    runner.commit(p)
    return p.logits[0]


def decode_verify_gap(decode, verify, ids: np.ndarray, pad_row: bool) -> float:
    """max |Δlogit| between GAP_TOKENS greedy decode steps on ``decode`` (one-token calls, or 2-row calls
    with a padding row when ``pad_row``) and one verify pass of the same tokens on ``verify``."""
    prefill(decode, ids[:-1])
    tokens, steps = [int(ids[-1])], []
    for _ in range(GAP_TOKENS):
        call = np.array([[tokens[-1], 0]] if pad_row else [[tokens[-1]]], np.int64)
        p = decode.forward([0], call)
        decode.commit(p, [[0]])
        steps.append(p.logits[0, 0])
        tokens.append(int(np.argmax(steps[-1])))
    if verify is not decode:
        prefill(verify, ids[:-1])
    verify.set_length(0, len(ids) - 1)
    v = verify.forward([0], np.array([tokens[:GAP_TOKENS]], np.int64)).logits[0]
    return float(max(np.abs(s - v[i]).max() for i, s in enumerate(steps)))


def kl_top1(ref: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(mean KL(softmax(ref) || softmax(logits)), top-1 agreement) over rows [N, V]."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref.astype(np.float64)), log_softmax(logits.astype(np.float64))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return float(kl.mean()), float((ref.argmax(-1) == logits.argmax(-1)).mean())


def quality(runners: dict, ids: np.ndarray, reference) -> dict:
    """name -> {"gap_q1", "gap_q2", "kl_mean", "top1"} (see the module docstring)."""
    ref = prefill(reference, ids)
    out = {}
    for name, (decode, verify) in runners.items():
        kl, top1 = kl_top1(ref, prefill(verify, ids))
        out[name] = {"gap_q1": decode_verify_gap(decode, verify, ids, False),
                     "gap_q2": decode_verify_gap(decode, verify, ids, True), "kl_mean": kl, "top1": top1}
    return out


def table(result: dict) -> str:
    """The result as a markdown table: per config T(1), T(Q)/T(1) and the quality columns."""
    qs = result["settings"]["qs"]
    curves, quality_ = result.get("curves", {}), result.get("quality", {})
    head = "| config | T(1) ms | " + " | ".join(f"T({q})/T(1)" for q in qs[1:]) + " | gap Q=1 | gap Q=2 | KL | top-1 |"
    lines = [head, "|" + "---|" * (len(qs) + 5)]
    for name in dict.fromkeys([*curves, *quality_]):
        c, q = curves.get(name), quality_.get(name, {})
        cells = [f"{c['min_s'][0] * 1e3:.2f}", *(f"{r:.2f}" for r in c["ratio"][1:])] if c else ["-"] * len(qs)
        cells += [f"{q[k]:.3g}" if k in q else "-" for k in ("gap_q1", "gap_q2", "kl_mean")]
        cells.append(f"{q['top1']:.3f}" if q else "-")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench(source: Path, configs: list[str], layers: int | None, qs, past: int, threads: int, rounds: int,
          calls: int, with_quality: bool, clock: str = "wall", max_len: int = 512, log=print) -> dict:
    if clock == "cpu" and threads != 1:
        raise ValueError("--clock cpu times the calling thread: it needs --threads 1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp32 = fp32_graph(source, layers, max_len, tmp)
        max_len, vocab = graph_facts(fp32)
        calibration = prompt_ids(source, vocab, CALIBRATION_TEXT, min(256, max_len))  # smoothing: not the KL's prompt
        graphs, runners = {}, {}
        for name in configs:
            decode_spec, _, verify_spec = name.partition("|")
            for spec in (decode_spec, verify_spec or decode_spec):
                if spec not in graphs:
                    log(f"quantizing {spec} ...")
                    graphs[spec] = make_runner(quantized_graph(fp32, spec, tmp, calibration), threads, max_len)
            runners[name] = (graphs[decode_spec], graphs[verify_spec or decode_spec])
        quality_out = None
        if with_quality:
            reference = graphs.get("fp32") or make_runner(fp32, threads, max_len)
            quality_out = quality(runners, prompt_ids(source, vocab, n=min(96, max_len - GAP_TOKENS - 1)), reference)
        curves = measure_curves(runners, qs, past, rounds, calls, CLOCKS[clock], log) if rounds else {}
    import onnxruntime

    from ...export.latency import cpu_name

    result = {"settings": {"source": str(source), "layers": layers, "qs": list(qs), "past": past, "threads": threads,
                           "rounds": rounds, "calls": calls, "clock": clock, "onnxruntime": onnxruntime.__version__,
                           "cpu": cpu_name()},
              "curves": curves}
    if quality_out:
        result["quality"] = quality_out
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path, help="HF checkpoint dir, or a fused fp32 .onnx")
    ap.add_argument("--config", action="append", required=True, help="quantization options (repeatable)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (HF dir only)")
    ap.add_argument("--qs", default=",".join(map(str, QS)))
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: the calling thread's CPU time (robust on a busy machine; --threads 1)")
    ap.add_argument("--no-quality", action="store_true", help="skip the decode/verify gap and the KL")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    a = ap.parse_args(argv)
    qs = tuple(sorted({1, *(int(q) for q in a.qs.split(","))}))
    result = bench(a.source, a.config, a.layers, qs, a.past, a.threads, a.rounds, a.calls, not a.no_quality, a.clock)
    print(table(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
