"""`specrt export --medusa DIR` with a Medusa-1 checkpoint in FasterDecoding/Medusa's layout (config.json with
medusa_num_heads / medusa_num_layers / base_model_name_or_path, medusa_lm_head.pt), synthesized from trained
specrt heads: same logits, greedy equal to plain, exact sampling; a checkpoint for another base model refused."""
import json

import numpy as np
import pytest
import torch

import specrt
from tiny import MEDUSA_TREE, make_model
from specrt.engines import OrtEngine
from specrt.export.medusa_heads import load_heads
from specrt.export.errors import ExportError
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, export_engine
from specrt.trees import compile_tree
from stat_harness import P_MIN, exact_joint, p_values, run_trials


def write_upstream(heads, out, base="lmsys/vicuna-7b-v1.3"):
    """specrt heads saved the way FasterDecoding/Medusa saves its medusa_head ModuleList."""
    cfg = heads.cfg
    state = {}
    for k in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            state[f"{k}.{j}.linear.weight"] = heads.blocks[k][j].linear.weight.detach().clone()
            state[f"{k}.{j}.linear.bias"] = heads.blocks[k][j].linear.bias.detach().clone()
        state[f"{k}.{cfg.num_layers}.weight"] = heads.lm_heads[k].weight.detach().clone()
    out.mkdir(parents=True)
    torch.save(state, out / "medusa_lm_head.pt")
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
                                                 "base_model_name_or_path": base}))
    return out


@pytest.fixture(scope="module")
def upstream_engine(medusa_trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream")
    heads, _ = load_heads(medusa_trained["heads"])
    up = write_upstream(heads, root / "medusa-1")
    engine = export_engine(medusa_trained["target"], root / "engine", log=lambda *_: None,
                           cfg=ExportConfig(gamma=3, max_len=32, prefill_chunk=16), medusa_dir=up,
                           tree=compile_tree(MEDUSA_TREE, "test-12"))
    return engine, heads


def test_upstream_heads_compute_what_specrt_heads_do(upstream_engine):
    engine, heads = upstream_engine
    hidden = np.random.default_rng(0).standard_normal((2, heads.cfg.hidden_size)).astype(np.float32)
    got = OrtEngine(engine / "medusa.onnx").run({"hidden": hidden})["medusa_logits"]
    with torch.no_grad():
        ref = heads(torch.from_numpy(hidden)).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-3)


def test_upstream_heads_decode_greedy_and_exact(upstream_engine, medusa_trained):
    engine, _ = upstream_engine
    rt = specrt.load(engine)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    tree = rt.generate(prompt, max_new_tokens=16, method="medusa", gamma=1)
    assert tree.token_ids == rt.generate(prompt, max_new_tokens=16, method="none").token_ids
    V = rt.manifest.target.geometry.vocab_size
    counts, _ = run_trials(rt, prompt, 1500, V, method="medusa", gamma=1, temperature=1.0)
    pv = p_values(counts, exact_joint(load_hf(medusa_trained["target"]), prompt, {"temperature": 1.0}, V))
    assert min(pv.values()) > P_MIN, pv


def test_upstream_heads_for_another_base_model_are_refused(medusa_trained, tmp_path):
    heads, _ = load_heads(medusa_trained["heads"])
    up = write_upstream(heads, tmp_path / "medusa-1", base="lmsys/vicuna-7b-v1.3")
    other = make_model(tmp_path / "other", arch="llama", hidden=64, vocab_size=heads.cfg.vocab_size)
    with pytest.raises(ExportError, match=r"base model lmsys/vicuna-7b-v1.3.*hidden size 32.*64.*target .*other"):
        export_engine(other, tmp_path / "engine", log=lambda *_: None, cfg=ExportConfig(max_len=32),
                      medusa_dir=up, tree=compile_tree(MEDUSA_TREE, "test-12"))
    assert not (tmp_path / "engine").exists()
