"""One decode core serving several methods: each request picks its own (``SequenceRequest.method``), rows of
different methods (chains and trees) share ONE target pass per step, and each row equals its batch-1 output."""
from types import SimpleNamespace

import pytest

import specrt
from reference import run_all
from specrt.export.onnx_export import ExportConfig, export_engine
from specrt.runtime.api import Runtime
from specrt.runtime.constraints import ConstraintSpec
from specrt.runtime.core import CoreConfig, SequenceRequest
from specrt.runtime.methods import cache_owner, parse_methods, resolve_method
from specrt.runtime.sampling import SamplingError, SamplingParams
from specrt.trees import compile_tree
from tiny import HEADS_TARGET, MEDUSA_TREE, make_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [5], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
SPEC = ConstraintSpec("regex", "([a-d][e-h]|[e-h][a-d])*")


@pytest.fixture(scope="module")
def draft_medusa(medusa_trained, tmp_path_factory):
    """The Medusa test target with its heads AND a draft model: methods none, draft, ngram, suffix, medusa."""
    root = tmp_path_factory.mktemp("draft_medusa")
    draft = make_model(root / "draft", **dict(HEADS_TARGET, seed=1, hidden=16, layers=1))
    return specrt.load(export_engine(medusa_trained["target"], root / "engine", draft_dir=draft, log=lambda *_: None,
                                     cfg=ExportConfig(gamma=3, max_len=32, prefill_chunk=16),
                                     medusa_dir=medusa_trained["heads"], tree=compile_tree(MEDUSA_TREE, "test-12")))


def counting_passes(core) -> list:
    """Wrap the core's target runner: the returned list gets one entry per decode pass (prefills aside)."""
    calls, forward = [], core.target.forward

    def counted(*args, **kwargs):
        if kwargs.get("record", True):
            calls.append(len(args[0]))
        return forward(*args, **kwargs)

    core.target.forward = counted
    return calls


def mixed_requests(methods, sampled_methods, grammar=None):
    """Per method a greedy row and (for ``sampled_methods``) a seeded sampled row at a fixed γ, prompts varied."""
    out = []
    for i, method in enumerate(methods):
        gamma = 1 if method in ("medusa", "eagle") else 3
        out.append(SequenceRequest(f"{method}-greedy", PROMPTS[i % 3], SamplingParams(max_new_tokens=9 + i),
                                   method=method))
        if method in sampled_methods:
            out.append(SequenceRequest(f"{method}-sampled", PROMPTS[(i + 1) % 3],
                                       SamplingParams(max_new_tokens=8, temperature=1.0, top_k=6, seed=40 + i),
                                       method=method, gamma=gamma, grammar=grammar))
    return out


def reference(rt, request, constraint=None):
    p = request.params
    return rt.generate(request.prompt_ids, max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_k=p.top_k,
                       seed=p.seed, method=request.method, gamma=request.gamma, constraint=constraint).token_ids


@pytest.mark.parametrize("engine,served,constrained", [
    ("draft_medusa", "medusa,draft,ngram,suffix", False), ("draft_medusa", "draft,ngram,medusa", True),
    ("eagle_engine", "eagle,ngram", False)], ids=str)
def test_mixed_rows_equal_their_batch1_output(request, engine, served, constrained):
    """Greedy rows equal batch-1 greedy; seeded sampled rows at a fixed γ equal their batch-1 output (suffix's
    sampled rows aside: its global cache holds other sequences in the two runs). One target pass per step."""
    rt = request.getfixturevalue(engine)
    rt = rt if isinstance(rt, Runtime) else specrt.load(rt)
    methods = ["none", *parse_methods(served)]
    grammar = rt.grammar_compiler.compile(SPEC) if constrained else None
    requests = mixed_requests(methods, [m for m in methods if m != "suffix"], grammar)
    core = rt.new_core(CoreConfig(max_batch=len(requests), method=served, calibrate=False))
    passes, reports, step = counting_passes(core), [], core.step

    def counted_step():
        updates, report = step()
        reports.extend([report] if report is not None else [])
        return updates, report

    core.step = counted_step
    done = run_all(core, requests)
    assert len(passes) == len(reports) and passes[0] == len(requests)  # ONE target pass per step, all rows in it
    for r in requests:
        want = reference(rt, r, SPEC if r.grammar is not None else None)
        assert done[r.request_id][0] == want, r.request_id
        assert done[r.request_id][3]["method"] == r.method
    assert not core.rows


def test_one_pass_per_step_over_chains_and_trees(draft_medusa):
    rt = draft_medusa
    core = rt.new_core(CoreConfig(max_batch=4, method="medusa,draft,ngram", gamma=3, calibrate=False))
    passes = counting_passes(core)
    for i, method in enumerate(["medusa", "draft", "ngram", "none"]):
        core.add(SequenceRequest(f"r{i}", PROMPTS[0], SamplingParams(max_new_tokens=6), method=method))
    updates, report = core.step()
    assert len(passes) == 1 and passes[0] == 4 and report.batch_size == 4
    assert set(report.decisions) == {"medusa", "draft", "ngram", "none"} and report.decisions["none"].gamma == 0


def test_methods_are_checked(draft_medusa, eagle_engine):
    rt = draft_medusa
    core = rt.new_core(CoreConfig(max_batch=2, method="draft,ngram", calibrate=False))
    assert list(core.proposers) == ["draft", "ngram", "none"] and core.proposer is core.proposers["draft"]
    with pytest.raises(SamplingError, match="method 'medusa' is not served here; available: draft, ngram, none"):
        core.add(SequenceRequest("x", [1, 2], SamplingParams(), method="medusa"))
    assert not core.rows
    with pytest.raises(SamplingError, match="unknown method 'beam'"):
        rt.new_core(CoreConfig(method="draft,beam"))
    with pytest.raises(SamplingError, match="needs an engine dir exported with --eagle"):
        rt.new_core(CoreConfig(method="draft,eagle"))
    assert parse_methods(("ngram", "draft", "ngram")) == ("ngram", "draft")
    assert resolve_method(rt.manifest, " draft , ngram ") == "draft,ngram"
    assert resolve_method(specrt.load(eagle_engine).manifest, None) == "eagle"
    two = {"draft": SimpleNamespace(runner=object()), "eagle": SimpleNamespace(runner=object())}
    with pytest.raises(SamplingError, match="draft and eagle each keep a model cache"):
        cache_owner(two, None)
