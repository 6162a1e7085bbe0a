"""Low-memory export (export/lazy_model.py, export/tensor_store.py): a checkpoint read a layer at a time,
graphs written and quantized a tensor at a time, the same engine as a whole-model export."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specrt.export.onnx_export import ExportConfig
from tiny import make_model


def _initializers(path):
    import onnx

    proto = onnx.load(str(path))
    return proto, {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}


def _save(tmp_path, arch="llama", tied=False, dtype=torch.float32, shard=None, hidden=64):
    """A tiny checkpoint in ``dtype``, sharded when ``shard`` (bytes per file) is given."""
    import transformers as tf

    src = make_model(tmp_path / "src", arch=arch, vocab_size=64, hidden=hidden, layers=2, seed=1)
    model = tf.AutoModelForCausalLM.from_pretrained(src)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    out = tmp_path / "ckpt"
    model.to(dtype).save_pretrained(out, max_shard_size=shard or "10GB")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.parametrize("tied,dtype,shard", [(False, torch.float32, None), (True, torch.bfloat16, 40_000)],
                         ids=["fp32", "bf16-tied-sharded"])
def test_a_lazily_read_model_computes_what_the_loaded_one_does(tmp_path, tied, dtype, shard):
    """Its forward equals from_pretrained's bit for bit; afterwards no layer holds weights; ``resident`` loads one."""
    from transformers import AutoModelForCausalLM

    from specrt.export.lazy_model import open_lazy, resident

    src = _save(tmp_path, tied=tied, dtype=dtype, shard=shard)
    if shard:
        assert (src / "model.safetensors.index.json").is_file()
    lazy = open_lazy(src)
    full = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(lazy(input_ids=ids).logits, full(input_ids=ids).logits)
    layers = lazy.model.layers
    assert all(p.is_meta for p in layers.parameters())
    with resident(layers[1]):
        assert torch.equal(layers[1].mlp.up_proj.weight, full.model.layers[1].mlp.up_proj.weight)
    assert layers[1].mlp.up_proj.weight.is_meta
    assert (lazy.lm_head.weight is lazy.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("arch,quantize", [("llama", None), ("llama", "int4"), ("qwen2", "int8"),
                                           ("mistral", "w8a8")])
def test_a_low_memory_export_writes_the_engine_a_whole_model_export_writes(tmp_path, arch, quantize):
    """Every graph file: the same nodes and the same tensors (quantized, smoothed) bit for bit; the manifest says
    how it was read. A quantized low-memory export is judged on the calibration text only, as any quantized one."""
    from specrt.export.onnx_export import export_engine

    src = _save(tmp_path, arch=arch, shard=60_000)
    out = {}
    for mode in ("off", "on"):
        cfg = ExportConfig(gamma=3, max_len=48, prefill_chunk=8, quantize=quantize, low_memory=mode)
        out[mode] = export_engine(src, tmp_path / mode, cfg=cfg, log=lambda *_: None)
    graphs = sorted(p.name for p in out["off"].iterdir() if p.suffix == ".onnx")
    assert graphs == sorted(p.name for p in out["on"].iterdir() if p.suffix == ".onnx")
    for name in graphs:
        (a, ia), (b, ib) = _initializers(out["off"] / name), _initializers(out["on"] / name)
        assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node], name
        assert ia.keys() == ib.keys() and all(np.array_equal(ia[k], ib[k]) for k in ia), name
    manifests = {m: json.loads((out[m] / "manifest.json").read_text())["models"]["target"] for m in out}
    assert manifests["on"]["low_memory"] is True and "low_memory" not in manifests["off"]
    parity = manifests["on"]["parity"]
    if quantize:
        assert list(parity["cases"]) == ["calibration"] and "unquantized" not in parity
    else:
        assert parity["cases"].keys() == manifests["off"]["parity"]["cases"].keys()
    data = out["on"] / "target.onnx.data"  # compacted: no bytes of a tensor the graph no longer reads
    assert data.stat().st_size <= 1.01 * (out["off"] / "target.onnx.data").stat().st_size


@pytest.mark.parametrize("spec", ["int4", "int8", "int4,sym=0,block=64", "int4,block=16,mlp.bits=8"])
def test_matmulnbits_weights_are_onnxruntimes_own(spec):
    """quantize_proto's MatMulNBits tensors equal what ONNX Runtime's MatMulNBitsQuantizer makes of the same MatMul."""
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from specrt.export.quantize import parse_options, quantize_proto

    opts = parse_options(spec)
    rng = np.random.default_rng(0)
    k, n = 80, 24  # K not a multiple of every block size: the padded last block
    w = (rng.standard_normal((k, n)) * rng.uniform(0.1, 3, (k, 1))).astype(np.float32)

    def proto():
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "l0.gate_up.weight"], ["y"], name="l0.gate_up")],
                                  "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n])],
                                  [numpy_helper.from_array(w, "l0.gate_up.weight")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    ours = quantize_proto(proto(), opts)
    bits = opts.mlp.bits
    config = DefaultWeightOnlyQuantConfig(block_size=opts.block_size, is_symmetric=opts.symmetric, bits=bits,
                                          accuracy_level=4)
    q = MatMulNBitsQuantizer(proto(), bits=bits, block_size=opts.block_size, is_symmetric=opts.symmetric,
                             accuracy_level=4, algo_config=config)
    q.process()
    theirs = q.model.model
    a = {i.name: numpy_helper.to_array(i) for i in ours.graph.initializer}
    b = {i.name: numpy_helper.to_array(i) for i in theirs.graph.initializer}
    assert a.keys() == b.keys() and all(np.array_equal(a[x], b[x].reshape(a[x].shape)) for x in a)
    node = next(nd for nd in ours.graph.node if nd.op_type == "MatMulNBits")
    attrs = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    assert attrs == {"K": k, "N": n, "bits": bits, "block_size": opts.block_size, "accuracy_level": 4}


def test_low_memory_on_names_what_it_cannot_read(tmp_path):
    from specrt.export.errors import ExportError
    from specrt.export.onnx_export import export_engine

    gpt2 = make_model(tmp_path / "gpt2", arch="gpt2", vocab_size=32, hidden=16, layers=1)
    with pytest.raises(ExportError, match="cannot be read a layer at a time: GPT2LMHeadModel has no fused graph \(fused: "):
        export_engine(gpt2, tmp_path / "e", cfg=ExportConfig(max_len=16, low_memory="on"), log=lambda *_: None)
    from safetensors.torch import load_file

    llama = make_model(tmp_path / "bin", arch="llama", vocab_size=32, hidden=16, layers=1)
    torch.save(load_file(llama / "model.safetensors"), llama / "pytorch_model.bin")
    (llama / "model.safetensors").unlink()
    with pytest.raises(ExportError, match="its weights are not in safetensors files"):
        export_engine(llama, tmp_path / "e", cfg=ExportConfig(max_len=16, low_memory="on"), log=lambda *_: None)
    assert not (tmp_path / "e").exists()
