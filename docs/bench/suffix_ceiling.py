"""How many tokens per target pass suffix decoding and n-gram lookup can reach on the suffix benchmark.

    python docs/bench/suffix_ceiling.py [--max-new-tokens 96 256] [--out docs/bench/suffix-ceiling.json]

Greedy output does not depend on the method, so one plain greedy run per request gives every
round's outcome: at each round the proposer (the runtime's own functions: ``suffix.propose`` over
the request's ``SuffixIndex`` and the global ``SuffixCache``, and ``ngram.find_continuation``) sees
prompt + output so far and proposes up to k tokens; the round accepts the longest prefix that
equals the plain output and emits one more. No γ policy (every round drafts k), no timing: the
tokens per pass each proposer reaches at a fixed k, on the edit loop and the code prompts of
``specrt.tools.bench.suffix``, requests in order (the global cache filled by the earlier ones).

"tree": SuffixDecoding's tree variant, for comparison: up to k nodes expanded best-first by path
probability (the product of count shares, each node's continuations from the longest matched
context), accepted along the path that equals the plain output (the exact tree walk's greedy case).
"""
from __future__ import annotations

import argparse
import heapq
import json

DEPTH, CACHE_TOKENS = 24, 1 << 16  # SuffixProposer's defaults


def longest(local, shared, ctx):
    n, counts = local.longest(ctx)
    m, shared_counts = shared.longest(ctx)
    return (m, shared_counts) if m > n else (n, counts)


def propose_tree(local, shared, context, k: int, factor: float, min_prob: float) -> list[tuple]:
    """Up to k root paths (token tuples), best-first by path probability."""
    ctx = list(context[-DEPTH:])
    n, counts = longest(local, shared, ctx)
    if not n:
        return []
    max_depth, frontier, nodes, tie = min(k, max(1, int(factor * n))), [], [], 0

    def push(prob, path, ctx, counts):
        nonlocal tie
        total = sum(counts.values())
        for tok, c in counts.items():
            if prob * c / total >= min_prob and len(path) < max_depth:
                tie += 1
                heapq.heappush(frontier, (-prob * c / total, tie, path + (tok,), ctx))

    push(1.0, (), ctx, counts)
    while frontier and len(nodes) < k:
        neg, _, path, ctx = heapq.heappop(frontier)
        nodes.append(path)
        ctx = (ctx + [path[-1]])[-DEPTH:]
        n, counts = longest(local, shared, ctx)
        if n:
            push(-neg, path, ctx, counts)
    return nodes


def accepted(paths: list[tuple], future: list[int]) -> int:
    """Tokens of ``future`` the proposal covers from its start (paths: every proposed root path)."""
    have, a = set(paths), 0
    while a < len(future) and tuple(future[: a + 1]) in have:
        a += 1
    return a


def tokens_per_pass(requests, kind: str, k: int, factor: float = 1.0, min_prob: float = 0.1) -> float:
    from specrt.runtime.proposers.ngram import find_continuation
    from specrt.runtime.proposers.suffix import SuffixCache, SuffixIndex, propose

    cache, emitted, passes = SuffixCache(DEPTH, CACHE_TOKENS), 0, 0
    for prompt, out in requests:
        local, seq, t, indexed = SuffixIndex(DEPTH), list(prompt) + out[:1], 1, 0  # out[0]: from prefill
        while t < len(out):
            local.add(seq, indexed, len(seq))
            indexed, room = len(seq), min(k, len(out) - t)
            if kind == "suffix tree":
                paths = propose_tree(local, cache.index, seq, room, factor, min_prob)
            else:
                chain = (find_continuation(seq, room) if kind == "ngram"
                         else propose(local, [cache.index], seq, room, factor, min_prob))
                paths = [tuple(chain[: i + 1]) for i in range(len(chain))]
            step = min(accepted(paths, out[t:]) + 1, len(out) - t)
            seq += out[t : t + step]
            t += step
            passes += 1
        emitted += len(out) - 1
        cache.add(seq)
    return emitted / passes


def main(argv=None) -> None:
    import specrt
    from specrt.tools.bench.suffix import edit_loop_prompts
    from specrt.tools.demo_engines import demo_engine_dir
    from specrt.tools.prompts import CODE

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[96, 256])
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rt = specrt.load(str(demo_engine_dir()))
    variants = [("ngram", 1.0), ("suffix", 1.0), ("suffix", 2.0), ("suffix tree", 1.0), ("suffix tree", 2.0)]
    rows = []
    print("| workload | new tokens | k | " + " | ".join(f"{v} (factor {f:g})" if v != "ngram" else v for v, f in variants)
          + " |\n|---|---|---|" + "---|" * len(variants))
    for new in a.max_new_tokens:
        for name, prompts in (("edit loop", edit_loop_prompts()), ("code prompts", list(CODE))):
            requests = [(ids, rt.generate(ids, max_new_tokens=new, method="none").token_ids)
                        for ids in map(rt.encode, prompts)]
            for k in a.ks:
                row = {"workload": name, "max_new_tokens": new, "k": k,
                       **{f"{v} {f:g}": tokens_per_pass(requests, v, k, f) for v, f in variants}}
                rows.append(row)
                print(f"| {name} | {new} | {k} | " + " | ".join(f"{row[f'{v} {f:g}']:.2f}" for v, f in variants) + " |",
                      flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
