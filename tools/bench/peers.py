"""`specrt bench peers`: specrt against the engines a CPU user would pick instead, in ONE interleaved run.

    specrt bench peers [--model HF_DIR --draft HF_DIR] [--threads 1] [--precision fp32 int4] [--reps 3]
                       [--genai-python PATH] [--llama-python PATH] [--openvino-python PATH] [--cpp] [--out FILE]
    specrt bench peers --serve [...]   # the serving comparison: specrt serve vs llama-server (serve_peers.py)

Every system converts the same HF checkpoint itself (specrt: `specrt export`, with --quantize for
int8/int4; ONNX Runtime GenAI: its model builder; llama.cpp: llama-cpp-python and the GGUF converter
of llama.cpp's sources (--gguf-converter), q8_0 / q4_0 for int8 / int4; OpenVINO GenAI: optimum-intel's export) and decodes the same prompt
token ids greedily, with the same intra-op threads, each in its own worker process, loaded once.
For each repetition every (system, method, precision) runs in turn, the order rotating, so load on
the machine falls on all of them alike; medians of tokens/s, and ratios to the fastest peer's plain
decoding. A peer whose python lacks it is listed with the command that installs it (none is needed
for specrt or its tests). `--cpp` adds rows of specrt's C++ runtime (libspecrt) on the same engine
dirs (γ fixed at the exported one; the Python rows use adaptive γ). Default model: the demo pair.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..prompts import CODE

DEMO = Path(__file__).resolve().parents[1] / "demo_models"

# peer -> (import probe, install command, precisions it is run at)
PEERS = {
    "onnxruntime-genai": ("import onnxruntime_genai, onnx_ir", "pip install onnxruntime-genai onnx_ir", ("fp32", "int4")),
    "llama.cpp": ("import llama_cpp", "pip install llama-cpp-python  # builds llama.cpp from source",
                  ("fp32", "int8", "int4")),
    "openvino-genai": ("import openvino_genai, optimum.intel", "pip install openvino-genai 'optimum[openvino]'",
                       ("fp32", "int4")),
}

SPECRT_WORKER = r'''
import json, sys, time
kind, engine, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "cpp":  # the C++ runtime (libspecrt at argv[4]) through its ctypes binding
    from specrt.tools.libspecrt import CppEngine, load_library
    rt = CppEngine(load_library(sys.argv[4]), engine, threads=threads)
else:
    import specrt
    rt = specrt.load(engine, threads=threads or None)
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    tokens, seconds, outs = 0, 0.0, []
    for ids in job["prompts"]:
        t0 = time.perf_counter()
        out = rt.generate(ids, max_new_tokens=job["max_new"], method=job["method"]).token_ids
        seconds += time.perf_counter() - t0
        tokens += len(out); outs.append(out)
    print(json.dumps({"tokens_per_second": tokens / seconds, "outputs": outs}), flush=True)
'''

GENAI_WORKER = r'''
import json, sys, time
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
def gen(ids, n):
    p = og.GeneratorParams(model)
    p.set_search_options(max_length=len(ids) + n, do_sample=False)
    g = og.Generator(model, p)
    g.append_tokens(ids)
    out = []
    while not g.is_done() and len(out) < n:
        g.generate_next_token()
        out.append(int(g.get_next_tokens()[0]))
    return out
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    tokens, seconds, outs = 0, 0.0, []
    for ids in job["prompts"]:
        t0 = time.perf_counter(); out = gen(ids, job["max_new"]); seconds += time.perf_counter() - t0
        tokens += len(out); outs.append(out)
    print(json.dumps({"tokens_per_second": tokens / seconds, "outputs": outs}), flush=True)
'''

LLAMA_WORKER = r'''
import json, sys, time
import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
threads = int(sys.argv[2]) or None
models = {}
def model(method):
    if method not in models:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=4) if method == "ngram" else None
        models[method] = Llama(sys.argv[1], n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False,
                               draft_model=draft)
    return models[method]
def gen(m, ids, n):
    out = []
    for tok in m.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(int(tok))
        if len(out) >= n:
            break
    return out
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    m = model(job["method"])
    tokens, seconds, outs = 0, 0.0, []
    for ids in job["prompts"]:
        t0 = time.perf_counter(); out = gen(m, ids, job["max_new"]); seconds += time.perf_counter() - t0
        tokens += len(out); outs.append(out)
    print(json.dumps({"tokens_per_second": tokens / seconds, "outputs": outs}), flush=True)
'''


def probe(python: str, peer: str) -> bool:
    """Whether ``python`` can import the peer."""
    code = PEERS[peer][0]
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


class Worker:
    """One system loaded in its own process: ``run(job)`` -> {"tokens_per_second", "outputs"}."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{name}: worker failed to start (see its error above)")

    def run(self, job: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died since the last job
            raise RuntimeError(f"{self.name}: worker died") from None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: worker died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        else:
            self.proc.stdin = None  # (a dead worker's pipe: nothing to flush)


def build_specrt(model: Path, draft: Path | None, precision: str, out: Path) -> Path:
    from ...export.onnx_export import ExportConfig, export_engine

    quantize = None if precision == "fp32" else precision
    return export_engine(model, out, draft_dir=draft, cfg=ExportConfig(max_len=1024, quantize=quantize),
                         log=lambda *_: None, force=True)


def build_genai(python: str, model: Path, precision: str, out: Path, threads: int) -> Path:
    """ONNX Runtime GenAI's model builder on the HF checkpoint; intra-op threads set in genai_config.json."""
    subprocess.run([python, "-m", "onnxruntime_genai.models.builder", "-m", str(model), "-i", str(model), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(out.parent / "genai_cache")], check=True,
                   capture_output=True)
    cfg_path = out / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    if threads:
        cfg["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return out


# llama.cpp's converter, with the BPE pre-tokenizer it cannot identify (the demo's own tokenizer) read as
# GPT-2's byte-level one: only text -> ids depends on it, and the bench feeds token ids.
GGUF_CONVERT = r'''
import pathlib, runpy, sys
script, gguf_py, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = [script] + args
sys.path[:0] = [gguf_py, str(pathlib.Path(script).parent)]
try:
    from conversion import base, llama
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
except ImportError:
    pass
runpy.run_path(script, run_name="__main__")
'''

GGUF_QUANTIZE = r'''
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
'''


def build_gguf(python: str, converter: Path | None, model: Path, precision: str, out: Path) -> Path:
    """GGUF f32 from llama.cpp's convert_hf_to_gguf.py (its gguf-py beside it), then q8_0 / q4_0 for int8 / int4."""
    if converter is None:
        raise RuntimeError("llama.cpp: pass --gguf-converter PATH/convert_hf_to_gguf.py (in llama.cpp's sources, "
                           "e.g. vendor/llama.cpp of the llama-cpp-python source package)")
    f32 = out.with_suffix(".f32.gguf")
    if not f32.is_file():
        subprocess.run([python, "-c", GGUF_CONVERT, str(converter), str(converter.parent / "gguf-py"), str(model),
                        "--outfile", str(f32), "--outtype", "f32"], check=True, capture_output=True)
    if precision == "fp32":
        return f32
    kind = {"int8": "Q8_0", "int4": "Q4_0"}[precision]
    q = out.with_suffix(f".{kind.lower()}.gguf")
    subprocess.run([python, "-c", GGUF_QUANTIZE, str(f32), str(q), f"LLAMA_FTYPE_MOSTLY_{kind}"], check=True,
                   capture_output=True)
    return q


def systems(a, work: Path, log) -> tuple[dict, dict]:
    """(name -> Worker, missing peer -> why) for specrt and every peer that is installed."""
    workers, missing = {}, {}
    for precision in a.precision:
        engine = build_specrt(a.model, a.draft, precision, work / f"specrt-{precision}")
        workers[f"specrt {precision}"] = Worker(f"specrt {precision}", [sys.executable, "-c", SPECRT_WORKER, "python",
                                                                      str(engine), str(a.threads)])
        if a.cpp:  # the C++ runtime on the same engine dir (fixed γ = the exported one)
            from ..libspecrt import build, library_path

            lib = library_path(build(log=lambda *_: None))
            workers[f"specrt-cpp {precision}"] = Worker(f"specrt-cpp {precision}", [
                sys.executable, "-c", SPECRT_WORKER, "cpp", str(engine), str(a.threads), str(lib)])
    pythons = {"onnxruntime-genai": a.genai_python, "llama.cpp": a.llama_python, "openvino-genai": a.openvino_python}
    for peer, python in pythons.items():
        python = python or sys.executable
        if not probe(python, peer):
            missing[peer] = f"not installed in {python}: {PEERS[peer][1]}"
            continue
        for precision in [p for p in a.precision if p in PEERS[peer][2]]:
            name = f"{peer} {precision}"
            try:
                if peer == "onnxruntime-genai":
                    path = build_genai(python, a.model, precision, work / f"genai-{precision}", a.threads)
                    workers[name] = Worker(name, [python, "-c", GENAI_WORKER, str(path)])
                elif peer == "llama.cpp":
                    path = build_gguf(python, a.gguf_converter, a.model, precision, work / "model")
                    workers[name] = Worker(name, [python, "-c", LLAMA_WORKER, str(path), str(a.threads)])
                else:
                    missing[peer] = "installed, but this bench does not drive OpenVINO GenAI yet"
            except (subprocess.CalledProcessError, RuntimeError) as e:
                err = getattr(e, "stderr", b"") or b""
                missing[name] = f"conversion failed: {e} {err.decode(errors='replace')[-300:] if err else ''}"
        log(f"  {peer}: ready" if peer not in missing else f"  {peer}: {missing[peer]}")
    return workers, missing


METHODS = {"specrt": ("none", "draft", "ngram"), "specrt-cpp": ("none", "draft", "ngram"), "onnxruntime-genai": ("none",), "llama.cpp": ("none", "ngram"),
           "openvino-genai": ("none",)}


def bench(a, log=print) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in CODE[: a.prompts]]
    work = Path(tempfile.mkdtemp(prefix="specrt-peers-"))
    try:
        log(f"converting {a.model} for each system (in {work}) ...")
        workers, missing = systems(a, work, log)
        runs = [(name, m) for name in workers for m in METHODS[name.rsplit(" ", 1)[0]]
                if m != "draft" or a.draft is not None]
        job = lambda m: {"prompts": prompts, "max_new": a.max_new_tokens, "method": m}
        for name, m in list(runs):  # warm-up; a system that fails here is listed, not run
            try:
                workers[name].run({**job(m), "max_new": 8})
            except RuntimeError as e:
                missing[name] = f"failed in its warm-up ({e}; exit code {workers[name].proc.poll()})"
                runs = [r for r in runs if r[0] != name]
        samples = {run: [] for run in runs}
        outputs = {}
        for rep in range(a.reps):
            order = runs[rep % len(runs):] + runs[: rep % len(runs)]
            for name, m in order:
                r = workers[name].run(job(m))
                samples[(name, m)].append(r["tokens_per_second"])
                outputs[(name, m)] = r["outputs"]
            log(f"  repetition {rep + 1}/{a.reps} done")
        for w in workers.values():
            w.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(samples, outputs, missing)


def report(samples: dict, outputs: dict, missing: dict) -> dict:
    med = {run: statistics.median(v) for run, v in samples.items()}
    plain_peers = {run: v for run, v in med.items() if run[1] == "none" and not run[0].startswith("specrt")}
    best_peer = max(plain_peers, key=plain_peers.get) if plain_peers else None
    ref = outputs.get(("specrt fp32", "none"))

    def same(run):  # share of prompts whose greedy tokens equal specrt fp32 plain decoding's
        return None if ref is None else sum(a == b for a, b in zip(outputs[run], ref)) / len(ref)

    rows = [{"system": name, "method": m, "tokens_per_second": v, "samples": samples[(name, m)],
             "vs_fastest_peer_plain": v / plain_peers[best_peer] if best_peer else None,
             "same_tokens_as_specrt_fp32": same((name, m))} for (name, m), v in med.items()]
    return {"rows": rows, "fastest_peer_plain": " ".join(best_peer) if best_peer else None, "missing": missing}


def print_report(res: dict) -> None:
    print(f"{'system':<26}{'method':<8}{'tok/s':>8}{'vs fastest peer plain':>23}{'same tokens':>13}")
    for r in res["rows"]:
        ratio = "-" if r["vs_fastest_peer_plain"] is None else f"{r['vs_fastest_peer_plain']:.2f}x"
        same = "-" if r["same_tokens_as_specrt_fp32"] is None else f"{r['same_tokens_as_specrt_fp32']:.0%}"
        print(f"{r['system']:<26}{r['method']:<8}{r['tokens_per_second']:>8.0f}{ratio:>23}{same:>13}")
    for peer, why in res["missing"].items():
        print(f"{peer}: {why}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serve" in argv:  # the serving comparison has its own options
        from .serve_peers import main as serve_main

        serve_main([x for x in argv if x != "--serve"])
        return
    ap = argparse.ArgumentParser(prog="specrt bench peers", description=__doc__.splitlines()[0],
                                 epilog="specrt bench peers --serve --help: the serving comparison (llama-server)")
    ap.add_argument("--model", type=Path, default=DEMO / "target", help="HF checkpoint dir (default: the demo target)")
    ap.add_argument("--draft", type=Path, default=None, help="HF draft dir (default: the demo draft with the demo target)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for every system (0: each one's default)")
    ap.add_argument("--precision", nargs="+", default=["fp32", "int4"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=len(CODE))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--genai-python", help="python with onnxruntime-genai (default: this one)")
    ap.add_argument("--llama-python", help="python with llama-cpp-python (default: this one)")
    ap.add_argument("--gguf-converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py (for the llama.cpp rows)")
    ap.add_argument("--openvino-python", help="python with openvino-genai (default: this one)")
    ap.add_argument("--cpp", action="store_true", help="also run specrt's C++ runtime (libspecrt, built with CMake)")
    ap.add_argument("--smoke", action="store_true", help="one repetition, 1 prompt, 8 tokens, fp32 (the tests' mode)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    a = ap.parse_args(argv)
    if a.draft is None and a.model == DEMO / "target":
        a.draft = DEMO / "draft"
    if a.smoke:
        a.reps, a.prompts, a.max_new_tokens, a.precision = 1, 1, 8, ["fp32"]
    res = bench(a)
    print_report(res)
    if a.out:
        meta = {"command": "specrt bench peers " + " ".join(argv if argv is not None else sys.argv[1:]),
                "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "time": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": a.threads}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, **res}, indent=1))
        print(f"results written to {a.out}")


if __name__ == "__main__":
    main()
