"""Self-distillation data (tools/train/self_distill.py) and the target's cached outputs (tools/train/features.py):
prompts split by file, continuations that are the target's own greedy text, caches equal to the target's pass,
and the EAGLE / draft trainers running on them."""
import json

import numpy as np
import pytest
import torch

import specrt
from specrt.tools.train import demo, self_distill
from specrt.tools.train.features import build_cache, cached_features, soft_ce


def test_function_prompts_are_split_by_file(tmp_path, monkeypatch):
    train_file, held_file = tmp_path / "a.py", tmp_path / "b.py"
    train_file.write_text('class C:\n    @staticmethod\n    def f(x):\n        """Double x."""\n        return 2 * x\n\n'
                          'def g():\n    pass\n')
    held_file.write_text('def h(y, z=1):\n    """Add.\n\n    Two lines.\n    """\n    return y + z\n')
    assert self_distill.function_prompts(train_file) == [("f", '@staticmethod\ndef f(x):\n    """Double x."""\n')]
    monkeypatch.setattr(demo, "split_corpus", lambda: ([train_file], [held_file]))
    prompts = self_distill.code_prompts(5, 5)
    assert [(p.split, p.source) for p in prompts] == [("train", "a.py:f"), ("heldout", "b.py:h")]
    assert prompts[1].text.endswith('    """\n') and prompts[1].kind == "code"


def test_continuations_are_the_targets_greedy_text(llama_engine):
    prompts = ["abc", "hello wor", "xy", "def f(", "q"]
    texts = self_distill.continue_prompts(llama_engine, prompts, 10, max_batch=2, log=lambda *_: None)
    rt = specrt.load(llama_engine)
    assert texts == [rt.generate(p, max_new_tokens=10, method="none").text for p in prompts]


def test_records_are_written_by_split(llama_engine, tmp_path):
    rows = [{"text": "ab", "kind": "code", "split": "train"}, {"text": "abcd", "kind": "chat", "split": "heldout"}]
    summary = self_distill.write_records(tmp_path, rows, llama_engine, 1.0, llama_engine / "tokenizer")
    assert summary["train"] == {"documents": 1, "tokens": 2, "by_kind": {"code": 1, "chat": 0}}
    assert [json.loads(l)["text"] for l in (tmp_path / "heldout.jsonl").read_text().splitlines()] == ["abcd"]


def test_feature_cache_is_the_targets_pass(medusa_trained, tmp_path):
    from specrt.export.hf_checkpoint import load_hf

    model = load_hf(medusa_trained["target"]).float().eval()
    docs = [np.array([1, 2, 3, 4, 5, 0]), np.array([6, 7, 8, 0])]
    cache = build_cache(model, docs, k=4, log=lambda *_: None)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[6, 7, 8, 0]]), output_hidden_states=True)  # the 2nd doc, own context
    assert np.array_equal(cache.ids, np.concatenate(docs)) and cache.top_ids.shape == (10, 4)
    assert np.allclose(cache.hidden[6:], out.hidden_states[-1][0].numpy(), atol=1e-2)
    assert np.array_equal(cache.top_ids[6:, 0], out.logits[0].argmax(-1).numpy())
    partial = tmp_path / "p.npz"  # a stopped build continues from its partial file (here: every piece done)
    build_cache(model, docs[:1], k=4, log=lambda *_: None, partial=partial)
    lines = []
    resumed = build_cache(model, docs, k=4, log=lines.append, partial=partial)
    assert "continuing after 1 documents" in lines[0] and np.array_equal(resumed.top_ids, cache.top_ids)
    again = cached_features(model, docs, tmp_path / "c.npz", log=lambda *_: None)  # saved, then read back
    assert np.array_equal(cached_features(model, docs, tmp_path / "c.npz", log=lambda *_: None).hidden, again.hidden)
    batch = cache.windows([0, 5], 4)
    assert batch.hidden.shape == (2, 4, model.config.hidden_size) and batch.top_logp.dtype == torch.float32
    logits = torch.zeros(2, 4, model.config.vocab_size)  # uniform q: CE = log V whatever the target says
    assert float(soft_ce(logits, batch.top_ids, batch.top_logp)) == pytest.approx(np.log(model.config.vocab_size))


def test_trainers_run_on_cached_features(medusa_trained, tmp_path):
    from specrt.export.hf_checkpoint import load_hf
    from specrt.tools.train.draft import DraftTrainConfig, new_draft, train as train_draft
    from specrt.tools.train.eagle import EagleTrainConfig, train as train_eagle

    target, data = medusa_trained["target"], [str(medusa_trained["data"])]
    feats = str(tmp_path / "features")
    eagle = train_eagle(target, data, tmp_path / "eagle", EagleTrainConfig(
        steps=30, batch=8, seq=32, lr=3e-3, eval_every=15, eval_windows=4, features=feats, cls_positions=8),
        progress=False, log=lambda *_: None)
    assert (tmp_path / "features" / "train.npz").is_file() and eagle["finished"]
    losses = [h["loss"] for h in eagle["history"]]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) and 0 <= eagle["accuracy"]["top1"] <= 1
    cfg = DraftTrainConfig(layers=1, hidden=16, heads=2, steps=12, batch=4, seq=16, lr=1e-2, eval_every=6,
                           eval_windows=4, freeze_embeddings=True, features=feats, positions=8)
    draft = train_draft(target, data, tmp_path / "draft", cfg, progress=False, log=lambda *_: None)
    kls = [h["kl"] for h in draft["history"]]
    assert draft["finished"] and kls[-1] < kls[0] and "top" in draft["kl_over"]
    torch.manual_seed(0)  # the trainer's seed: the same new draft, whose embedding stayed as it was
    fresh = new_draft(load_hf(target), cfg)
    assert torch.equal(fresh.get_input_embeddings().weight, draft["draft"].get_input_embeddings().weight)


def test_cli_data_reads_the_chat_template_from_the_engine_dir_and_makes_a_suffix_corpus(build_engine, tmp_path):
    """`specrt train data` without --target: the engine dir's tokenizer renders the chat tasks, prompts that do not
    fit the cache are skipped; its train.jsonl is a corpus `specrt serve --suffix-corpus` reads."""
    from click.testing import CliRunner

    from specrt.runtime.proposers.suffix import read_corpus
    from specrt.tools.cli import cli

    engine = build_engine("llama_256", dict(arch="llama", seed=0, scale=30.0), max_len=256)
    res = CliRunner().invoke(cli, ["train", "data", "--engine", str(engine), "--out", str(tmp_path / "d"),
                                   "--code-prompts", "2", "--samples", "0", "--max-new-tokens", "3",
                                   "--max-batch", "8"])
    assert res.exit_code == 0, res.output
    texts = read_corpus(tmp_path / "d" / "train.jsonl")
    assert len(texts) >= 2 and all(isinstance(t, str) and t for t in texts)
