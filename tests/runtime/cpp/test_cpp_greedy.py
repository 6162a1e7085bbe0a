"""The C++ runtime's greedy tokens (and its stats) equal the Python runtime's, token for token."""
import pytest

import specrt
from specrt.tools.libspecrt import CppEngine

ENGINES = {  # name -> (target, draft): three families, both KV layouts
    "llama_traced": (dict(arch="llama", seed=0, scale=30.0), dict(arch="llama", seed=1, hidden=16, layers=1, scale=30.0), "traced"),
    "llama_fused": (dict(arch="llama", seed=0, scale=30.0, hidden=64), dict(arch="llama", seed=1, hidden=64, layers=1, scale=30.0), "fused"),
    "qwen2": (dict(arch="qwen2", seed=3, scale=30.0), dict(arch="qwen2", seed=4, hidden=16, layers=1, scale=30.0), "auto"),
    "gpt2": (dict(arch="gpt2", seed=5, scale=30.0), dict(arch="gpt2", seed=6, hidden=16, layers=1, scale=30.0), "auto"),
    "mistral_fp16": (dict(arch="mistral", seed=7, scale=30.0), dict(arch="mistral", seed=8, hidden=16, layers=1, scale=30.0), "traced"),
}
MAX_LEN = 64


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, build_engine):
    target, draft, graph = ENGINES[request.param]
    dtype = "fp16" if request.param.endswith("fp16") else "fp32"
    return build_engine(f"cpp_{request.param}", target, draft, gamma=3, max_len=MAX_LEN, graph=graph, dtype=dtype)


def prompts(max_len):
    base = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    return {"one": [3], "five": base[:5], "fills_cache": (base * 10)[: max_len - 12]}


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "suffix"])
def test_cpp_greedy_equals_python(lib, engine, method):
    rt, cpp = specrt.load(engine), CppEngine(lib, engine)
    for name, prompt in prompts(MAX_LEN).items():
        py = rt.generate(prompt, max_new_tokens=40, method=method, gamma=3)
        out = cpp.generate(prompt, max_new_tokens=40, method=method, gamma=3)
        assert out.token_ids == py.token_ids, (name, out.token_ids, py.token_ids)
        assert out.finish_reason == py.finish_reason
        for key in ("target_passes", "proposed", "accepted", "rounds"):
            assert out.stats[key] == py.stats[key], (name, key)
        if name == "fills_cache":  # generation ran until the cache was full
            assert len(prompt) + len(out.token_ids) == MAX_LEN and out.finish_reason == "length"


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_cpp_adaptive_gamma_greedy_equals_plain(lib, engine, method):
    """gamma -1 on an engine dir without defaults.gamma: adaptive γ (gamma_policy.h); greedy output still
    equals plain decoding token for token."""
    cpp = CppEngine(lib, engine)
    for name, prompt in prompts(MAX_LEN).items():
        plain = cpp.generate(prompt, max_new_tokens=40, method="none")
        out = cpp.generate(prompt, max_new_tokens=40, method=method)
        assert out.token_ids == plain.token_ids, name
        assert out.stats["target_passes"] <= plain.stats["target_passes"] + 1  # calibration is not the request's


def test_cpp_on_the_demo_engine(lib, demo_engine):
    """The demo pair (fused graphs, an EOS id, a real vocabulary): C++ == Python for every method."""
    rt, cpp = specrt.load(demo_engine), CppEngine(lib, demo_engine)
    prompt = rt.tokenizer.encode("def fibonacci(n):\n    ").ids
    for ids in (prompt[:1], prompt[:5], prompt * (240 // len(prompt))):
        for method in ("none", "draft", "ngram", "suffix"):
            py = rt.generate(ids, max_new_tokens=64, method=method, gamma=4)
            out = cpp.generate(ids, max_new_tokens=64, method=method, gamma=4)
            assert out.token_ids == py.token_ids, (method, len(ids))
            assert (out.stats["accepted"], out.stats["target_passes"]) == (py.stats["accepted"], py.stats["target_passes"])


def test_stop_ids_eos_and_the_callback(lib, llama_engine):
    rt, cpp = specrt.load(llama_engine), CppEngine(lib, llama_engine)
    plain = cpp.generate([3, 1, 4], max_new_tokens=20, method="none").token_ids
    stop = plain[5]
    out = cpp.generate([3, 1, 4], max_new_tokens=20, method="ngram", stop_token_ids=[stop])
    py = rt.generate([3, 1, 4], max_new_tokens=20, method="ngram", stop_token_ids=[stop])
    assert out.token_ids == py.token_ids == plain[: plain.index(stop) + 1] and out.finish_reason == "stop"
    seen = []
    out = cpp.generate([3, 1, 4], max_new_tokens=20, method="draft", on_token=lambda t: seen.append(t) or len(seen) < 4)
    assert out.finish_reason == "cancelled" and seen == out.token_ids == plain[:4]


def test_the_example_program_prints_one_json_line(cpp_build, llama_engine):
    import json
    import subprocess

    exe = cpp_build / "specrt_generate"
    res = subprocess.run([str(exe), str(llama_engine), "--ids", "3,1,4", "--max-new-tokens", "12", "--method", "draft"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    line = json.loads(res.stdout)
    py = specrt.load(llama_engine).generate([3, 1, 4], max_new_tokens=12, method="draft")
    assert line["token_ids"] == py.token_ids and line["finish_reason"] == py.finish_reason
    assert line["stats"]["target_passes"] >= 1 and 0 < line["stats"]["engine_seconds"] <= line["stats"]["wall_seconds"]
    bad = subprocess.run([str(exe), str(llama_engine), "--ids", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ids takes comma-separated integers" in bad.stderr


def test_sliding_window_matches_python(lib, tmp_path):
    """Mistral with a window of 8 (shorter than prompts and prefill chunks): C++ == Python == masks honoured."""
    import torch
    import transformers as tf

    from specrt.export.onnx_export import ExportConfig, export_engine
    from tiny import make_tokenizer

    cfg = tf.MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=8, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(tmp_path / "src")
    make_tokenizer(tmp_path / "src", 32)
    engine = export_engine(tmp_path / "src", tmp_path / "engine", draft_dir=tmp_path / "src", log=lambda *_: None,
                           cfg=ExportConfig(max_len=64, prefill_chunk=16))
    rt, cpp = specrt.load(engine), CppEngine(lib, engine)
    assert rt.manifest.target.windows == (8, 8)
    for n in (5, 23, 40):
        prompt = [(i * 7 + 3) % 31 + 1 for i in range(n)]
        for method in ("none", "ngram", "draft"):
            py = rt.generate(prompt, max_new_tokens=12, method=method, gamma=3)
            assert cpp.generate(prompt, max_new_tokens=12, method=method, gamma=3).token_ids == py.token_ids


def test_suffix_global_cache_follows_python(lib, llama_engine):
    """A series of requests on one engine handle: the global suffix cache grows as the Python core's
    does (same proposals: same stats), and a repeated request drafts more than its first run."""
    rt, cpp = specrt.load(llama_engine), CppEngine(lib, llama_engine)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [3, 1, 4, 1, 5], [9, 2, 6]]
    accepted = []
    for prompt in prompts:
        py = rt.generate(prompt, max_new_tokens=24, method="suffix", gamma=4)
        out = cpp.generate(prompt, max_new_tokens=24, method="suffix", gamma=4)
        assert out.token_ids == py.token_ids
        assert (out.stats["proposed"], out.stats["accepted"]) == (py.stats["proposed"], py.stats["accepted"])
        accepted.append(out.stats["accepted"])
    assert accepted[2] > accepted[0]  # the repeat drafts from the first run's output
