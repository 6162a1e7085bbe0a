"""The report of `specrt bench peers --serve`: best vs best per row, the issue's goals MET / NOT MET, markdown.

A record is one measured batch: {"system": "specrt" | "llama.cpp", "precision": "int4" (the pair: llama.cpp
ran its Q4_0), "method", "task", "round" (1 = first), "repeat" (0.., each on prompts of its own; absent: 0),
"clients", "tokens_per_s", ...}. A row is one (precision, task, round, clients): each system's plain tokens/s
and its best over methods (medians over the repeats), the ratios, and per specrt method the median over repeats
of its tokens/s over specrt plain's in the same repeat (``specrt_vs_plain``: the policy's goal).

    rows = summary(records); goals(rows)  # -> [{"goal", "status": "MET" | "NOT MET" | "NOT MEASURED", ...}]
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

PLAIN = {"specrt": "none", "llama.cpp": "none"}


@dataclass(frozen=True)
class Goal:
    text: str
    column: str  # "plain": plain vs plain; "best": best vs best
    at_least: float  # the ratio specrt / llama.cpp must reach in every row the goal covers
    rounds: tuple | None  # rounds covered (None: all)
    clients: tuple | None  # client counts covered (None: all)


# issue #29's goals for the serving comparison
GOALS = (Goal("specrt plain >= 1.0x llama.cpp plain at 1 and 4 clients (every round)", "plain", 1.0, None, (1, 4)),
         Goal("specrt best >= 1.5x llama.cpp best at 1 client, first round", "best", 1.5, (1,), (1,)),
         Goal("specrt best >= 1.25x llama.cpp best at 4 clients, first round", "best", 1.25, (1,), (4,)),
         Goal("repeated round: specrt best >= llama.cpp best (every client count)", "best", 1.0, (2,), None))


POLICY_GOAL = "no specrt method below specrt plain under the policy (every row; median over repeats)"


def same_as_plain(records: list[dict]) -> None:
    """Set each record's ``same_as_plain``: the share of its requests whose text equals its system's plain run's
    (same precision, task, round, repeat, clients); None for the plain runs themselves."""
    def run_of(r: dict) -> tuple:  # the batch a record measured: same system, weights, prompts and clients
        return r["system"], r["precision"], r["task"], r["round"], r.get("repeat", 0), r["clients"]

    plain = {run_of(r): r["texts"] for r in records if r["method"] == PLAIN[r["system"]] and r.get("texts")}
    for r in records:
        ref = plain.get(run_of(r))
        mine = r.get("texts")
        r["same_as_plain"] = (None if r["method"] == PLAIN[r["system"]] or not ref or not mine else
                              sum(a == b for a, b in zip(mine, ref)) / len(ref))


def summary(records: list[dict]) -> list[dict]:
    """One row per (precision, task, round, clients): plain and best of each system, and the ratios."""
    cells = {}  # (precision, task, round, clients) -> system -> method -> repeat -> tokens/s
    for r in records:
        if r.get("tokens_per_s") is None:
            continue
        key = (r["precision"], r["task"], r["round"], r["clients"])
        cells.setdefault(key, {}).setdefault(r["system"], {}).setdefault(r["method"], {})[r.get("repeat", 0)] = \
            r["tokens_per_s"]
    rows = []
    for (precision, task, rnd, clients), systems in sorted(cells.items()):
        row = {"precision": precision, "task": task, "round": rnd, "clients": clients}
        for system, short in (("specrt", "specrt"), ("llama.cpp", "llama")):
            runs = {m: statistics.median(by_repeat.values()) for m, by_repeat in systems.get(system, {}).items()
                    if not comparison(m)}
            best = max(runs, key=runs.get) if runs else None
            row.update({f"{short}_plain": runs.get(PLAIN[system]), f"{short}_best": runs.get(best),
                        f"{short}_best_method": best})
        plain = systems.get("specrt", {}).get(PLAIN["specrt"], {})
        row["specrt_vs_plain"] = {m: statistics.median(tps / plain[k] for k, tps in by_repeat.items() if k in plain)
                                  for m, by_repeat in systems.get("specrt", {}).items()
                                  if m != PLAIN["specrt"] and not comparison(m) and set(by_repeat) & set(plain)}
        for col in ("plain", "best"):
            s, l_ = row[f"specrt_{col}"], row[f"llama_{col}"]
            row[f"{col}_ratio"] = s / l_ if s and l_ else None
        rows.append(row)
    return rows


def comparison(method: str) -> bool:
    """Whether a specrt "method" is a --compare-attention / --compare-matmul unit ("none (ort matmul)"): plain
    decoding in another configuration, shown in the runs but neither a method nor a best."""
    return method.startswith("none (")


def goals(rows: list[dict]) -> list[dict]:
    """Each goal, per precision: MET when every row it covers reaches the ratio; NOT MEASURED without such rows."""
    out = []
    for precision in sorted({r["precision"] for r in rows}):
        for g in GOALS:
            cover = [r for r in rows if r["precision"] == precision and r[f"{g.column}_ratio"] is not None
                     and (g.rounds is None or r["round"] in g.rounds)
                     and (g.clients is None or r["clients"] in g.clients)]
            short = [f"{r['task']} r{r['round']} c{r['clients']}: {r[f'{g.column}_ratio']:.2f}x" for r in cover
                     if r[f"{g.column}_ratio"] < g.at_least]
            status = "NOT MEASURED" if not cover else ("NOT MET" if short else "MET")
            out.append({"precision": precision, "goal": g.text, "status": status, "rows": len(cover), "short": short,
                        "ratios": [round(r[f"{g.column}_ratio"], 3) for r in cover]})
        cover = [r for r in rows if r["precision"] == precision and r.get("specrt_vs_plain")]
        short = [f"{r['task']} r{r['round']} c{r['clients']} {m}: {v:.2f}x" for r in cover
                 for m, v in r["specrt_vs_plain"].items() if v < 1.0]
        out.append({"precision": precision, "goal": POLICY_GOAL, "rows": len(cover), "short": short,
                    "status": "NOT MEASURED" if not cover else ("NOT MET" if short else "MET"),
                    "ratios": [round(v, 3) for r in cover for v in r["specrt_vs_plain"].values()]})
    return out


def markdown(res: dict) -> str:
    """The results as markdown: the rows (best vs best), every run, the goals, what was missing."""
    f = _number
    lines = ["| weights | task | round | clients | specrt plain | specrt best | llama.cpp plain | llama.cpp best "
             "| plain vs plain | best vs best |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['precision']} | {r['task']} | {r['round']} | {r['clients']} | {f(r['specrt_plain'])} | "
                     f"{_best(r, 'specrt')} | {f(r['llama_plain'])} | {_best(r, 'llama')} | "
                     f"{f(r['plain_ratio'], '.2f')}x | {f(r['best_ratio'], '.2f')}x |")
    lines += ["", "| weights | task | round | clients | specrt method vs specrt plain |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        if r.get("specrt_vs_plain"):
            ratios = ", ".join(f"{m} {v:.2f}x" for m, v in r["specrt_vs_plain"].items())
            lines.append(f"| {r['precision']} | {r['task']} | {r['round']} | {r['clients']} | {ratios} |")
    lines += ["", "| task | round | repeat | clients | system | weights | method | tok/s | tokens | wall s | = plain |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        same = r.get("same_as_plain")
        lines.append(f"| {r['task']} | {r['round']} | {r.get('repeat', 0)} | {r['clients']} | {r['system']} "
                     f"| {r['weights']} | {r['method']} "
                     f"| {f(r.get('tokens_per_s'), '.1f')} | {r.get('tokens', '-')} | {f(r.get('wall_s'), '.2f')} | "
                     f"{'-' if same is None else f'{same:.0%}'} |" + (f" {r['error']}" if r.get("error") else ""))
    lines += ["", "Goals (issue #29):", ""]
    for g in res["goals"]:
        detail = f" (short: {'; '.join(g['short'])})" if g["short"] else ""
        lines.append(f"- **{g['status']}** [{g['precision']}] {g['goal']}{detail}")
    for name, why in res["missing"].items():
        lines.append(f"- missing: {name}: {why}")
    return "\n".join(lines) + "\n"


def _number(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _best(row: dict, system: str) -> str:
    """"180 (ngram)": a system's best tok/s in a row and the method that reached it."""
    return "-" if row[f"{system}_best"] is None else f"{row[f'{system}_best']:.0f} ({row[f'{system}_best_method']})"
