"""A malformed or mismatched engine dir gives one clear error naming the problem."""
import json
import shutil

import pytest

import specrt
from specrt.engines import EngineError
from specrt.export.onnx_export import ExportConfig, export_engine
from tiny import make_model


@pytest.fixture
def engine_copy(llama_engine, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(llama_engine, dst)
    return dst


def edit_manifest(engine, fn):
    m = json.loads((engine / "manifest.json").read_text())
    fn(m)
    (engine / "manifest.json").write_text(json.dumps(m))


def test_loads(engine_copy):
    rt = specrt.load(engine_copy)
    assert rt.draft is not None and rt.manifest.gamma == 4


def test_not_a_dir(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        specrt.load(tmp_path / "nope")


def test_missing_manifest(engine_copy):
    (engine_copy / "manifest.json").unlink()
    with pytest.raises(EngineError, match="no manifest.json"):
        specrt.load(engine_copy)


def test_corrupt_manifest(engine_copy):
    (engine_copy / "manifest.json").write_text("{ not json")
    with pytest.raises(EngineError, match="not valid JSON"):
        specrt.load(engine_copy)


def test_unknown_schema_version(engine_copy):
    edit_manifest(engine_copy, lambda m: m.update(schema_version=99))
    with pytest.raises(EngineError, match="schema_version 99 is not supported"):
        specrt.load(engine_copy)


def test_missing_field(engine_copy):
    edit_manifest(engine_copy, lambda m: m["models"]["target"].pop("num_layers"))
    with pytest.raises(EngineError, match="missing field models.target.'num_layers'"):
        specrt.load(engine_copy)


def test_missing_graph_file(engine_copy):
    (engine_copy / "draft.onnx").unlink()
    with pytest.raises(EngineError, match="draft graph file 'draft.onnx' is missing"):
        specrt.load(engine_copy)


def test_corrupt_graph_file(engine_copy):
    (engine_copy / "target.onnx").write_bytes(b"garbage")
    with pytest.raises(EngineError, match="cannot load target.onnx"):
        specrt.load(engine_copy)


def test_graph_does_not_match_manifest(engine_copy):
    shutil.copy(engine_copy / "draft.onnx", engine_copy / "target.onnx")  # draft has 1 layer, target 2
    with pytest.raises(EngineError, match="do not match the manifest"):
        specrt.load(engine_copy)


def test_missing_tokenizer(engine_copy):
    (engine_copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(EngineError, match="tokenizer file .* is missing"):
        specrt.load(engine_copy)


def test_draft_vocab_size_mismatch_at_load(engine_copy):
    edit_manifest(engine_copy, lambda m: m["models"]["draft"].update(vocab_size=99))
    with pytest.raises(EngineError, match="draft vocabulary differs.*99 logits, target 32"):
        specrt.load(engine_copy)


def test_draft_tokenizer_mismatch_at_load(engine_copy):
    edit_manifest(engine_copy, lambda m: m["models"]["draft"].update(vocab_sha256="0" * 64))
    with pytest.raises(EngineError, match="different tokenizer vocabularies"):
        specrt.load(engine_copy)


def test_draft_vocab_mismatch_refused_at_export(tmp_path):
    t = make_model(tmp_path / "t", vocab_size=32)
    d = make_model(tmp_path / "d", vocab_size=40)
    with pytest.raises(EngineError, match="draft vocabulary differs"):
        export_engine(t, tmp_path / "e", draft_dir=d, cfg=ExportConfig(max_len=32), log=lambda *_: None)


def test_unknown_backend(engine_copy):
    with pytest.raises(EngineError, match="unknown backend"):
        specrt.load(engine_copy, backend="tpu")


def test_runtime_runs_without_torch(llama_engine):
    """The runtime (load, generate, every method) must not need torch or transformers."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import specrt\n"
            f"rt = specrt.load({str(llama_engine)!r})\n"
            "for m in ('none', 'draft', 'ngram'):\n"
            "    assert rt.generate([3, 1, 4], max_new_tokens=5, method=m).token_ids\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_an_input_of_another_shape_or_dtype_is_named(engine_copy):
    edit_manifest(engine_copy, lambda m: m["models"]["target"]["inputs"][3].update(shape=["past", "batch", 3, 8]))
    with pytest.raises(EngineError, match=r"input 'past_key.0' is float32 \['past', 'batch', \d+, \d+\] in the graph"
                                          r" but float32 \['past', 'batch', 3, 8\] in the manifest"):
        specrt.load(engine_copy)
