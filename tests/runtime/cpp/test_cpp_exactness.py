"""The C++ sampler's outputs follow the target's distribution (the project's chi-square harness, driven
through the C ABI), on a traced graph (ONNX Runtime's ops) and on a fused one whose attention runs on specrt's
kernel (the graph real models export to), and a build with a deliberately wrong rule fails the same harness."""
import pytest

from specrt.export.hf_checkpoint import load_hf
from specrt.tools.libspecrt import CppEngine, library_path, load_library
from stat_harness import P_MIN, exact_joint, p_values, run_trials

V = 16
TARGET = dict(arch="llama", vocab_size=V, seed=0, scale=10.0, eos_token_id=None)
DRAFT = dict(arch="llama", vocab_size=V, seed=2, hidden=16, layers=1, scale=40.0, eos_token_id=None)  # disagrees often
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
SAMPLING = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)]


@pytest.fixture(scope="module")
def engine(build_engine):
    return build_engine("cpp_exact", TARGET, DRAFT, gamma=3, max_len=32)


@pytest.fixture(scope="module")
def fused_engine(build_engine):
    """head_dim 16: the fused graph (GroupQueryAttention), as `specrt export` writes for Llama checkpoints."""
    return build_engine("cpp_exact_fused", dict(TARGET, hidden=64), DRAFT, gamma=3, max_len=32)


def open_engine(lib, engine, fused_engine, graph: str) -> CppEngine:
    """"traced": the traced graph; "fused": the fused graph with its attention on specrt's kernel."""
    if graph == "traced":
        return CppEngine(lib, engine)
    from specrt.custom_ops import vector_code

    if not vector_code():
        pytest.skip("specrt's attention kernel needs a -march=native build with AVX2 or NEON (custom_ops.vector_code)")
    cpp = CppEngine(lib, fused_engine, attention="specrt")
    assert cpp.attention == "specrt"
    return cpp


@pytest.fixture(scope="module")
def target_model(engine):
    return load_hf(engine.parent / "target")


def ngram_prompt(cpp):
    """The prompt repeats the target's own greedy continuation, so lookups propose likely tokens."""
    base = [3, 1, 4, 1, 5]
    cont = cpp.generate(base, max_new_tokens=4, method="none").token_ids
    return base + cont + base + cont[:2]


@pytest.mark.parametrize("graph", ["traced", "fused"])
@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
@pytest.mark.parametrize("sampling", SAMPLING, ids=str)
def test_cpp_sampling_is_exact(lib, engine, fused_engine, method, sampling, graph):
    cpp = open_engine(lib, engine, fused_engine, graph)
    prompt = PROMPT if method == "draft" else ngram_prompt(cpp)  # suffix: also its own earlier outputs
    counts, totals = run_trials(cpp, prompt, 2500, V, method=method, gamma=2, **sampling)
    model = load_hf((engine if graph == "traced" else fused_engine).parent / "target")
    pv = p_values(counts, exact_joint(model, prompt, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["proposed"] > 1000 and 0 < totals["accepted"] < totals["proposed"]  # speculation ran, both ways


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_wrong_rule_fails_the_harness(cpp_build, engine, target_model, method):
    """libspecrt_wrong_rule recovers a rejected token from p itself instead of the residual: biased."""
    cpp = CppEngine(load_library(library_path(cpp_build, "specrt_wrong_rule")), engine)
    prompt = PROMPT if method == "draft" else ngram_prompt(cpp)
    counts, _ = run_trials(cpp, prompt, 2500, V, method=method, gamma=2, temperature=1.0)
    pv = p_values(counts, exact_joint(target_model, prompt, dict(temperature=1.0), V))
    assert min(pv.values()) < P_MIN, pv


def test_seeded_generations_repeat(lib, engine):
    """At a fixed γ (an adaptive γ follows measured times, so the random stream's use can differ run to run)."""
    cpp = CppEngine(lib, engine)
    runs = [cpp.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=s, method="draft", gamma=2).token_ids
            for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def test_cpp_adaptive_gamma_is_exact(lib, engine, target_model):
    """gamma -1 on an engine dir without defaults.gamma: γ per round from the measured pass times and the
    acceptance so far (the past only), so the output still follows the target's distribution."""
    cpp = CppEngine(lib, engine)
    sampling = dict(temperature=1.0)
    counts, totals = run_trials(cpp, PROMPT, 2500, V, method="draft", gamma=None, **sampling)
    pv = p_values(counts, exact_joint(target_model, PROMPT, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["proposed"] > 100  # rounds at γ >= 1 ran (chosen, or the policy's probes)
