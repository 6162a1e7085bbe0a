"""SmolLM2-135M-Instruct int4 through libspecrt: the same greedy tokens as the Python runtime, token for token,
with the attention on specrt's kernel (compiled into libspecrt from the same source with the same arithmetic
flags) and on ONNX Runtime's. The tiny models of tests/runtime/cpp have no near-ties to tell a multiply-add
contracted into an FMA from one that is not; this model does (found: an uncontracted build departed at the
first decode step)."""
import os

import pytest

from specrt.tools import libspecrt

pytestmark = pytest.mark.real

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def lib():
    build = libspecrt.build(os.environ.get("SPECRT_CPP_BUILD", libspecrt.DEFAULT_BUILD), log=lambda *_: None)
    return libspecrt.load_library(libspecrt.library_path(build))


@pytest.mark.parametrize("attention", ["specrt", "ort"])
def test_cpp_greedy_equals_python_on_the_real_model(lib, smollm2_export, code_prompts, chat_prompts, attention,
                                                    specrt_attention):
    import specrt

    engine_dir = smollm2_export("int4").engine_dir
    rt = specrt.load(engine_dir, attention=attention)
    cpp = libspecrt.CppEngine(lib, engine_dir, attention=attention)
    assert cpp.attention == attention
    for name, text in {**code_prompts, **chat_prompts}.items():
        ids = rt.encode(text)
        for method in ("none", "suffix"):
            py = rt.generate(ids, max_new_tokens=NEW_TOKENS, method=method, gamma=rt.gamma_max)
            out = cpp.generate(ids, max_new_tokens=NEW_TOKENS, method=method, gamma=rt.gamma_max)
            assert out.token_ids == py.token_ids, (name, method)
