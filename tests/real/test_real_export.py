"""`specrt export` of a real model with no flags (beyond --quantize) succeeds: SmolLM2-135M in fp32, int8, int4.

The export checks its graphs against PyTorch before it writes an engine dir; on a real model that check must
pass at its defaults (no tolerance option), or a user's first command fails. The exports are the session's
shared engines (conftest.py); one cached from an earlier run of the same sources counts, as the export
writes an engine dir only when every check passed.
"""
import json

import pytest

pytestmark = pytest.mark.real


@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
def test_export_with_no_flags_succeeds(smollm2_export, kind):
    e = smollm2_export(kind)
    assert e.engine_dir is not None, f"`specrt export` ({kind}) failed:\n{e.output[-3000:]}"
    target = json.loads((e.engine_dir / "manifest.json").read_text())["models"]["target"]
    assert target["quantize"] == (None if kind == "fp32" else kind)
    assert target["vocab_size"] == 49152 and target["num_layers"] == 30
    # the padded graph of single-row calls, checked by the export: decode steps equal the verify pass's rows
    assert target["decode_file"] == "target_decode.onnx" and target["decode_parity"]["steps_vs_verify"] == 0.0


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a_gguf_file_converts_to_the_weights_transformers_reads(request, model, tmp_path):
    """export/gguf.py writes the tensors one at a time: the same names and values (bit for bit) as the model
    transformers loads from the file whole (its dequantization and per-architecture renaming)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specrt.export.gguf import convert

    gguf = request.getfixturevalue(f"{model}_gguf")
    source = convert(gguf, tmp_path)
    assert source["dequantized_to"] == "fp32" and (tmp_path / "config.json").is_file()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    ours = {}
    for shard in sorted(set(index.values())):
        ours.update(load_file(tmp_path / shard))
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    want = {n: p for n, p in ref.named_parameters()}  # tied weights once, as the checkpoint holds them
    assert ours.keys() == want.keys()
    assert all(torch.equal(ours[n], want[n].detach()) for n in want)
