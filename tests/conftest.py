"""Tiny models and engine dirs, built once per test session (random weights, no hub; heads trained here)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import ARCHS, EAGLE_TREE, HEADS_TARGET, MEDUSA_TREE, make_model, sample_corpus  # noqa: E402



@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def build_engine(tmp_path_factory):
    """build_engine(name, target=dict(...), draft=dict(...)|None, gamma=4, max_len=64) -> engine dir."""
    from specrt.export.onnx_export import ExportConfig, export_engine

    cache: dict = {}

    def build(name, target, draft=None, gamma=4, max_len=64, prefill_chunk=16, dtype="fp32", graph="auto",
              quantize=None):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            t = make_model(root / "target", **target)
            d = make_model(root / "draft", **draft) if draft else None
            cache[name] = export_engine(t, root / "engine", draft_dir=d, log=lambda *_: None,
                                        cfg=ExportConfig(gamma=gamma, max_len=max_len, prefill_chunk=prefill_chunk,
                                                         dtype=dtype, graph=graph, quantize=quantize))
        return cache[name]

    return build


@pytest.fixture(scope="session")
def llama_engine(build_engine):
    """Llama target (vocab 32) with a differently-seeded draft; gamma 4, max_len 64."""
    return build_engine("llama", dict(arch="llama", seed=0, scale=30.0), dict(arch="llama", seed=1, hidden=16,
                                                                               layers=1, scale=30.0))


@pytest.fixture(scope="session")
def llama_fused_engine(build_engine):
    """As ``llama_engine`` with a target of head_dim 16 (hidden 64): the fused graph (kv_layout in_place)."""
    return build_engine("llama_fused", dict(arch="llama", seed=0, scale=30.0, hidden=64),
                        dict(arch="llama", seed=1, hidden=16, layers=1, scale=30.0))  # draft: traced (head_dim 4)


# ---- a tiny target with Medusa heads and with an EAGLE head, trained on text it wrote ----------------
@pytest.fixture(scope="session")
def medusa_trained(tmp_path_factory):
    """A tiny target, a corpus it wrote, and 3 Medusa heads trained on it (test_medusa checks the training)."""
    from specrt.tools.train.medusa import TrainConfig, train

    root = tmp_path_factory.mktemp("medusa")
    target = make_model(root / "target", **HEADS_TARGET)
    data = sample_corpus(target, root / "data")
    cfg = TrainConfig(heads=3, steps=60, batch=8, seq=32, lr=3e-3, eval_every=20, save_every=30, eval_windows=8)
    result = train(target, [str(data)], root / "heads", cfg, progress=False, log=lambda *_: None)
    return {"root": root, "target": target, "data": data, "heads": root / "heads", "result": result}


@pytest.fixture(scope="session")
def medusa_engine(medusa_trained):
    from specrt.export.onnx_export import ExportConfig, export_engine
    from specrt.trees import compile_tree

    t = medusa_trained
    return export_engine(t["target"], t["root"] / "engine", log=lambda *_: None,
                         cfg=ExportConfig(gamma=3, max_len=32, prefill_chunk=16),
                         medusa_dir=t["heads"], tree=compile_tree(MEDUSA_TREE, "test-12"))


@pytest.fixture(scope="session")
def eagle_trained(tmp_path_factory):
    """The same kind of target with an EAGLE head trained on its text (test_eagle checks the training)."""
    from specrt.tools.train.eagle import EagleTrainConfig, train

    root = tmp_path_factory.mktemp("eagle")
    target = make_model(root / "target", **HEADS_TARGET)
    data = sample_corpus(target, root / "data")
    cfg = EagleTrainConfig(steps=60, batch=8, seq=32, lr=3e-3, eval_every=20, save_every=30, eval_windows=8)
    result = train(target, [str(data)], root / "head", cfg, progress=False, log=lambda *_: None)
    return {"root": root, "target": target, "data": data, "head": root / "head", "result": result}


@pytest.fixture(scope="session")
def eagle_engine(eagle_trained):
    from specrt.export.onnx_export import ExportConfig, export_engine

    t = eagle_trained
    return export_engine(t["target"], t["root"] / "engine", log=lambda *_: None,
                         cfg=ExportConfig(gamma=3, max_len=48, prefill_chunk=16), eagle_dir=t["head"],
                         eagle_tree=EAGLE_TREE)


@pytest.fixture(scope="session")
def specrt_attention() -> str:
    """"specrt" where specrt's attention kernel builds here (custom_ops/); else the test is skipped, saying why."""
    from specrt.custom_ops import KernelBuildError, KernelError, attention_library

    try:
        attention_library()
    except KernelBuildError:
        raise  # the compiler is there and our source does not compile: a failure, not a skip
    except KernelError as e:
        pytest.skip(str(e).splitlines()[0])
    return "specrt"
