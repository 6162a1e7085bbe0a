"""Suffix decoding against the other proposers on (a) an agentic-style workload and (b) the code prompts.

    python -m specrt.tools.bench.suffix [ENGINE_DIR] --out docs/bench/suffix.json

(a) "edit loop": for each of 8 standard-library functions, 4 rounds of the same request shape an
    agent sends while editing code: the function's source with a small edit (a local name renamed,
    a different name each round), then the start of the function again for the model to re-emit.
    Later rounds re-emit much of what earlier rounds emitted, which suffix decoding's global cache
    (earlier requests' outputs) can propose and prompt lookup (this prompt only) partly can.
(b) the 8 code prompts of tools/prompts.py.
Greedy, batch 1, the default policy for γ; for every request every method runs in turn (the
order rotating), so the ratios to plain decoding come from the same run; each workload and
repetition starts from a fresh runtime (an empty suffix cache: (b) is never a repeat). Reports tokens/s,
tokens per target pass and the speedup over plain per workload and method.
"""
from __future__ import annotations

import argparse
import inspect
import json
import re
import time

METHODS = ("none", "ngram", "suffix", "draft")
FUNCTIONS = ("textwrap.dedent", "shlex.split", "shutil.copyfileobj", "fnmatch.translate", "string.capwords",
             "base64.b64encode", "json.dumps", "glob.has_magic")


def edit_loop_prompts(rounds: int = 4) -> list[str]:
    """Agent-style requests: the function with an identifier renamed (another name each round), then its def line."""
    import ast
    import builtins
    import importlib
    import keyword

    prompts, reserved = [], set(keyword.kwlist) | set(dir(builtins))
    for dotted in FUNCTIONS:
        module, name = dotted.rsplit(".", 1)
        tree = ast.parse(inspect.getsource(getattr(importlib.import_module(module), name)))
        body = tree.body[0].body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            del body[0]  # the docstring: keep the prompt short
        src = ast.unparse(tree)
        words = [w for w in dict.fromkeys(re.findall(r"\b[a-z_][a-z0-9_]{2,}\b", src))
                 if w != name and w not in reserved][:rounds]
        for r, word in enumerate(words):
            edited = re.sub(rf"\b{word}\b", f"{word}_{r + 1}", src)
            head = edited.split("\n", 1)[0]
            prompts.append(f"# Edit: rename {word} to {word}_{r + 1}.\n{edited}\n\n# After the edit:\n{head}\n")
    return prompts


def run(engine_dir: str, max_new_tokens: int, reps: int, log=print) -> dict:
    import specrt

    from ..prompts import CODE

    workloads = {"edit loop": edit_loop_prompts(), "code prompts": list(CODE)}
    totals = {}  # (workload, method) -> [tokens, seconds, target passes]
    for rep in range(reps):
        for w, prompts in workloads.items():
            rt = specrt.load(engine_dir)  # a fresh suffix cache per workload and repetition
            methods = [m for m in METHODS if m != "draft" or rt.draft is not None]
            for m in methods:
                rt.generate("x = 1\n", max_new_tokens=4, method=m)  # calibration, warm-up
                totals.setdefault((w, m), [0, 0.0, 0])
            for i, prompt in enumerate(prompts):
                order = methods[(i + rep) % len(methods):] + methods[: (i + rep) % len(methods)]
                for m in order:
                    t0 = time.perf_counter()
                    out = rt.generate(prompt, max_new_tokens=max_new_tokens, method=m)
                    t = totals[(w, m)]
                    t[0] += len(out.token_ids)
                    t[1] += time.perf_counter() - t0
                    t[2] += out.stats["target_passes"]
            log(f"rep {rep} done", flush=True)
    rows = {}
    for (w, m), (tokens, seconds, passes) in totals.items():
        rows.setdefault(w, {})[m] = {"tokens_per_s": tokens / seconds, "tokens_per_pass": tokens / passes}
    for w in rows:
        for m in rows[w]:
            rows[w][m]["speedup"] = rows[w][m]["tokens_per_s"] / rows[w]["none"]["tokens_per_s"]
    return rows


def print_table(rows: dict, first: str) -> None:
    """rows: group -> method -> {tokens_per_s, tokens_per_pass, speedup}, as a markdown table."""
    print(f"\n| {first} | method | tokens/s | tokens per pass | speedup over plain |\n|---|---|---|---|---|")
    for w, by_method in rows.items():
        for m, r in by_method.items():
            print(f"| {w} | {m} | {r['tokens_per_s']:.0f} | {r['tokens_per_pass']:.2f} | {r['speedup']:.2f}x |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine_dir", nargs="?", default=None, help="default: the demo pair")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.engine_dir is None:
        from ..demo_engines import demo_engine_dir

        a.engine_dir = str(demo_engine_dir())
    rows = run(a.engine_dir, a.max_new_tokens, a.reps)
    print_table(rows, "workload")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
