"""Tiny models and engine dirs, built once per test session (random weights, no hub)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_model  # noqa: E402

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def build_engine(tmp_path_factory):
    """build_engine(name, target=dict(...), draft=dict(...)|None, gamma=4, max_len=64) -> engine dir."""
    from specrt.export.onnx_export import ExportConfig, export_engine

    cache: dict = {}

    def build(name, target, draft=None, gamma=4, max_len=64, prefill_chunk=16, dtype="fp32"):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            t = make_model(root / "target", **target)
            d = make_model(root / "draft", **draft) if draft else None
            cache[name] = export_engine(t, root / "engine", draft_dir=d, log=lambda *_: None,
                                        cfg=ExportConfig(gamma=gamma, max_len=max_len, prefill_chunk=prefill_chunk,
                                                                     dtype=dtype))
        return cache[name]

    return build


@pytest.fixture(scope="session")
def llama_engine(build_engine):
    """Llama target (vocab 32) with a differently-seeded draft; gamma 4, max_len 64."""
    return build_engine("llama", dict(arch="llama", seed=0, scale=30.0), dict(arch="llama", seed=1, hidden=16,
                                                                               layers=1, scale=30.0))
