"""The families beyond the first four (engines/wrapper.py SUPPORTED_ARCHITECTURES), traced graph: export
parity (checked inside export), greedy equal to HF generate across a prefill chunk, tree node logits
equal to their chains; and a draft of another family with the same tokenizer.

Sliding windows on some layers (Gemma 2/3, Qwen2's max_window_layers) or all (Mistral), applied in the
graph, traced and fused: greedy equal to HF past the window, batched rows equal to batch 1, tree logits equal
to chains; an engine dir of the older uniform ``sliding_window`` (applied by the runtime) still runs; and
Gemma 3 270M past its 512-token window at --max-len 2048 where the checkpoint is (SPECRT_GEMMA3_DIR)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import specrt
from reference import (assert_batched_rows_equal_batch1, assert_greedy_equals_hf_past_window, fresh_logits,
                       fresh_runner)
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, example_tree_mask, export_engine
from specrt.runtime.api import Runtime

LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {  # architecture -> (config class name, config kwargs)
    "Qwen3ForCausalLM": ("Qwen3Config", dict(LLAMA_LIKE, head_dim=32)),  # head_dim != hidden / heads
    "GemmaForCausalLM": ("GemmaConfig", dict(LLAMA_LIKE, head_dim=16)),
    # window 8 < max_len 48 on layer 0, full attention on layer 1
    "Gemma2ForCausalLM": ("Gemma2Config", dict(LLAMA_LIKE, head_dim=16, sliding_window=8)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(LLAMA_LIKE, head_dim=16, sliding_window=8,
                                                   layer_types=["sliding_attention", "full_attention"])),
    "Phi3ForCausalLM": ("Phi3Config", LLAMA_LIKE),
    "Olmo2ForCausalLM": ("Olmo2Config", LLAMA_LIKE),
    "OlmoForCausalLM": ("OlmoConfig", LLAMA_LIKE),
    "GraniteForCausalLM": ("GraniteConfig", LLAMA_LIKE),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                 num_attention_heads=4, max_position_embeddings=256)),
    "OPTForCausalLM": ("OPTConfig", dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                         max_position_embeddings=256, word_embed_proj_dim=64)),
    "StableLmForCausalLM": ("StableLmConfig", LLAMA_LIKE),
    "Starcoder2ForCausalLM": ("Starcoder2Config", dict(LLAMA_LIKE, sliding_window=None)),
    "SmolLM3ForCausalLM": ("SmolLM3Config", dict(LLAMA_LIKE, no_rope_layer_interval=2)),  # layer 1 without RoPE
    "PhiForCausalLM": ("PhiConfig", dict(LLAMA_LIKE, partial_rotary_factor=0.5)),
    "FalconForCausalLM": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),  # MQA
    "HeliumForCausalLM": ("HeliumConfig", dict(LLAMA_LIKE, head_dim=16)),
    "CohereForCausalLM": ("CohereConfig", dict(LLAMA_LIKE, logit_scale=0.5)),
}
WINDOWED = {  # name -> (architecture, config kwargs, manifest windows): a window of 8 on some layers or all
    "gemma2": ("Gemma2ForCausalLM", FAMILIES["Gemma2ForCausalLM"][1], [8, None]),
    "gemma3": ("Gemma3ForCausalLM", dict(FAMILIES["Gemma3ForCausalLM"][1], num_hidden_layers=3,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
               [8, None, 8]),
    "qwen2_fused": ("Qwen2ForCausalLM", dict(LLAMA_LIKE, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=1), [None, 8]),
    "mistral_fused": ("MistralForCausalLM", dict(LLAMA_LIKE, sliding_window=8), [8, 8]),
}


def make_family(out, arch: str, seed: int = 0, config: dict | None = None):
    """A random-weight ``arch`` of FAMILIES' config (or ``config``) and a character tokenizer, saved to ``out``."""
    import transformers as tf

    from tiny import make_tokenizer

    cfg_name = getattr(tf, arch).config_class.__name__
    kw = FAMILIES[arch][1] if config is None else config
    cfg = getattr(tf, cfg_name)(vocab_size=32, bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw)
    torch.manual_seed(seed)
    model = getattr(tf, arch)(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(out)
    make_tokenizer(out, 32)
    return out


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_decodes_like_hf(tmp_path, arch):
    src = make_family(tmp_path / "model", arch)
    engine = export_engine(src, tmp_path / "engine", log=lambda *_: None,
                           cfg=ExportConfig(max_len=48, prefill_chunk=16))
    model = load_hf(src)
    rt = specrt.load(engine)
    for n in (1, 5, 23):  # 23: two prefill chunks
        prompt = ((np.arange(n) * 7 + 3) % 31 + 1).tolist()
        hf = hf_greedy(model, prompt, 10)
        for method in ("none", "ngram"):
            out = rt.generate(prompt, max_new_tokens=10, method=method).token_ids
            assert out == hf[: len(out)], (n, method)
    assert_tree_nodes_equal_chains(engine, [3, 10, 17, 24, 31])


def test_a_draft_of_another_family_with_the_same_tokenizer(tmp_path):
    from tiny import make_model

    target = make_model(tmp_path / "target", arch="llama", scale=20.0)
    draft = make_family(tmp_path / "draft", "Qwen3ForCausalLM", seed=3)
    rt = specrt.load(export_engine(target, tmp_path / "engine", draft_dir=draft, log=lambda *_: None,
                                   cfg=ExportConfig(max_len=48, prefill_chunk=16)))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = rt.generate(prompt, max_new_tokens=16, method="draft", gamma=3)
    assert out.token_ids == rt.generate(prompt, max_new_tokens=16, method="none").token_ids
    assert out.stats["proposed"] > 0


def assert_tree_nodes_equal_chains(engine, prompt: list[int]) -> None:
    """After ``prompt``, the 8-node example tree's node logits (nodes 3 and 7) equal the node's root path
    run as a chain."""
    runner = fresh_runner(Runtime.load(engine).target, 48)
    mask, nodes = example_tree_mask().numpy(), np.arange(11, 19)
    runner.prefill(0, prompt)
    tree = runner.forward([0], [nodes], blocks=[mask], depths=[mask.sum(-1) - 1]).logits[0]
    for i in (3, 7):
        runner.release(0)
        chain = runner.forward([0], [prompt + nodes[np.flatnonzero(mask[i])].tolist()]).logits[0, -1]
        np.testing.assert_allclose(tree[i], chain, atol=1e-4)


def hf_greedy(model, prompt, n: int) -> list[int]:
    """HF generate(do_sample=False): the ``n`` tokens after ``prompt`` (no early stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(WINDOWED))
def test_windowed_layers_decode_like_hf_past_the_window(tmp_path, name):
    """A window of 8 on some layers (Gemma 2/3, Qwen2) or all (Mistral) at max_len 48, applied in the graph
    (traced, or fused for Qwen2 and Mistral): greedy equals HF generate past the window (prefill chunks of
    16 > 8; plain, n-gram and draft decoding); rows of different lengths decoded together equal batch 1; tree
    nodes past the window get their chains' logits."""
    arch, config, windows = WINDOWED[name]
    src = make_family(tmp_path / "model", arch, config=config)
    engine = export_engine(src, tmp_path / "engine", draft_dir=src, log=lambda *_: None,
                           cfg=ExportConfig(max_len=48, prefill_chunk=16, gamma=3))
    rt = specrt.load(engine)
    spec = rt.manifest.target
    assert spec.windows == tuple(windows) and spec.sliding_window is None  # nothing left to the runtime
    assert spec.kv_layout == ("in_place" if name.endswith("fused") else "time_major")
    model = load_hf(src)
    seq = ((np.arange(40) * 7 + 3) % 31 + 1).tolist()  # 3 prefill chunks: logits after 40 tokens equal HF's
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0, -1].numpy()
    np.testing.assert_allclose(fresh_logits(rt.target, seq, 48), ref, atol=1e-3)
    for n in (5, 23, 36):
        prompt = seq[:n]
        hf = hf_greedy(model, prompt, 10)
        for method in ("none", "ngram", "draft"):
            out = rt.generate(prompt, max_new_tokens=10, method=method).token_ids
            assert out == hf[: len(out)], (n, method)
    prompts = [((np.arange(n) * 5 + 2) % 31 + 1).tolist() for n in (3, 11, 20, 30)]
    for method in ("none", "draft"):
        assert_batched_rows_equal_batch1(rt, method, prompts, [14, 10, 12, 8])
    assert_tree_nodes_equal_chains(engine, prompts[2])  # a tree at positions 20..23, past the window


def test_an_engine_dir_with_a_uniform_sliding_window_still_runs(tmp_path):
    """Engine dirs exported before per-layer windows: a graph without windows and ``sliding_window`` in the
    manifest, which the runtime applies to the mask; greedy still equals HF (Mistral, window 8) past it."""
    src = make_family(tmp_path / "model", "MistralForCausalLM", config=dict(LLAMA_LIKE, sliding_window=None))
    engine = export_engine(src, tmp_path / "engine", log=lambda *_: None,
                           cfg=ExportConfig(max_len=48, prefill_chunk=16, graph="traced"))
    manifest = json.loads((engine / "manifest.json").read_text())
    assert "windows" not in manifest["models"]["target"]
    manifest["models"]["target"]["sliding_window"] = 8
    (engine / "manifest.json").write_text(json.dumps(manifest))
    rt = specrt.load(engine)
    assert rt.manifest.target.sliding_window == 8
    model = load_hf(src)
    model.config.sliding_window = 8  # the same weights, HF's window
    for n in (5, 30):
        prompt = ((np.arange(n) * 7 + 3) % 31 + 1).tolist()
        hf = hf_greedy(model, prompt, 12)
        for method in ("none", "ngram"):
            out = rt.generate(prompt, max_new_tokens=12, method=method).token_ids
            assert out == hf[: len(out)], (n, method)


@pytest.mark.parametrize("config, match", [
    (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True), "FalconForCausalLM with alibi"),
])
def test_a_family_option_the_graph_cannot_express_is_refused_by_name(tmp_path, config, match):
    from specrt.engines.wrapper import UnsupportedArchitecture

    src = make_family(tmp_path / "model", "FalconForCausalLM", config=config)
    with pytest.raises(UnsupportedArchitecture, match=match):
        export_engine(src, tmp_path / "engine", log=lambda *_: None, cfg=ExportConfig(max_len=48))
    assert not (tmp_path / "engine").exists()


GEMMA3_DIR = os.environ.get("SPECRT_GEMMA3_DIR")  # an HF dir of Gemma 3 270M (Gemma3ForCausalLM, window 512)


@pytest.mark.skipif(not GEMMA3_DIR, reason="needs SPECRT_GEMMA3_DIR: a Gemma 3 270M HF dir (CI runs this check on the packaged model in tests/real/test_real_gemma.py)")
def test_gemma3_270m_decodes_like_hf_past_its_window(tmp_path):
    """Gemma 3 270M exported (traced) at --max-len 2048: a 600-token prompt and 32 new tokens, past its
    512-token window, greedy equal to HF generate."""
    report = assert_greedy_equals_hf_past_window(Path(GEMMA3_DIR), tmp_path / "engine", max_len=2048)
    assert report["past_window"] > 0
