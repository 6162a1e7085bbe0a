"""The families beyond the first four (engines/wrapper.py SUPPORTED_ARCHITECTURES), traced graph: export
parity (checked inside export), greedy equal to HF generate across a prefill chunk, tree node logits
equal to their chains; and a draft of another family with the same tokenizer."""
import numpy as np
import pytest
import torch

import specrt
from reference import fresh_runner
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, example_tree_mask, export_engine
from specrt.runtime.api import Runtime

LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {  # architecture -> (config class name, config kwargs)
    "Qwen3ForCausalLM": ("Qwen3Config", dict(LLAMA_LIKE, head_dim=32)),  # head_dim != hidden / heads
    "GemmaForCausalLM": ("GemmaConfig", dict(LLAMA_LIKE, head_dim=16)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(LLAMA_LIKE, head_dim=16, sliding_window=4096)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(LLAMA_LIKE, head_dim=16, sliding_window=4096)),
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
}


def make_family(out, arch: str, seed: int = 0):
    import transformers as tf

    from tiny import make_tokenizer

    cfg_name, kw = FAMILIES[arch]
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
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                                pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        for method in ("none", "ngram"):
            out = rt.generate(prompt, max_new_tokens=10, method=method).token_ids
            assert out == hf[: len(out)], (n, method)
    runner = fresh_runner(Runtime.load(engine).target, 48)  # tree node logits == the node's path as a chain
    mask = example_tree_mask().numpy()
    nodes = np.arange(11, 19)
    prompt = [3, 10, 17, 24, 31]
    runner.prefill(0, prompt)
    tree = runner.forward([0], [nodes], blocks=[mask], depths=[mask.sum(-1) - 1]).logits[0]
    for i in (3, 7):
        runner.release(0)
        chain = runner.forward([0], [prompt + nodes[np.flatnonzero(mask[i])].tolist()]).logits[0, -1]
        np.testing.assert_allclose(tree[i], chain, atol=1e-4)


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
