"""`specrt train draft` (tools/train/draft.py): distils a draft on one text file, reports held-out KL and greedy
agreement, resumes bit for bit, and the result drafts exactly (greedy == plain) in an exported engine."""
import json

import pytest
import torch

import specrt
from specrt.export.onnx_export import ExportConfig, export_engine
from specrt.tools.train.draft import DraftTrainConfig, train
from specrt.tools.train.medusa import TrainError


def corpus(medusa_trained, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f.read_text() for f in sorted(medusa_trained["data"].rglob("*")) if f.is_file()))
    return path


def test_distil_resume_and_draft(medusa_trained, tmp_path):
    data = [str(corpus(medusa_trained, tmp_path))]
    cfg = DraftTrainConfig(layers=1, hidden=16, heads=2, steps=12, batch=4, seq=16, lr=1e-2, eval_every=6,
                           save_every=4, eval_windows=4)
    target = medusa_trained["target"]
    full = train(target, data, tmp_path / "full", cfg, progress=False, log=lambda *_: None)
    kls = [h["kl"] for h in full["history"]]
    assert full["finished"] and kls[-1] < kls[0] and 0 <= full["heldout"]["greedy_agreement"] <= 1
    assert json.loads((tmp_path / "full" / "training.json").read_text())["heldout_split"].startswith("one document")
    with pytest.raises(TrainError, match="already holds a trained result"):  # no silent overwrite
        train(target, data, tmp_path / "full", cfg, progress=False, log=lambda *_: None)
    part = train(target, data, tmp_path / "split", cfg, stop_after=5, progress=False, log=lambda *_: None)
    assert not part["finished"]
    resumed = train(target, data, tmp_path / "split", cfg, resume=True, progress=False, log=lambda *_: None)
    a, b = full["draft"].state_dict(), resumed["draft"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    engine = export_engine(target, tmp_path / "engine", draft_dir=tmp_path / "full", log=lambda *_: None,
                           cfg=ExportConfig(max_len=48, prefill_chunk=16))
    rt = specrt.load(engine)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = rt.generate(prompt, max_new_tokens=16, method="draft", gamma=3)
    assert out.token_ids == rt.generate(prompt, max_new_tokens=16, method="none").token_ids and out.stats["proposed"]
