"""`specrt bench peers --serve` without servers: its options, the plan with a missing llama-server listed with the
recipe that builds it, the interleaved order, and the report (best vs best, goals MET / NOT MET)."""
import sys
from pathlib import Path

import pytest

from specrt.tools.bench import peers, serve_peers
from specrt.tools.bench.serve_peers_report import goals, markdown, same_as_plain, summary


@pytest.mark.parametrize("argv, message", [
    (["--clients", "0"], "positive integer"), (["--rounds", "x"], "positive integer"),
    (["--engine", "int4"], "PRECISION=DIR"), (["--engine", "int3=/x"], "precision must be one of"),
    (["--precisions", "int3"], "invalid choice"), (["--draft-gguf", "/no/such.gguf"], "no such file"),
    (["--suffix-corpus", "/no/such.jsonl"], "no such file")])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        serve_peers.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_smoke_is_one_round_one_client_two_short_prompts():
    a = serve_peers.parse_args(["--smoke", "--engine", "int4=/e"])
    assert (a.rounds, a.clients, a.prompts, a.max_tokens, a.engine) == (1, [1], 2, 16, {"int4": "/e"})


def test_a_suffix_corpus_adds_a_specrt_unit_serving_suffix_with_it(tmp_path):
    corpus = tmp_path / "train.jsonl"
    corpus.write_text('{"text": "def f(): pass"}\n')
    a = serve_peers.parse_args(["--suffix-corpus", str(corpus)])
    assert a.specrt_methods == ["none", "ngram", "suffix", "suffix+corpus"]
    unit = serve_peers.Unit("specrt", "int4", "suffix+corpus", "int4", tmp_path)
    argv = serve_peers.server_argv(a, unit, 8000, 4, 8192)
    assert argv[argv.index("--method") + 1] == "suffix" and argv[argv.index("--suffix-corpus") + 1] == str(corpus)
    plain = serve_peers.server_argv(a, serve_peers.Unit("specrt", "int4", "suffix", "int4", tmp_path), 8000, 4, 8192)
    assert "--suffix-corpus" not in plain


def test_attention_reaches_every_specrt_server(tmp_path):
    unit = serve_peers.Unit("specrt", "int4", "none", "int4", tmp_path)
    for given, expected in (([], "auto"), (["--attention", "specrt"], "specrt"), (["--attention", "ort"], "ort")):
        argv = serve_peers.server_argv(serve_peers.parse_args(given), unit, 8000, 1, 8192)
        assert argv[argv.index("--attention") + 1] == expected
    other = serve_peers.Unit("specrt", "int4", "none", "int4", tmp_path, "ort")  # a --compare-attention unit
    argv = serve_peers.server_argv(serve_peers.parse_args(["--attention", "specrt"]), other, 8000, 1, 8192)
    assert argv[argv.index("--attention") + 1] == "ort" and argv[argv.index("--method") + 1] == "none"
    assert other.run_method == "none (ort attention)" and other.label == "specrt int4 none (ort attention)"


def test_a_compare_matmul_unit_runs_its_server_with_that_matmul(tmp_path):
    a = serve_peers.parse_args(["--compare-matmul", "ort"])
    assert a.compare_matmul == "ort"
    unit = serve_peers.Unit("specrt", "int4", "none", "int4", tmp_path, matmul="ort")
    assert unit.run_method == "none (ort matmul)"
    server = serve_peers.Server(unit, [sys.executable, "-c", "import os; print(os.environ['SPECRT_MATMUL'])"], 8000,
                                tmp_path)
    server.proc.wait(timeout=60)
    assert server.proc.returncode == 0  # the variable reached it (a KeyError otherwise)


def test_a_comparison_unit_is_neither_a_method_nor_the_best():
    records = [record("specrt", "none", 100), record("specrt", "none (ort matmul)", 70),
               record("specrt", "none (ort attention)", 120), record("llama.cpp", "none", 90)]
    row = summary(records)[0]
    assert row["specrt_best_method"] == "none" and row["specrt_vs_plain"] == {}


def test_missing_llama_server_is_listed_with_how_to_build_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path))
    peers.main(["--serve", "--plan", "--llama-server", str(tmp_path / "llama-server")])  # via `specrt bench peers`
    out = capsys.readouterr().out
    assert f"missing: llama.cpp: llama-server not found at {tmp_path / 'llama-server'}" in out
    for step in ("pip download --no-binary :all: --no-deps llama-cpp-python", "-DGGML_NATIVE=OFF",
                 "--target llama-server llama-quantize"):
        assert step in out
    assert "would run: specrt int4 none, specrt int4 ngram, specrt int4 suffix" in out  # specrt still runs


def test_interleaving_every_unit_once_per_step_in_rotating_order():
    units, tasks = ["a", "b", "c"], ["completion", "chat"]
    kept = serve_peers.jobs(units, 2, tasks, 0, keep=True)
    steps = [kept[i:i + 3] for i in range(0, len(kept), 3)]
    assert [[u for u, *_ in s] for s in steps] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert [s[0][1:] for s in steps] == [(0, 1, "completion"), (0, 1, "chat"), (0, 2, "completion"), (0, 2, "chat")]
    restarted = serve_peers.jobs(units, 2, tasks, 1, keep=False)  # one server at a time: its rounds back to back
    assert [u for u, *_ in restarted] == ["b"] * 4 + ["c"] * 4 + ["a"] * 4
    assert [(r, t) for u, _, r, t in restarted[:4]] == [(1, "completion"), (1, "chat"), (2, "completion"), (2, "chat")]
    repeated = serve_peers.jobs(units, 2, tasks, 0, keep=True, repeats=2)  # repeat 1: its own rounds, rotation going on
    assert len(repeated) == 24 and [j[1:] for j in repeated[12::3]] == [(1, 1, "completion"), (1, 1, "chat"),
                                                                       (1, 2, "completion"), (1, 2, "chat")]
    assert [u for u, *_ in repeated[12:15]] == ["b", "c", "a"]


def record(system, method, tps, rnd=1, clients=1, texts=("x",), repeat=0):
    return {"system": system, "precision": "int4", "weights": "int4" if system == "specrt" else "Q4_0",
            "method": method, "task": "chat", "round": rnd, "repeat": repeat, "clients": clients, "tokens_per_s": tps,
            "tokens": 10, "wall_s": 1.0, "texts": list(texts)}


def test_repeats_report_medians_and_each_method_against_plain_in_its_own_repeat():
    from specrt.tools.bench.serve_peers_report import POLICY_GOAL

    records = [record("specrt", "none", tps, repeat=k) for k, tps in enumerate((100, 80, 90))]
    records += [record("specrt", "ngram", tps, repeat=k) for k, tps in enumerate((105, 76, 99))]  # 1.05, 0.95, 1.1
    records += [record("llama.cpp", "none", 90, repeat=k) for k in range(3)]
    same_as_plain(records)
    assert all(r["same_as_plain"] == 1.0 for r in records if r["method"] == "ngram")  # plain of its own repeat
    row = summary(records)[0]
    assert row["specrt_plain"] == 90 and row["specrt_best"] == 99 and row["specrt_best_method"] == "ngram"
    assert row["specrt_vs_plain"] == {"ngram": pytest.approx(1.05)}  # paired ratios' median, not 99 / 90
    policy = next(g for g in goals([row]) if g["goal"] == POLICY_GOAL)
    assert policy["status"] == "MET"
    records.append(record("specrt", "suffix", 85, repeat=0))
    policy = next(g for g in goals(summary(records)) if g["goal"] == POLICY_GOAL)
    assert policy["status"] == "NOT MET" and policy["short"] == ["chat r1 c1 suffix: 0.85x"]
    assert "| int4 | chat | 1 | 1 | ngram 1.05x, suffix 0.85x |" in markdown(
        {"rows": summary(records), "goals": [], "missing": {}, "runs": []})


def test_report_best_vs_best_and_goals():
    records = [record("specrt", "none", 100), record("specrt", "ngram", 180, texts=("y",)),
               record("llama.cpp", "none", 90), record("llama.cpp", "ngram-mod", 110),
               record("specrt", "none", 100, clients=4), record("llama.cpp", "none", 120, clients=4)]
    same_as_plain(records)
    assert [r["same_as_plain"] for r in records[:4]] == [None, 0.0, None, 1.0]
    rows = summary(records)
    row = next(r for r in rows if r["clients"] == 1)
    assert (row["specrt_best_method"], row["llama_best_method"]) == ("ngram", "ngram-mod")
    assert row["best_ratio"] == pytest.approx(180 / 110) and row["plain_ratio"] == pytest.approx(100 / 90)
    status = {g["goal"]: g for g in goals(rows)}
    plain_goal = status["specrt plain >= 1.0x llama.cpp plain at 1 and 4 clients (every round)"]
    assert plain_goal["status"] == "NOT MET" and plain_goal["short"] == ["chat r1 c4: 0.83x"]
    assert status["specrt best >= 1.5x llama.cpp best at 1 client, first round"]["status"] == "MET"
    assert status["repeated round: specrt best >= llama.cpp best (every client count)"]["status"] == "NOT MEASURED"
    text = markdown({"rows": rows, "goals": goals(rows), "missing": {"llama.cpp int8": "why"},
                     "runs": [{k: v for k, v in r.items() if k != "texts"} for r in records]})
    assert "| int4 | chat | 1 | 1 | 100 | 180 (ngram) | 90 | 110 (ngram-mod) | 1.11x | 1.64x |" in text
    assert "**NOT MET** [int4] specrt plain" in text and "missing: llama.cpp int8: why" in text


def test_the_llama_cpp_recipe_builds_the_cpu_s_extensions_but_amx():
    from specrt.tools.bench.llama_server import cpu_cmake_options

    cpuinfo = "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_int8 amx_tile\n"
    options = cpu_cmake_options(cpuinfo)
    assert options[0] == "-DGGML_NATIVE=OFF" and "-DGGML_AVX512_VNNI=ON" in options and "-DGGML_AVX2=ON" in options
    assert not any("AMX" in o or "VBMI" in o for o in options)
    assert cpu_cmake_options("") == ["-DGGML_NATIVE=OFF"]


def test_a_run_records_the_llama_cpp_build_s_x86_options(tmp_path):
    from specrt.tools.bench.llama_server import build_options

    (tmp_path / "bin").mkdir()
    (tmp_path / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=OFF\nGGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL=OFF\n"
                                             "GGML_CUDA:BOOL=ON\nGGML_AVX512_VNNI:BOOL=ON\nCMAKE_BUILD_TYPE:STRING=Release\n")
    assert build_options(tmp_path / "bin" / "llama-server") == ["GGML_AVX2=ON", "GGML_AVX512_VNNI=ON", "GGML_NATIVE=OFF"]
    assert build_options(tmp_path / "a" / "b" / "llama-server") == []  # no CMakeCache.txt beside it or above


def test_server_memory_counts_weights_per_session_and_the_cache_per_client(llama_fused_engine, tmp_path):
    from specrt.engines.manifest import load_manifest
    from specrt.tools.bench.serve_peers import Unit, server_memory

    unit = Unit("specrt", "fp32", "none", "fp32", Path(llama_fused_engine))
    m = load_manifest(llama_fused_engine)
    g = m.target.geometry
    per_slot = 2 * g.num_layers * g.num_kv_heads * g.head_dim * (m.max_len + 1) * 4
    assert server_memory(unit, 16) - server_memory(unit, 1) == 15 * per_slot
    weights = sum(f.stat().st_size for f in Path(llama_fused_engine).glob("*.data"))
    assert server_memory(unit, 1) == 3 * weights + per_slot + (6 << 27)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    assert server_memory(Unit("llama.cpp", "fp32", "none", "F32", gguf), 16) == 1000 + (1 << 28)
