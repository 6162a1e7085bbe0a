"""EAGLE: head module + ONNX parity, training, dynamic tree building, exact tree-speculative decoding."""
import itertools
from types import SimpleNamespace
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import specrt
from specrt.engines import EngineError
from specrt.export.eagle_head import (EagleConfig, EagleHead, causal_mask, export_head_graph, load_head,
                                      parity_cases, INPUTS)
from specrt.export.onnx_export import ExportConfig, ExportError, export_engine
from specrt.runtime.proposers.eagle import dynamic_tree, log_softmax
from specrt.trees import compile_tree
from specrt.tools.cli import cli
from specrt.tools.train.eagle import EagleTrainConfig, train
from stat_harness import P_MIN, exact_joint, p_values, run_trials, run_trials_batched
from tiny import EAGLE_TREE as TREE
from tiny import make_model
from reference import assert_batched_rows_equal_batch1, assert_head_cache_matches_fresh, fresh_runner

V = 16
TRIALS = 2500
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PROMPTS = [[5], PROMPT, [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
LONG = [(3 * i) % (V - 1) + 1 for i in range(21)]  # 21 tokens: two prefill chunks of 16


@pytest.fixture(scope="module")
def trained(eagle_trained):
    return eagle_trained


@pytest.fixture(scope="module")
def engine(eagle_engine):
    return eagle_engine


# ---- head module and graph -------------------------------------------------------------------------
def random_head(model, seed=0):
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(model)).attach_target(model).eval()
    with torch.no_grad():  # not an identity-like init: make every weight matter
        for p in head.layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return head


def test_head_graph_matches_torch(trained, target_model, tmp_path):
    head = random_head(target_model)
    section = export_head_graph(head, tmp_path / "eagle.onnx", "fp32")
    assert section["parity_max_abs_diff"] < 1e-3
    from specrt.engines.ort import OrtEngine

    ort = OrtEngine(tmp_path / "eagle.onnx")
    for feeds in parity_cases(head.cfg, torch.float32, seed=7):  # fresh inputs, not those checked at export
        with torch.no_grad():
            ref = head(*(feeds[n] for n in INPUTS))
        got = ort.run({n: feeds[n].numpy() for n in INPUTS})
        for name, r in zip(("logits", "new_key.0", "new_value.0", "next_hidden"), ref):
            assert np.abs(got[name] - r.numpy()).max() < 1e-3, name
        # logits are the target's frozen LM head applied to the predicted feature
        lm = target_model.get_output_embeddings()
        with torch.no_grad():
            assert np.allclose(got["logits"], lm(torch.from_numpy(got["next_hidden"])).numpy(), atol=1e-4)


def test_head_cache_steps_equal_one_full_pass(target_model):
    """Feeding rows one at a time through the time-major past equals one causal pass over all rows."""
    head = random_head(target_model, seed=1)
    g = torch.Generator().manual_seed(0)
    ids, feats = torch.randint(0, V, (1, 6), generator=g), torch.randn(1, 6, head.cfg.hidden_size, generator=g)
    with torch.no_grad():
        full_logits, fk, fv, full_feat = head(ids, feats, torch.arange(6)[None], causal_mask(0, 6), head.empty_past(),
                                              head.empty_past())
        pk, pv = head.empty_past(), head.empty_past()
        for t in range(6):
            lo, nk, nv, f = head(ids[:, t : t + 1], feats[:, t : t + 1], torch.tensor([[t]]), causal_mask(t, 1), pk, pv)
            pk, pv = torch.cat([pk, nk]), torch.cat([pv, nv])
            assert torch.allclose(lo[0, 0], full_logits[0, t], atol=1e-4)
            assert torch.allclose(f[0, 0], full_feat[0, t], atol=1e-4, rtol=1e-4)
    assert torch.allclose(pk, fk, atol=1e-4) and torch.allclose(pv, fv, atol=1e-4)


# ---- training --------------------------------------------------------------------------------------
def test_training_loss_falls_and_top1_beats_chance(trained):
    r = trained["result"]
    losses = [h["loss"] for h in r["history"]]
    assert np.mean(losses[-10:]) < 0.85 * np.mean(losses[:3])
    acc = r["accuracy"]
    assert acc["top1"] > 3 / V and acc["top5"] >= acc["top1"]  # chance is 1/V
    cfg = json.loads((trained["head"] / "config.json").read_text())
    assert cfg["format"] == "specrt-eagle-head" and cfg["accuracy"] == acc


def test_saved_head_reloads_with_the_targets_frozen_weights(trained, target_model):
    head, _ = load_head(trained["head"], target_model)
    assert torch.equal(head.lm_head.weight, target_model.get_output_embeddings().weight)
    assert torch.equal(head.embed.weight, target_model.get_input_embeddings().weight)
    trained_head = trained["result"]["head"]
    for k, v in head.trained_state().items():  # fp16 on disk
        assert torch.allclose(v, trained_head.trained_state()[k].float(), atol=2e-3, rtol=2e-3), k


def test_resume_continues_the_same_run(trained, tmp_path):
    cfg = EagleTrainConfig(steps=6, batch=2, seq=16, eval_every=3, save_every=2, eval_windows=2, dtype="fp32")
    args = (trained["target"], [str(trained["data"])])
    full = train(*args, tmp_path / "full", cfg, progress=False, log=lambda *_: None)
    part = train(*args, tmp_path / "split", cfg, stop_after=3, progress=False, log=lambda *_: None)
    assert not part["finished"] and not (tmp_path / "split" / "model.safetensors").exists()
    rest = train(*args, tmp_path / "split", cfg, resume=True, progress=False, log=lambda *_: None)
    assert rest["finished"] and [h["loss"] for h in rest["history"]] == [h["loss"] for h in full["history"]]
    a, b = full["head"].trained_state(), rest["head"].trained_state()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_train_eagle(trained, tmp_path):
    res = CliRunner().invoke(cli, ["train", "eagle", "--target", str(trained["target"]), "--data",
                                   str(trained["data"]), "--out", str(tmp_path / "h"), "--steps", "4", "--batch", "2",
                                   "--seq", "16", "--eval-every", "2"])
    assert res.exit_code == 0, res.output
    assert "held-out top-1" in res.output and (tmp_path / "h" / "model.safetensors").is_file()


# ---- dynamic tree (EAGLE-2) ------------------------------------------------------------------------
def table_expand(table):
    """expand() over a hand-made next-token distribution: table(tokens) -> p [V]."""
    return lambda frontier: np.log(np.stack([table(n.tokens) for n in frontier]) + 1e-300)


def test_dynamic_tree_on_a_known_distribution():
    # p(next | path): after "a" (0) very likely "a" again; "b" (1) is the runner-up at depth 1
    def table(tokens):
        p = np.full(4, 0.05)
        if not tokens or tokens[-1] == 0:
            p[:] = [0.6, 0.3, 0.05, 0.05] if not tokens else [0.9, 0.05, 0.03, 0.02]
        else:
            p[:] = [0.25, 0.25, 0.25, 0.25]
        return p

    root = np.log(table(()))
    choices, tok = dynamic_tree(root, table_expand(table), topk=2, depth=3, nodes=5)
    # best 4 paths: a .6, aa .54, aaa .486, b .3 (ab .03, ba .075, ... lose)
    assert sorted(map(tuple, choices)) == [(0,), (0, 0), (0, 0, 0), (1,)]
    assert tok == {(0,): 0, (0, 0): 0, (0, 0, 0): 0, (1,): 1}
    compile_tree(choices)  # a valid tree: every prefix kept


def test_dynamic_tree_equals_brute_force_top_paths():
    """With topk >= the node budget, the EAGLE-2 tree is exactly the budget's most probable paths."""
    rng = np.random.default_rng(0)
    vocab, depth, nodes = 5, 3, 9
    tables = {}

    def table(tokens):
        if tokens not in tables:
            tables[tokens] = rng.dirichlet(np.full(vocab, 0.5))
        return tables[tokens]

    root = np.log(table(()))
    choices, tok = dynamic_tree(root, table_expand(table), topk=nodes, depth=depth, nodes=nodes)
    score = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            score[path] = np.prod([table(path[:i])[path[i]] for i in range(d)])
    best = sorted(score, key=lambda p: -score[p])[: nodes - 1]
    got = sorted(tuple(tok[tuple(c[: i + 1])] for i in range(len(c))) for c in choices)  # token paths
    assert got == sorted(best)


def test_dynamic_tree_expands_only_topk_per_depth():
    calls = []

    def expand(frontier):
        calls.append(len(frontier))
        return np.log(np.full((len(frontier), 6), 1 / 6))

    choices, _ = dynamic_tree(np.log(np.full(6, 1 / 6)), expand, topk=2, depth=4, nodes=20)
    assert calls == [2, 2, 2] and len(choices) == 2 + 3 * 4
    compile_tree(choices)


# ---- decoding --------------------------------------------------------------------------------------
def test_manifest_has_eagle_section(rt, engine):
    m = json.loads((engine / "manifest.json").read_text())
    assert m["eagle"]["tree"] == TREE and m["models"]["target"]["shapes"]["tree_verify"] == 12
    assert m["defaults"]["method"] == "eagle" and rt.manifest.eagle.num_kv_heads >= 1


def test_greedy_equals_plain(rt):
    for prompt in PROMPTS + [LONG]:
        for max_new in (1, 2, 7, 30):
            plain = rt.generate(prompt, max_new_tokens=max_new, method="none")
            out = rt.generate(prompt, max_new_tokens=max_new, method="eagle", gamma=1)
            assert out.token_ids == plain.token_ids, (prompt, max_new)
    s = rt.generate(PROMPT, max_new_tokens=30, method="eagle", gamma=1).stats
    assert s["method"] == "eagle" and s["accepted"] > 0 and s["tokens_per_pass"] > 1
    assert sum(s["accept_length_histogram"]) == s["rounds"]


def test_stop_token_mid_tree_stops_exactly(rt):
    """A frequent greedy token made a stop id ends generation inside an accepted tree path."""
    for prompt in PROMPTS:
        plain = rt.generate(prompt, max_new_tokens=30, method="none")
        stop_id = max(set(plain.token_ids[1:]), key=plain.token_ids[1:].count)
        cut = plain.token_ids.index(stop_id) + 1
        out = rt.generate(prompt, max_new_tokens=30, method="eagle", gamma=1, stop_token_ids=[stop_id])
        assert out.token_ids == plain.token_ids[:cut] and out.finish_reason == "stop"


def test_runs_into_max_len(rt):
    """Near the end of the cache the loop falls back to single steps and still equals plain decoding."""
    plain = rt.generate(PROMPT, max_new_tokens=100, method="none")
    out = rt.generate(PROMPT, max_new_tokens=100, method="eagle", gamma=1)
    assert out.token_ids == plain.token_ids and out.finish_reason == "length"
    assert out.stats["fallback_steps"] > 0


def test_head_cache_matches_fresh_recompute_after_sampled_rounds(rt):
    assert_head_cache_matches_fresh(rt, LONG)  # two prefill chunks: the head's first rows read features from both


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}], ids=str)
def test_eagle_is_exact(rt, target_model, sampling):
    counts, totals = run_trials(rt, PROMPT, TRIALS, V, method="eagle", gamma=1, **sampling)
    pv = p_values(counts, exact_joint(target_model, PROMPT, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["accepted"] > TRIALS / 5  # the trees really accepted candidates


def test_errors(rt, build_engine, engine, tmp_path):
    import shutil

    plain = specrt.load(build_engine("eagle_plain", dict(arch="llama", seed=5)))
    with pytest.raises(specrt.runtime.sampling.SamplingError, match="exported with --eagle"):
        plain.generate([1], method="eagle", gamma=1)
    bad = tmp_path / "bad"
    shutil.copytree(engine, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["eagle"]["tree"]["nodes"] = 16
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="16 nodes but models.target.shapes.tree_verify is 12"):
        specrt.load(bad)


def test_cli_export_and_generate(trained, tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["export", "--target", str(trained["target"]), "--eagle", str(trained["head"]),
                              "--eagle-nodes", "8", "--eagle-depth", "3", "--eagle-topk", "2", "--max-len", "40",
                              "--prefill-chunk", "16", "--gamma", "2", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "abc", "--method", "eagle",
                              "--max-new-tokens", "12", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])
    assert out["stats"]["method"] == "eagle" and out["stats"]["tree_size"] == 8 and len(out["token_ids"]) == 12
    res = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "abc", "--method", "eagle",
                              "--max-new-tokens", "12"])
    assert res.exit_code == 0 and "[eagle]" in res.output, res.output


def test_head_for_another_target_is_refused(trained, tmp_path):
    other = make_model(tmp_path / "other", arch="llama", vocab_size=V, hidden=48, seed=2)
    with pytest.raises(ExportError, match="another target: hidden 32, vocab 16; the target's are hidden 48"):
        export_engine(other, tmp_path / "e", eagle_dir=trained["head"], eagle_tree=TREE,
                      cfg=ExportConfig(gamma=2, max_len=32), log=lambda *_: None)
    assert not (tmp_path / "e" / "manifest.json").exists()
    with pytest.raises(ExportError, match="not both"):
        export_engine(trained["target"], tmp_path / "e2", eagle_dir=trained["head"], eagle_tree=TREE,
                      medusa_dir=trained["head"], tree=compile_tree([[0]]), log=lambda *_: None)


def test_draft_rows_equal_a_chain_over_each_path(rt, monkeypatch):
    """Each expanded draft node (tree mask over the head's cache, parent's predicted feature, position by
    depth) computes what a plain causal head pass over its own path computes."""
    from specrt.runtime.proposers import eagle as eagle_module

    t = rt.eagle_tree
    logits, feats = fresh_runner(rt.target).prefill(0, PROMPT)
    row = SimpleNamespace(slot=0, seq=PROMPT + [int(logits.argmax())], request=SimpleNamespace(request_id="r"))
    proposer = rt.proposer("eagle", 1)
    proposer.start(row, feats)
    proposer._catch_up(row)
    root_feat = proposer.states["r"].root_feat.copy()
    expanded, real = [], eagle_module.dynamic_trees

    def spy(root_logps, expand, *args):
        def recording(frontiers):
            out = expand(frontiers)
            expanded.extend(zip(frontiers[0], out[0]))
            return out
        return real(root_logps, recording, *args)

    monkeypatch.setattr(eagle_module, "dynamic_trees", spy)
    proposer.draft([row])
    assert proposer.runner.lengths[0] == len(row.seq) - 1  # draft rows dropped
    assert len(expanded) == (t["depth"] - 1) * t["topk"] and max(len(n.path) for n, _ in expanded) == t["depth"] - 1
    for node, logp in expanded:
        path, a = [], node
        while a.parent is not None:
            path.append(a)
            a = a.parent
        fresh = rt.proposer("eagle", 1)
        fresh.start(row, feats)
        fresh._catch_up(row)
        f = root_feat
        for n in reversed(path):  # depth 1 .. node: one causal head row each
            fresh._chain(row, [n.tokens[-1]], f[None])
            f = fresh.states["r"].root_feat
        assert np.abs(f - node.feat).max() < 1e-4
        assert np.abs(log_softmax(fresh.states["r"].root_logits) - logp).max() < 1e-4


# ---- batched through the decode core ---------------------------------------------------------------
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batched_rows_equal_batch1(rt, sampled):
    """Rows of different prompt lengths (different tree positions, padding), finishing at different steps."""
    done = assert_batched_rows_equal_batch1(rt, "eagle", PROMPTS + [LONG], [12, 9, 16, 5], sampled=sampled, gamma=1)
    assert sum(d[3]["accepted"] for d in done.values()) > 0  # the trees really accepted candidates


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}], ids=str)
def test_batched_tree_path_is_exact(rt, target_model, sampling):
    counts, totals = run_trials_batched(rt, PROMPT, TRIALS, V, "eagle", gamma=1, **sampling)
    pv = p_values(counts, exact_joint(target_model, PROMPT, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["accepted"] > TRIALS / 5


def test_stats_are_finite_on_a_fresh_runtime(engine):
    """A fresh Runtime's first EAGLE request reports a measured c, not a division by an unmeasured T(1)."""
    s = specrt.load(engine).generate(PROMPT, max_new_tokens=12, method="eagle", gamma=1).stats
    assert s["rounds"] > 0 and 0 < s["c"] < 100 and 0 < s["verify_ratio"] < 100
    assert np.isfinite(s["predicted_speedup"]) and s["predicted_speedup"] > 0


def test_lockstep_drafting_equals_drafting_each_row_alone(rt):
    """Rows of different lengths draft their trees together (one head call per depth for all rows):
    each row gets the tree it gets alone."""
    proposer = rt.proposer("eagle", 2)
    rows = []
    for slot, prompt in enumerate((PROMPT, LONG)):
        logits, feats = fresh_runner(rt.target).prefill(0, prompt)
        rows.append(SimpleNamespace(slot=slot, seq=prompt + [int(logits.argmax())],
                                    request=SimpleNamespace(request_id=f"r{slot}")))
        proposer.start(rows[-1], feats)
        proposer._catch_up(rows[-1])
    passes = proposer.passes
    together = proposer.draft(rows)
    assert proposer.passes - passes == rt.eagle_tree["depth"] - 1  # one call per depth, not per row
    for (tree, tokens), alone in zip(together, (proposer.draft([rows[0]])[0], proposer.draft([rows[1]])[0])):
        assert tree.choices == alone[0].choices and np.array_equal(tokens, alone[1])
