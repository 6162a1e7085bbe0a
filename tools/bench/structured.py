"""Structured outputs at batch 1: what a JSON schema or a tool call costs, and what speculation and the
grammar's forced tokens win back.

    python -m specrt.tools.bench.structured ENGINE_DIR [--rounds 3] [--max-tokens 160] [--methods none,ngram,draft]
                                            [--temperature 0] [--limit 16] [--out docs/bench/structured]

Two workloads of 16 short texts each (below): "extract" (a person's record as JSON, a strict schema of 9
fields) and "tool" (one call of three functions, tool_choice "required": the call format `specrt serve`
constrains to for this engine's chat template). Prompts go through the engine's chat template. For each
method (its own decode core, batch 1, prefix cache off) three configurations run:

    free        no constraint (the valid-JSON rate says how often the model gets it right alone)
    json        constrained, the grammar's forced tokens NOT proposed (CoreConfig.forced_tokens False)
    json+forced constrained, forced tokens proposed as a free draft (the default)

Rounds are interleaved (every configuration once per round, the order rotated each round); reported per
configuration: median tokens/s over rounds, the valid rate (json.loads and, with jsonschema installed, the
schema), tokens per target pass, forced tokens per output token, and the grammar's mask time as a share of
the wall time. At temperature 0 every constrained configuration must write the same text (exactness): the
report says whether it did. ``--out STEM`` writes STEM.md and STEM.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ...runtime.constraints import ConstraintSpec
from ...runtime.core import CoreConfig, SequenceRequest
from ...runtime.sampling import SamplingParams
from ...runtime.serve.chat import ChatTemplate
from ...runtime.serve.structured import strict_schema
from ...runtime.serve.tools import ToolCallParser, plan_tools

TEXT = {"type": "string", "maxLength": 40}
PERSON = strict_schema({"type": "object", "required": ["name", "age", "city", "country", "occupation",
                                                       "years_experience", "languages", "is_remote", "email"],
                        "properties": {"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "city": TEXT, "country": TEXT, "occupation": TEXT,
                                       "years_experience": {"type": "integer", "minimum": 0, "maximum": 80},
                                       "languages": {"type": "array", "items": TEXT, "maxItems": 5},
                                       "is_remote": {"type": "boolean"}, "email": {"type": ["string", "null"],
                                                                                   "maxLength": 60}}})
PEOPLE = [
    "Maria Lopez, 34, is a data engineer in Madrid, Spain, with 9 years of experience. She speaks Spanish and "
    "English and works remotely. Email: maria.lopez@example.com.",
    "Kenji Watanabe (52) has run a bakery in Osaka, Japan for 30 years. He speaks Japanese. No email.",
    "Aisha Bello is 27 and works on site as a nurse in Lagos, Nigeria. Five years in the job; she speaks Yoruba, "
    "English and French. aisha.b@example.org",
    "Lars Eriksen, a 41-year-old ship captain from Bergen, Norway, has sailed for 20 years and speaks Norwegian, "
    "English and German. Reach him at lars@example.no.",
    "Priya Raman, 29, software tester in Bangalore, India, remote, 6 years of experience, Tamil, Hindi, English.",
    "Tom O'Brien is a 63-year-old retired teacher in Cork, Ireland; 35 years of teaching, speaks English and Irish.",
    "Chen Wei, 38, architect in Shanghai, China, 14 years in practice, Mandarin and English, chen.wei@example.cn.",
    "Fatima Zahra, 45, a remote translator based in Rabat, Morocco, 20 years, Arabic, French, Spanish, English.",
    "Jonas Weber (23) is an apprentice electrician in Leipzig, Germany, one year in, speaks German.",
    "Sofia Rossi, 31, pastry chef in Turin, Italy, 10 years of experience, Italian and English; sofia@example.it",
    "Diego Fernandez, 56, remote accountant living in Lima, Peru, 30 years, Spanish and Quechua.",
    "Emma Johansson is 36, a veterinarian in Uppsala, Sweden, 11 years, Swedish, English and Finnish.",
    "Ahmed Hassan, 48, taxi driver in Cairo, Egypt for 22 years, Arabic and some English, no email.",
    "Olivia Brown, 26, remote UX designer in Austin, USA, 4 years of experience, English and Spanish.",
    "Nguyen Van An, 33, fisherman in Da Nang, Vietnam, 15 years at sea, Vietnamese, an@example.vn",
    "Isabelle Martin, 59, notary in Lyon, France, 32 years, French, English and Italian.",
]
EXTRACT = "Extract this person's record as JSON (name, age, city, country, occupation, years_experience, " \
          "languages, is_remote, email):\n\n"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": {
        "type": "object", "properties": {"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "book_meeting", "description": "Book a one-hour meeting", "parameters": {
        "type": "object", "properties": {"person": TEXT, "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                                         "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["person", "day", "hour"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_docs", "description": "Search the documentation", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query", "limit"], "additionalProperties": False}}},
]
REQUESTS = [
    "What's the weather in Oslo right now, in celsius?", "Book a meeting with Dana on Tuesday at 10.",
    "Find the docs about rate limits, top 5 results.", "Is it hot in Phoenix? Use fahrenheit.",
    "Schedule an hour with Mr. Okafor on Friday at 15:00.", "Search the docs for 'streaming responses', 3 hits.",
    "Weather in Tokyo please (celsius).", "Set up a meeting with the design team Monday 9am.",
    "Look up how to rotate API keys in the docs; 10 results.", "How cold is it in Montreal? Celsius.",
    "Meet Priya on Wednesday at 14.", "Docs search: batch size limits, limit 2.",
    "What is the weather like in Cape Town, in fahrenheit?", "Book Thursday 11:00 with Lukas.",
    "Search documentation for 'tool calls', give me 8.", "Weather for Reykjavik in celsius.",
]


# ---- one request on one core ---------------------------------------------------------------------------
def generate(core, ids: list[int], params: SamplingParams, grammar, rid: str) -> dict:
    """Run one sequence to its end on a batch-1 core: text, stats, seconds."""
    t0 = time.perf_counter()
    update = core.add(SequenceRequest(rid, ids, params, grammar=grammar))
    while not update.finish_reason:
        update = core.step()[0][0]
    return {"text": update.text, "tokens": len(update.token_ids), "stats": update.stats,
            "seconds": time.perf_counter() - t0}


def validator():
    """schema, text -> valid? (jsonschema when installed, else: it parses)."""
    try:
        import jsonschema
    except ImportError:
        return None

    def valid(schema, value) -> bool:
        return jsonschema.Draft202012Validator(schema).is_valid(value)

    return valid


def judge(workload: dict, text: str, check) -> bool:
    """Whether one output is what the workload asks for: a record that parses (and validates), or one call
    whose arguments do."""
    try:
        if workload["plan"] is None:
            value, schema = json.loads(text), workload["schema"]
        else:
            parser = ToolCallParser(workload["plan"])
            parser.feed(text)
            parser.flush()
            if len(parser.calls) != 1:
                return False
            call = parser.calls[0]["function"]
            tool = next((t for t in TOOLS if t["function"]["name"] == call["name"]), None)
            if tool is None:
                return False
            value, schema = json.loads(call["arguments"]), tool["function"]["parameters"]
    except (ValueError, TypeError, RecursionError):  # not JSON, or not the call layout
        return False
    return check is None or check(schema, value)


# ---- the benchmark ---------------------------------------------------------------------------------------
def workloads(rt, limit: int) -> dict:
    """{"extract": ..., "tool": ...}: prompt ids, the compiled grammar, the schema / tool plan."""
    template = ChatTemplate(rt.manifest.tokenizer_dir)
    plan = plan_tools(TOOLS, "required", parallel=False, tagged=template.writes_tool_calls)
    extract = [rt.encode(template.render([{"role": "user", "content": EXTRACT + text}])) for text in PEOPLE[:limit]]
    tool = [rt.encode(template.render([{"role": "user", "content": r}], tools=TOOLS)) for r in REQUESTS[:limit]]
    compiler = rt.grammar_compiler
    return {"extract": {"prompts": extract, "grammar": compiler.compile(ConstraintSpec("json_schema", PERSON)),
                        "schema": PERSON, "plan": None},
            "tool": {"prompts": tool, "grammar": compiler.compile(plan.constraint), "plan": plan, "layout": plan.layout}}


def configurations(rt, methods: list[str]) -> dict:
    """name -> (core, constrained?): per method free / json / json+forced, each its own batch-1 core over ONE
    target runner (and draft runner): one request at a time, each prefilled afresh (prefix cache off)."""
    runners = {"target": rt.runner("target", 1), **({"draft": rt.runner("draft", 1)} if rt.draft else {})}
    out = {}
    for method in methods:
        for name, constrained, forced in (("free", False, True), ("json", True, False), ("json+forced", True, True)):
            config = CoreConfig(max_batch=1, method=method, forced_tokens=forced, prefix_cache=False)
            out[f"{method} {name}"] = (rt.new_core(config, runners=runners), constrained)
    return out


def run_round(configs: dict, loads: dict, order: list[str], params: SamplingParams, check, totals: dict) -> None:
    for name in order:
        core, constrained = configs[name]
        for wname, w in loads.items():
            row = totals.setdefault(name, {}).setdefault(wname, {
                "tps": [], "valid": 0, "n": 0, "tokens": 0, "passes": 0, "forced": 0, "mask_s": 0.0, "seconds": 0.0,
                "texts": []})
            tokens = seconds = 0.0
            texts = []
            for i, ids in enumerate(w["prompts"]):
                out = generate(core, ids, params, w["grammar"] if constrained else None, f"{name}-{wname}-{i}")
                s = out["stats"]
                tokens, seconds = tokens + out["tokens"], seconds + out["seconds"]
                row["valid"] += judge(w, out["text"], check)
                row["n"] += 1
                row["passes"] += s.get("target_passes", 0)
                row["forced"] += s.get("forced", 0)
                row["mask_s"] += s.get("grammar_mask_seconds", 0.0)
                texts.append(out["text"])
            row["tps"].append(tokens / seconds)
            row["tokens"] += tokens
            row["seconds"] += seconds
            row["texts"] = texts  # the last round's outputs (greedy: the same every round)


def summarize(totals: dict, temperature: float) -> dict:
    rows = {}
    for name, by_load in totals.items():
        for wname, r in by_load.items():
            rows.setdefault(wname, {})[name] = {
                "tokens_per_second": statistics.median(r["tps"]), "rounds": r["tps"],
                "valid_rate": r["valid"] / r["n"], "tokens_per_pass": r["tokens"] / max(r["passes"], 1),
                "forced_per_token": r["forced"] / max(r["tokens"], 1), "mask_share": r["mask_s"] / r["seconds"],
                "tokens": r["tokens"]}
    same = {}
    if temperature == 0:
        for wname in rows:
            texts = [totals[name][wname]["texts"] for name in totals if not name.endswith(" free")]
            same[wname] = all(t == texts[0] for t in texts)
    return {"rows": rows, "constrained_outputs_identical": same}


def markdown(result: dict) -> str:
    lines = [f"# Structured outputs: `{result['engine']}`", "", f"{result['command']}  ", f"{result['time']}, "
             f"temperature {result['temperature']}, {result['prompts']} prompts x {result['rounds']} interleaved rounds, "
             f"max {result['max_tokens']} tokens; tool-call layout: {result['tool_layout']}; validity: "
             f"{'jsonschema' if result['schema_checked'] else 'json.loads only'}.", ""]
    for wname, rows in result["summary"]["rows"].items():
        base = rows.get("none free", next(iter(rows.values())))["tokens_per_second"]
        lines += [f"## {wname}", "", "| configuration | tok/s (median) | vs none free | valid | tokens/pass | "
                  "forced/token | mask share |", "|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            lines.append(f"| {name} | {r['tokens_per_second']:.0f} | {r['tokens_per_second'] / base:.2f}x | "
                         f"{r['valid_rate']:.0%} | {r['tokens_per_pass']:.2f} | {r['forced_per_token']:.2f} | "
                         f"{r['mask_share']:.1%} |")
        same = result["summary"]["constrained_outputs_identical"].get(wname)
        if same is not None:
            lines += ["", f"Constrained outputs identical across methods and forced on/off (greedy): {same}."]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    import sys

    import specrt

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--methods", default=None, help="comma-separated (default: none, ngram and draft if the engine has one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=16, help="texts per workload (at most 16)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    a = ap.parse_args(argv)
    rt = specrt.load(a.engine_dir, **({"threads": a.threads} if a.threads else {}))
    methods = a.methods.split(",") if a.methods else ["none", "ngram"] + (["draft"] if rt.draft else [])
    loads, configs, check = workloads(rt, a.limit), configurations(rt, methods), validator()
    params = SamplingParams(temperature=a.temperature, seed=0, max_new_tokens=a.max_tokens)
    names, totals = list(configs), {}
    for name in names:  # warm-up: one request each (sessions, first masks)
        generate(configs[name][0], loads["extract"]["prompts"][0], params, loads["extract"]["grammar"], f"warm-{name}")
    for r in range(a.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        run_round(configs, loads, order, params, check, totals)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    result = {"command": "python -m specrt.tools.bench.structured " + " ".join(argv), "engine": a.engine_dir.name,
              "time": time.strftime("%F %T"), "temperature": a.temperature, "prompts": a.limit, "rounds": a.rounds,
              "max_tokens": a.max_tokens, "methods": methods, "tool_layout": loads["tool"]["layout"],
              "schema_checked": check is not None, "summary": summarize(totals, a.temperature)}
    text = markdown(result)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".md").write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        print(f"written: {a.out.with_suffix('.md')}, {a.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
