"""EAGLE-3: the head (fused three-layer features, its own LM head over a draft vocabulary), training-time test,
export (version detected from the head dir), and exact tree-speculative decoding with the dynamic tree."""
import json
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import specrt
from specrt.engines import EngineError
from specrt.engines.ort import OrtEngine
from specrt.export.eagle3_head import (Eagle3Config, Eagle3Head, default_aux_layers, export_head3_graphs,
                                       load_head3)
from specrt.export.eagle_head import INPUTS, parity_cases
from specrt.export.onnx_export import ExportConfig, ExportError, export_engine
from specrt.tools.cli import cli
from specrt.tools.train.eagle3 import Eagle3TrainConfig, target_features, train, ttt_forward
from reference import assert_batched_rows_equal_batch1, assert_head_cache_matches_fresh, fresh_runner
from stat_harness import P_MIN, exactness
from tiny import EAGLE_TREE, HEADS_TARGET, make_model, sample_corpus

V = 16
LAYERS = 6  # target layers: EAGLE-3 fuses the inputs of layers 2, 3, 3 (default_aux_layers)
DRAFT_V = 12  # the trained head's reduced vocabulary
TRIALS = 1500  # seeded runs per chi-square check
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PROMPTS = [[5], PROMPT, [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
LONG = [(3 * i) % (V - 1) + 1 for i in range(21)]  # 21 tokens: two prefill chunks of 16
QUIET = dict(progress=False, log=lambda *_: None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_model(root / "target", **{**HEADS_TARGET, "layers": LAYERS})
    data = sample_corpus(target, root / "data")
    cfg = Eagle3TrainConfig(steps=40, batch=8, seq=32, lr=3e-3, ttt_steps=3, draft_vocab=DRAFT_V, eval_every=20,
                            save_every=20, eval_windows=8)
    result = train(target, [str(data)], root / "head", cfg, **QUIET)
    return {"root": root, "target": target, "data": data, "head": root / "head", "result": result}


@pytest.fixture(scope="module")
def engine(trained):
    return export_engine(trained["target"], trained["root"] / "engine", log=lambda *_: None, eagle_dir=trained["head"],
                         cfg=ExportConfig(gamma=3, max_len=48, prefill_chunk=16), eagle_tree=EAGLE_TREE)


def random_head(model, draft_vocab=0, seed=0):
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(model, draft_vocab_size=draft_vocab))
    if draft_vocab:
        head.set_vocab_map(torch.arange(V)[torch.randperm(V)[:draft_vocab].sort().values] - torch.arange(draft_vocab))
    head.attach_target(model, init=True).eval()
    with torch.no_grad():
        for p in head.midlayer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return head


# ---- head and graphs -------------------------------------------------------------------------------
def test_default_layers_follow_eagle3():
    assert default_aux_layers(32) == [2, 16, 29] and default_aux_layers(8) == [2, 4, 5]
    assert default_aux_layers(2) == [0, 1, 1] and default_aux_layers(LAYERS) == [2, 3, 3]


def test_head_graphs_match_torch(target_model, tmp_path):
    head = random_head(target_model, draft_vocab=10)
    section = export_head3_graphs(head, tmp_path)
    assert section["version"] == 3 and section["draft_vocab_size"] == 10 and section["parity_max_abs_diff"] < 1e-3
    ort, fc = OrtEngine(tmp_path / "eagle.onnx"), OrtEngine(tmp_path / "eagle_fc.onnx")
    for feeds in parity_cases(head.cfg, torch.float32, seed=7):  # fresh inputs, not those checked at export
        with torch.no_grad():
            ref = head(*(feeds[n] for n in INPUTS))
        got = ort.run({n: feeds[n].numpy() for n in INPUTS})
        for name, r in zip(("logits", "new_key.0", "new_value.0", "next_hidden"), ref):
            assert np.abs(got[name] - r.numpy()).max() < 1e-3, name
        outside = ~head.t2d.numpy()  # target ids outside the draft vocabulary are never candidates
        assert (got["logits"][..., outside] < -6e4).all() and (got["logits"][..., ~outside] > -1e3).all()
    aux = torch.randn(1, 5, 3 * head.cfg.hidden_size)
    with torch.no_grad():
        assert np.abs(fc.run({"aux_hidden": aux.numpy()})["hidden"] - head.fuse(aux).numpy()).max() < 1e-4


def test_ttt_rows_are_the_drafting_rows(target_model):
    """TTT step j's row t computes what drafting computes: the head's cached causal rows 0..t (true features)
    then j chained rows, each reading the previous row's own output h."""
    from specrt.export.eagle_head import causal_mask

    head = random_head(target_model, seed=1)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(0))
    aux, _ = target_features(target_model, ids, head.cfg.aux_layers)
    with torch.no_grad():
        steps = [logits for _, logits in ttt_forward(head, aux, ids, 3)]
        g = head.fuse(aux[:, :8])
        for t in (0, 3, 5):
            logits, pk, pv, h = head(ids[:, 1 : t + 2], g[:, : t + 1], torch.arange(t + 1)[None], causal_mask(0, t + 1),
                                     head.empty_past(), head.empty_past())
            assert torch.allclose(logits[0, t], steps[0][0, t], atol=1e-4)
            feat = h[:, -1:]
            for j in (1, 2):
                lo, nk, nv, feat = head(ids[:, t + 1 + j : t + 2 + j], feat, torch.tensor([[t + j]]),
                                        causal_mask(t + j, 1), pk, pv)
                pk, pv = torch.cat((pk, nk)), torch.cat((pv, nv))
                assert torch.allclose(lo[0, 0], steps[j][0, t], atol=1e-4), (t, j)


def test_ttt_on_a_subset_of_rows_computes_those_rows(target_model):
    """Deep steps on a subset of the rows (--ttt-positions) give exactly the all-rows logits of those rows."""
    head = random_head(target_model, seed=2)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    aux, _ = target_features(target_model, ids, head.cfg.aux_layers)
    subset = torch.tensor([0, 3, 7, 11, 14, 17])
    with torch.no_grad():
        full, part = ttt_forward(head, aux, ids, 5), ttt_forward(head, aux, ids, 5, subset)
    for j, ((t_full, all_rows), (t, rows)) in enumerate(zip(full, part)):
        assert t.tolist() == (list(range(19)) if j == 0 else [i for i in subset.tolist() if i < 19 - j])
        assert torch.allclose(all_rows[:, t], rows, atol=1e-5), j


# ---- training --------------------------------------------------------------------------------------
def test_training_loss_falls_and_top1_beats_chance(trained):
    r = trained["result"]
    losses = [h["loss"] for h in r["history"]]
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:3])
    acc = r["accuracy"]
    assert acc["top1"] > 3 / V and acc["top5"] >= acc["top1"] and len(acc["top1_by_step"]) == 3
    cfg = json.loads((trained["head"] / "config.json").read_text())
    assert cfg["format"] == "specrt-eagle-head" and cfg["version"] == 3 and cfg["accuracy"] == acc
    assert cfg["aux_layers"] == [2, 3, 3] and cfg["draft_vocab_size"] == DRAFT_V


def test_saved_head_reloads(trained, target_model):
    head, _ = load_head3(trained["head"], target_model)
    assert torch.equal(head.embed.weight, target_model.get_input_embeddings().weight)
    trained_head = trained["result"]["head"]
    assert torch.equal(head.d2t, trained_head.d2t) and int(head.t2d.sum()) == DRAFT_V
    for k, v in head.trained_state().items():  # fp16 on disk
        ref = trained_head.trained_state()[k]
        assert torch.allclose(v.float(), ref.float(), atol=2e-3, rtol=2e-3), k


def test_resume_continues_the_same_run(trained, tmp_path):
    cfg = Eagle3TrainConfig(steps=6, batch=2, seq=16, ttt_steps=3, ttt_positions=6, draft_vocab=DRAFT_V, eval_every=3,
                            save_every=2, eval_windows=2, dtype="fp32")  # deep rows drawn from the checkpointed rng
    args = (trained["target"], [str(trained["data"])])
    full = train(*args, tmp_path / "full", cfg, **QUIET)
    part = train(*args, tmp_path / "split", cfg, stop_after=3, **QUIET)
    assert not part["finished"] and not (tmp_path / "split" / "model.safetensors").exists()
    rest = train(*args, tmp_path / "split", cfg, resume=True, **QUIET)
    assert rest["finished"] and [h["loss"] for h in rest["history"]] == [h["loss"] for h in full["history"]]
    a, b = full["head"].trained_state(), rest["head"].trained_state()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_train_export_generate(trained, tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["train", "eagle", "--version", "3", "--target", str(trained["target"]), "--data",
                              str(trained["data"]), "--out", str(tmp_path / "h"), "--steps", "3", "--batch", "2",
                              "--seq", "16", "--eval-every", "3", "--ttt-steps", "2", "--ttt-positions", "4",
                              "--aux-layers", "1,4,5"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert "held-out top-1" in res.output and cfg["version"] == 3 and cfg["aux_layers"] == [1, 4, 5]
    res = runner.invoke(cli, ["export", "--target", str(trained["target"]), "--eagle", str(tmp_path / "h"),
                              "--eagle-nodes", "8", "--eagle-depth", "3", "--eagle-topk", "2", "--max-len", "40",
                              "--prefill-chunk", "16", "--gamma", "2", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0 and "EAGLE-3 head" in res.output, res.output
    res = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "abc", "--method", "eagle",
                              "--max-new-tokens", "12", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])
    assert out["stats"]["method"] == "eagle" and len(out["token_ids"]) == 12
    for bad, why in (("1,2", "three layer indices"), ("1,2,9", "needs 3 layer indices in 0..5")):
        res = runner.invoke(cli, ["train", "eagle", "--version", "3", "--target", str(trained["target"]), "--data",
                                  str(trained["data"]), "--out", str(tmp_path / "h2"), "--seq", "16", "--steps", "1",
                                  "--aux-layers", bad])
        assert res.exit_code != 0 and why in res.output and "Traceback" not in res.output, res.output


# ---- decoding --------------------------------------------------------------------------------------
def test_manifest_records_version_and_layers(rt, engine):
    m = json.loads((engine / "manifest.json").read_text())
    assert m["eagle"]["version"] == 3 and m["eagle"]["aux_hidden_layers"] == [2, 3, 3]
    assert m["eagle"]["draft_vocab_size"] == DRAFT_V and (engine / m["eagle"]["fc_file"]).is_file()
    assert m["models"]["target"]["aux_hidden_layers"] == [2, 3, 3]
    assert [o["name"] for o in m["models"]["target"]["outputs"]][-2:] == ["hidden", "aux_hidden"]
    assert rt.proposer("eagle", 1).feature == "aux_hidden"


def test_target_aux_hidden_is_the_fused_layers(rt, target_model):
    _, aux = fresh_runner(rt.target).prefill(0, LONG, "aux_hidden")  # [P, 3H] over two prefill chunks
    with torch.no_grad():
        hs = target_model(torch.tensor([LONG]), output_hidden_states=True).hidden_states
    np.testing.assert_allclose(aux, torch.cat([hs[2], hs[3], hs[3]], -1)[0].numpy(), atol=1e-4)


def test_greedy_equals_plain(rt):
    for prompt in PROMPTS + [LONG]:
        for max_new in (1, 7, 30):
            plain = rt.generate(prompt, max_new_tokens=max_new, method="none")
            out = rt.generate(prompt, max_new_tokens=max_new, method="eagle", gamma=1)
            assert out.token_ids == plain.token_ids, (prompt, max_new)
    s = rt.generate(PROMPT, max_new_tokens=30, method="eagle", gamma=1).stats
    assert s["accepted"] > 0 and s["tokens_per_pass"] > 1
    out = rt.generate(PROMPT, max_new_tokens=100, method="eagle", gamma=1)  # into max_len: single steps at the end
    assert out.token_ids == rt.generate(PROMPT, max_new_tokens=100, method="none").token_ids


def test_head_cache_matches_fresh_recompute(rt):
    """The head's cache after sampled rounds equals the head run afresh on the target's fused features."""
    assert_head_cache_matches_fresh(rt, LONG, "aux_hidden")


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}], ids=str)
def test_eagle3_is_exact(rt, trained, sampling):
    pv, totals = exactness(rt, trained["target"], PROMPT, V, sampling, trials=TRIALS, method="eagle", gamma=1)
    assert min(pv.values()) > P_MIN, pv
    assert totals["accepted"] > TRIALS / 5  # the trees really accepted candidates


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batched_rows_equal_batch1(rt, sampled):
    done = assert_batched_rows_equal_batch1(rt, "eagle", PROMPTS + [LONG], [12, 9, 16, 5], sampled=sampled, gamma=1)
    assert sum(d[3]["accepted"] for d in done.values()) > 0


# ---- errors ----------------------------------------------------------------------------------------
def test_layer_mismatch_and_other_target_are_refused(trained, engine, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(engine, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["eagle"]["aux_hidden_layers"] = [1, 2, 3]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=r"fuses layers \[1, 2, 3\] but the target outputs aux_hidden of layers"):
        specrt.load(bad)
    m["eagle"]["aux_hidden_layers"], m["models"]["target"]["aux_hidden_layers"] = [2, 3, 3], [2, 3, 9]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="aux_hidden_layers must be a non-empty list of layer indices in 0..5"):
        specrt.load(bad)
    other = make_model(tmp_path / "other", arch="llama", vocab_size=V, hidden=48, layers=LAYERS, seed=2)
    with pytest.raises(ExportError, match="another target: hidden 32, vocab 16; the target's are hidden 48"):
        export_engine(other, tmp_path / "e", eagle_dir=trained["head"], eagle_tree=EAGLE_TREE,
                      cfg=ExportConfig(gamma=2, max_len=32), log=lambda *_: None)
