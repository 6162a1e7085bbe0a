"""Medusa: head training, export, tree-speculative decoding (exactness, greedy equality, KV compaction), errors."""
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import specrt
from specrt.engines import EngineError
from specrt.export.medusa_heads import HeadsConfig, MedusaHeads, save_heads
from specrt.export.onnx_export import ExportConfig, ExportError, export_engine, vocab_sha256
from specrt.runtime import verify
from specrt.runtime.core import CoreConfig, DecodeCore, SequenceRequest
from specrt.runtime.proposers import NoProposer, Proposal
from specrt.runtime.proposers.medusa import MedusaProposer
from specrt.runtime.sampling import SamplingError, SamplingParams, probs, sample
from specrt.trees import TreeError, compile_tree
from specrt.tools.cli import cli
from specrt.tools.train.medusa import TrainConfig, TrainError, train
from stat_harness import P_MIN, exact_joint, p_values, run_trials, run_trials_batched
from tiny import MEDUSA_TREE as TREE
from reference import assert_batched_rows_equal_batch1, fresh_logits, fresh_runner

V = 16
TRIALS = 2500
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PROMPTS = [[5], PROMPT, [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]


@pytest.fixture(scope="module")
def trained(medusa_trained):
    return medusa_trained


@pytest.fixture(scope="module")
def engine(medusa_engine):
    return medusa_engine


# ---- training ------------------------------------------------------------------------------------
def test_training_loss_falls_and_heads_beat_chance(trained):
    r = trained["result"]
    losses = [h["loss"] for h in r["history"]]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:3])
    acc = r["accuracy"]
    assert len(acc["top1"]) == 3 and all(a > 3 / V for a in acc["top1"])  # chance is 1/V
    assert all(t5 >= t1 for t1, t5 in zip(acc["top1"], acc["top5"]))
    cfg = json.loads((trained["heads"] / "config.json").read_text())
    assert cfg["num_heads"] == 3 and cfg["hidden_size"] == 32 and cfg["vocab_size"] == V
    assert cfg["accuracy"]["top1"] == acc["top1"] and cfg["dtype"] == "float16"
    assert cfg["target_vocab_sha256"] == vocab_sha256(trained["target"] / "tokenizer.json")


def test_resume_continues_the_same_run(trained, tmp_path):
    cfg = TrainConfig(heads=2, steps=8, batch=4, seq=16, positions=6, eval_every=4, save_every=2, eval_windows=2,
                      distill=0.5)
    args = (trained["target"], [str(trained["data"])])
    full = train(*args, tmp_path / "full", cfg, progress=False, log=lambda *_: None)
    part = train(*args, tmp_path / "split", cfg, stop_after=3, progress=False, log=lambda *_: None)
    assert not part["finished"] and not (tmp_path / "split" / "model.safetensors").exists()
    resumed = train(*args, tmp_path / "split", cfg, resume=True, progress=False, log=lambda *_: None)
    assert resumed["finished"] and [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"]]
    a, b = full["heads"].state_dict(), resumed["heads"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(TrainError, match=r"trained with lr=0.001 \(now 0.5\); only steps and threads may change"):
        train(*args, tmp_path / "split", TrainConfig(**{**cfg.__dict__, "lr": 0.5}), resume=True, progress=False)
    with pytest.raises(TrainError, match="no checkpoint"):
        train(*args, tmp_path / "nothing", cfg, resume=True, progress=False)


# ---- decoding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [TREE, [[0] * d for d in range(1, 4)], [[r] for r in range(11)], "medusa-8"],
                         ids=["exported", "chain", "wide", "medusa-8"])
def test_greedy_equals_plain(rt, tree):
    rt.use_tree(tree)
    try:
        for prompt in PROMPTS:
            for max_new in (1, 2, 7, 20):
                plain = rt.generate(prompt, max_new_tokens=max_new, method="none")
                out = rt.generate(prompt, max_new_tokens=max_new, method="medusa", gamma=1)
                assert out.token_ids == plain.token_ids, (prompt, max_new)
                assert out.finish_reason == plain.finish_reason
        stop = plain.token_ids[3]
        out = rt.generate(prompt, max_new_tokens=20, method="medusa", gamma=1, stop_token_ids=[stop])
        assert out.token_ids == plain.token_ids[: plain.token_ids.index(stop) + 1] and out.finish_reason == "stop"
    finally:
        rt.use_tree(TREE)


def test_stats(rt):
    s = rt.generate(PROMPT, max_new_tokens=20, method="medusa", gamma=1, temperature=1.0, seed=0).stats
    assert s["method"] == "medusa" and s["tree_size"] == 12 and s["tree_depth"] == 3
    assert len(s["per_depth_acceptance"]) == 3 and s["acceptance"] == "exact" and s["lossy"] is False
    assert s["tokens_per_pass"] == pytest.approx((s["accepted"] + s["rounds"]) / s["rounds"])
    assert sum(s["accept_length_histogram"]) == s["rounds"] and s["heads_passes"] == s["rounds"]
    assert s["per_depth_acceptance"] == sorted(s["per_depth_acceptance"], reverse=True)
    typical = rt.generate(PROMPT, max_new_tokens=20, method="medusa", gamma=1, temperature=1.0, seed=0, acceptance="typical")
    assert typical.stats["lossy"] is True and typical.stats["acceptance"] == "typical"
    assert rt.generate(PROMPT, max_new_tokens=5, method="medusa", gamma=1, acceptance="typical").stats["lossy"] is False


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)], ids=str)
def test_tree_verification_is_exact(rt, target_model, sampling):
    counts, totals = run_trials(rt, PROMPT, TRIALS, V, method="medusa", gamma=1, **sampling)
    pv = p_values(counts, exact_joint(target_model, PROMPT, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["accepted"] > TRIALS / 5  # the trees really accepted candidates


def children_each_get_a_coin(tree, tokens, logits, params, rng):
    """WRONG: try each child with its own coin u < p(child), then fall back to a sample from p."""
    node, path = 0, []
    while True:
        p = probs(logits[node][None], params)[0]
        for k in tree.children[node][tree.children[node] >= 0]:
            if rng.random() < p[tokens[k]]:
                node = int(k)
                path.append(node)
                break
        else:
            return np.array(path, dtype=np.int64), int(sample(p[None], rng)[0])


def test_harness_has_power_against_a_wrong_tree_rule(rt, target_model, monkeypatch):
    monkeypatch.setattr(verify, "verify_tree_sampled", children_each_get_a_coin)
    counts, _ = run_trials(rt, PROMPT, TRIALS, V, method="medusa", gamma=1, temperature=1.0)
    assert min(p_values(counts, exact_joint(target_model, PROMPT, {}, V)).values()) < P_MIN


def test_typical_acceptance_is_lossy(rt, target_model):
    """The opt-in typical rule visibly departs from the target's distribution (why it is labelled lossy)."""
    counts, _ = run_trials(rt, PROMPT, 1000, V, method="medusa", gamma=1, temperature=1.0, acceptance="typical")
    assert min(p_values(counts, exact_joint(target_model, PROMPT, {}, V)).values()) < P_MIN


class OracleOffLeftProposer(NoProposer):
    """Puts the target's greedy continuation on the path (1,), (1, 0), (1, 0, 0) and wrong tokens elsewhere,
    so greedy verification accepts a non-leftmost path. Records the hidden state it is given."""

    tree = True
    feature = "hidden"
    tree_name, passes_name = "oracle", "heads_passes"

    def __init__(self, target, tree):
        self.target, self.candidates = target, tree
        self.max_nodes, self.depth = tree.size - 1, tree.depth
        self.hiddens = []

    def start(self, row, hidden):
        self.hiddens.append(hidden[-1].copy())

    def observe(self, row, new, hidden):
        self.hiddens.append(hidden[-1].copy())

    def propose(self, rows, ks):
        tree, (row,) = self.candidates, rows
        greedy = list(row.seq)
        for _ in range(tree.depth):
            greedy.append(int(np.argmax(fresh_logits(self.target, greedy))))
        greedy = greedy[len(row.seq):]
        tokens = np.full(tree.size - 1, -1, dtype=np.int64)
        for i, path in enumerate(tree.choices):
            good = path[0] == 1 and all(r == 0 for r in path[1:])
            tokens[i] = greedy[len(path) - 1] if good else (greedy[len(path) - 1] + 1 + path[-1]) % V
        return [Proposal(tokens, None, tree)]


def medusa_core(rt, proposer) -> DecodeCore:
    core = rt.new_core(CoreConfig(max_batch=1, method="medusa", gamma=1, calibrate=False), proposer=proposer)
    return core


def test_kv_compaction_after_a_non_leftmost_path(rt):
    """After accepting (1,), (1, 0), (1, 0, 0), the cache and the heads' hidden equal a fresh recomputation."""
    proposer = OracleOffLeftProposer(rt.target, compile_tree(TREE))
    core = medusa_core(rt, proposer)
    core.add(SequenceRequest("r", PROMPT, SamplingParams(max_new_tokens=100)))
    row = core.rows[0]
    want_hidden = []
    for _ in range(3):
        core.step()
        assert row.counts.accept_lengths[-1] == 3  # the whole off-left path, then the bonus
        assert core.target.lengths[row.slot] == len(row.seq) - 1
        _, hidden = fresh_runner(rt.target).prefill(0, row.seq[:-1])
        want_hidden.append(hidden[-1])  # at the position that predicted seq[-1]
        got = core.target.forward([row.slot], [row.seq[-1:]]).logits[0, -1]  # the next pass on the compacted cache
        np.testing.assert_allclose(got, fresh_logits(rt.target, row.seq), atol=1e-4)
    for got, want in zip(proposer.hiddens[1:], want_hidden):
        np.testing.assert_allclose(got, want, atol=1e-4)
    core.remove("r")


def test_kv_matches_fresh_recompute_after_sampled_rounds(rt):
    core = medusa_core(rt, MedusaProposer(rt.medusa, rt.manifest.medusa, compile_tree(TREE)))
    core.add(SequenceRequest("r", PROMPT, SamplingParams(temperature=1.0, seed=1, max_new_tokens=100)))
    row = core.rows[0]
    for _ in range(4):
        core.step()
    assert row.counts.accepted > 0 and core.target.lengths[row.slot] == len(row.seq) - 1
    got = core.target.forward([row.slot], [row.seq[-1:]]).logits[0, -1]
    np.testing.assert_allclose(got, fresh_logits(rt.target, row.seq), atol=1e-4)
    core.remove("r")


# ---- bad input -----------------------------------------------------------------------------------
def test_tree_must_fit_the_engine(rt):
    with pytest.raises(TreeError, match="64 nodes but the engine's tree-verify shape is 12"):
        rt.use_tree("medusa-64")
    with pytest.raises(TreeError, match="5 deep but the engine has 3 Medusa heads"):
        rt.use_tree([[0] * d for d in range(1, 6)])
    assert rt.tree.size == 12


def test_bad_arguments(rt, build_engine):
    with pytest.raises(SamplingError, match="acceptance"):
        rt.generate([1], method="medusa", gamma=1, acceptance="bogus")
    with pytest.raises(SamplingError, match="only for method 'medusa'"):
        rt.generate([1], method="none", acceptance="typical")
    plain = specrt.load(build_engine("medusa_plain", dict(arch="llama", seed=5)))
    with pytest.raises(SamplingError, match="exported with --medusa"):
        plain.generate([1], method="medusa", gamma=1)


def heads_for(tmp_path, hidden, vocab, name):
    save_heads(MedusaHeads(HeadsConfig(3, 1, hidden, vocab)), tmp_path / name)
    return tmp_path / name


def test_heads_for_another_target_are_refused(trained, tmp_path):
    t = trained["target"]
    export = lambda heads, tree=TREE: export_engine(t, tmp_path / "e", medusa_dir=heads, tree=compile_tree(tree),
                                                    cfg=ExportConfig(gamma=2, max_len=32), log=lambda *_: None)
    with pytest.raises(ExportError, match="another target: hidden size 48, but the target's is 32"):
        export(heads_for(tmp_path, 48, V, "h48"))
    with pytest.raises(ExportError, match="another target: vocabulary size 20, but the target's is 16"):
        export(heads_for(tmp_path, 32, 20, "v20"))
    with pytest.raises(ExportError, match="4 deep but .* has only 3 heads"):
        export(trained["heads"], [[0] * d for d in range(1, 5)])
    with pytest.raises(ExportError, match="not a Medusa heads dir"):
        export(tmp_path)
    cfg = json.loads((trained["heads"] / "config.json").read_text())
    other = tmp_path / "other_vocab"
    shutil.copytree(trained["heads"], other)
    (other / "config.json").write_text(json.dumps({**cfg, "target_vocab_sha256": "0" * 64}))
    with pytest.raises(ExportError, match="tokenizer vocabulary sha256"):
        export(other)


def test_inconsistent_manifest_is_refused(engine, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(engine, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["medusa"]["tree"]["nodes"] = 16
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="16 nodes but models.target.shapes.tree_verify is 12"):
        specrt.load(bad)
    m = json.loads((engine / "manifest.json").read_text())
    m["medusa"]["hidden_size"] = 64
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="do not match the target"):
        specrt.load(bad)


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_train_export_generate(trained, tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["train", "medusa", "--target", str(trained["target"]), "--data", str(trained["data"]),
                              "--heads", "2", "--out", str(tmp_path / "heads"), "--steps", "4", "--batch", "2",
                              "--seq", "16", "--eval-every", "2"])
    assert res.exit_code == 0, res.output
    assert "held-out top-1 per head" in res.output and (tmp_path / "heads" / "model.safetensors").is_file()
    (tmp_path / "tree.json").write_text(json.dumps([[0], [1], [0, 0]]))
    res = runner.invoke(cli, ["export", "--target", str(trained["target"]), "--medusa", str(tmp_path / "heads"),
                              "--tree", str(tmp_path / "tree.json"), "--out", str(tmp_path / "e"), "--max-len", "64",
                              "--no-measure-default"])  # the rule's default: medusa
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["models"]["target"]["shapes"]["tree_verify"] == 4 and m["defaults"]["method"] == "medusa"
    assert m["medusa"]["tree"]["choices"] == [[0], [1], [0, 0]] and m["models"]["target"]["has_hidden"]
    assert "hidden" in m["models"]["target"]["parity_max_abs_diff"]["tree_verify"]
    gen = ["generate", str(tmp_path / "e"), "--prompt", "abc", "--max-new-tokens", "8"]
    out = json.loads(runner.invoke(cli, gen + ["--json"]).output)
    assert out["stats"]["method"] == "medusa"
    assert out["token_ids"] == json.loads(runner.invoke(cli, gen + ["--json", "--method", "none"]).output)["token_ids"]
    res = runner.invoke(cli, gen + ["--acceptance", "typical", "--temperature", "1"])
    assert res.exit_code == 0 and "LOSSY" in res.output
    res = runner.invoke(cli, ["export", "--target", str(trained["target"]), "--medusa", str(tmp_path / "heads"),
                              "--tree", "[[0]]", "--out", str(tmp_path / "e2")])
    assert res.exit_code != 0 and "neither a default tree" in res.output


# ---- batched through the decode core ---------------------------------------------------------------
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batched_rows_equal_batch1(rt, sampled):
    """Rows of different prompt lengths (different tree positions, padding), finishing at different steps."""
    done = assert_batched_rows_equal_batch1(rt, "medusa", PROMPTS + [[2, 4, 6, 8, 10, 12, 14, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5]], [12, 9, 16, 5], sampled=sampled, gamma=1)
    assert sum(d[3]["accepted"] for d in done.values()) > 0  # the trees really accepted candidates


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}], ids=str)
def test_batched_tree_path_is_exact(rt, target_model, sampling):
    counts, totals = run_trials_batched(rt, PROMPT, TRIALS, V, "medusa", gamma=1, **sampling)
    pv = p_values(counts, exact_joint(target_model, PROMPT, sampling, V))
    assert min(pv.values()) > P_MIN, pv
    assert totals["accepted"] > TRIALS / 5


@pytest.mark.parametrize("tree_cost", [1.0, 12.0])
def test_the_policy_turns_the_tree_on_and_off(rt, tree_cost):
    """gamma None: the batch-aware policy decides per step whether the tree pays (here: synthetic costs of
    T(1) = 1 and T(12) = tree_cost). Off, the rows decode plainly, with a probe tree every probe_every
    steps; on, a tree every step. Either way greedy output equals plain decoding."""
    core = rt.new_core(CoreConfig(max_batch=1, method="medusa", calibrate=False, probe_every=4))
    core.policy.record_target(1, 1, 1.0)
    core.policy.record_target(1, 12, tree_cost)
    core.policy.config.guard = False  # the prediction alone: no realized step times
    core.add(SequenceRequest("r", PROMPT, SamplingParams(max_new_tokens=12)))  # a tree always fits max_len 32
    row = core.rows[0]
    while core.rows:
        update = core.step()[0][0]
    assert update.token_ids == rt.generate(PROMPT, max_new_tokens=12, method="none").token_ids
    trees, plain = row.counts.rounds, row.counts.fallback_steps
    if tree_cost == 1.0:
        assert trees > 0 and plain <= 1  # on (plain only for the last token)
    else:
        assert 0 < trees <= plain / 3  # off, probing


def test_ctrl_c_during_training_saves_a_checkpoint_that_resumes_bit_for_bit(trained, tmp_path, monkeypatch):
    import os
    import signal

    from specrt.tools.train import medusa as medusa_train

    cfg = TrainConfig(heads=2, steps=6, batch=4, seq=16, positions=6, eval_every=3, save_every=100, eval_windows=2)
    args = (trained["target"], [str(trained["data"])])
    full = train(*args, tmp_path / "full", cfg, progress=False, log=lambda *_: None)
    real, calls = medusa_train.sample_windows, []

    def interrupting(*a):
        calls.append(1)
        if len(calls) == 3:  # SIGINT in the middle of step 3
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a)

    monkeypatch.setattr(medusa_train, "sample_windows", interrupting)
    with pytest.raises(KeyboardInterrupt):
        train(*args, tmp_path / "run", cfg, progress=False, log=lambda *_: None)
    assert torch.load(tmp_path / "run" / medusa_train.CHECKPOINT, weights_only=False)["step"] == 3  # step 3 finished
    monkeypatch.setattr(medusa_train, "sample_windows", real)
    resumed = train(*args, tmp_path / "run", cfg, resume=True, progress=False, log=lambda *_: None)
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"]]
