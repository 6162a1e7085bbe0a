"""Quantization options and kernels (export/quantize.py, quantize_integer.py, smooth.py, decode_pad.py) and the
export-time verify cost curve (export/latency.py), on a tiny fused graph."""
import json

import numpy as np
import onnx
import pytest

import specrt
from tiny import make_model
from specrt.engines import EngineError
from specrt.engines.manifest import load_manifest
from specrt.engines.ort import OrtEngine
from specrt.export.decode_pad import pad_attention
from specrt.export.fused_call import FusedCall
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, export_engine
from specrt.export.quantize import QuantizeError, parse_options, quantize_proto
from specrt.export.smooth import smooth_inputs

FUSED = dict(arch="llama", hidden=64, scale=20.0, layers=2)  # head_dim 16: GroupQueryAttention's smallest
MAX_LEN = 48
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
TOKENS = [2, 7, 1, 8, 2]  # a verify pass of 5


@pytest.fixture(scope="module")
def fused_proto(tmp_path_factory):
    """The tiny model's fused fp32 graph (a function: each test gets its own copy)."""
    from specrt.export.fused_graph import build_fused_graph

    model = load_hf(make_model(tmp_path_factory.mktemp("m") / "model", **FUSED))
    proto = build_fused_graph(model, MAX_LEN)
    return lambda: onnx.ModelProto.FromString(proto.SerializeToString())


def call_of(proto, tmp_path, name="g.onnx"):
    path = tmp_path / name
    onnx.save(proto, str(path))
    return FusedCall(OrtEngine(path, threads=1), MAX_LEN)


def steps_and_pass(call, q_step: int = 1):
    """(logits of 5 decode steps, each a call of ``q_step`` rows whose first is the token, [5, V]; the verify
    pass of the same 5 tokens [5, V]), after the same prompt."""
    p = len(PROMPT)
    call.run(PROMPT, 0)
    steps = [call.run([t] + [0] * (q_step - 1), p + i)["logits"][0, 0].copy() for i, t in enumerate(TOKENS)]
    return np.stack(steps), call.run(TOKENS, p)["logits"][0].copy()


def test_options_parse_in_order_and_bad_ones_are_named():
    o = parse_options("int4,block=64,attention.acc=1,lm_head.kernel=integer")
    assert (o.block_size, o.attention.accuracy_level, o.mlp.accuracy_level) == (64, 1, 4)
    assert (o.lm_head.bits, o.lm_head.kernel, o.mlp.bits) == (8, "integer", 4)  # int4 keeps its lm_head in int8
    assert parse_options("w8a8").mlp.kernel == "integer" and parse_options("int4,mlp.bits=fp32").mlp.bits is None
    for bad, words in [("int5", "unknown quantization"), ("int4,foo=1", "unknown quantization option"),
                       ("int4,kernel=integer", "8 bits only"), ("int4,block=48", "block size"),
                       ("int4,acc=x", "bad value")]:
        with pytest.raises(QuantizeError, match=words):
            parse_options(bad)


@pytest.mark.parametrize("spec", ["int4", "w8a8,smooth=none"])
def test_rows_of_a_pass_do_not_depend_on_its_length(fused_proto, tmp_path, spec):
    """A decode step run as a 2-row call (its token, then padding) equals the verify pass's row bit for bit:
    the quantized MatMuls are row-independent (MatMulNBits int8 activations per block; the integer kernel's
    per-row scales), so what differs between Q = 1 and Q > 1 is attention's path alone."""
    proto = quantize_proto(fused_proto(), parse_options(spec))
    steps, verify = steps_and_pass(call_of(proto, tmp_path), q_step=2)
    assert np.array_equal(steps, verify)


@pytest.mark.parametrize("spec", ["fp32", "int4", "w8a8,smooth=none"])
def test_a_padded_graph_decodes_exactly_as_it_verifies(fused_proto, tmp_path, spec):
    proto = fused_proto() if spec == "fp32" else quantize_proto(fused_proto(), parse_options(spec))
    steps, verify = steps_and_pass(call_of(proto, tmp_path, "plain.onnx"), q_step=1)  # one-token decode steps
    assert not np.array_equal(steps, verify), "ORT's GQA no longer has a Q = 1 path of its own: the pad is moot"
    assert pad_attention(proto) == FUSED["layers"]
    steps, verify = steps_and_pass(call_of(proto, tmp_path), q_step=1)
    assert np.array_equal(steps, verify)


def test_the_integer_kernel_replaces_every_matmul_and_stays_close(fused_proto, tmp_path):
    ref = call_of(fused_proto(), tmp_path, "ref.onnx").run(PROMPT, 0)["logits"][0].copy()
    proto = quantize_proto(fused_proto(), parse_options("w8a8,smooth=none"))
    ops = [n.op_type for n in proto.graph.node]
    assert "MatMul" not in ops and ops.count("MatMulIntegerToFloat") == 4 * FUSED["layers"] + 1  # qkv, o, gate|up, down; lm_head
    assert ops.count("QuantizeLinear") == 4 * FUSED["layers"] + 1  # one per MatMul input: qkv, o, gate|up, down; lm_head
    got = call_of(proto, tmp_path).run(PROMPT, 0)["logits"][0]
    spread = ref.max(-1) - ref.min(-1)
    assert (np.abs(got - ref).max(-1) / spread).max() < 0.05  # int8 rounding, not a wrong product


def test_smoothing_keeps_the_fp32_function(fused_proto, tmp_path):
    ref = call_of(fused_proto(), tmp_path, "ref.onnx").run(PROMPT, 0)["logits"][0].copy()
    proto = fused_proto()
    n = smooth_inputs(proto, lambda node: True, PROMPT, MAX_LEN)
    assert n == 4 * FUSED["layers"] + 1  # n1 (qkv), att (o), n2 (gate+up), act (down) per layer; the final norm
    got = call_of(proto, tmp_path).run(PROMPT, 0)["logits"][0]
    assert np.abs(got - ref).max() / (ref.max() - ref.min()) < 1e-4


def test_w8a8_export_records_its_kernels_and_verify_curve(tmp_path):
    src = make_model(tmp_path / "model", **FUSED)
    engine = export_engine(src, tmp_path / "e", log=lambda *_: None, cfg=ExportConfig(max_len=MAX_LEN, quantize="w8a8"))
    m = json.loads((engine / "manifest.json").read_text())["models"]["target"]
    q, c = m["quantization"], m["latency"]
    assert q["kernels"] == {"attention": "integer", "mlp": "integer", "lm_head": "integer"} and q["smoothed"] > 0
    assert m["parity"]["scheme"] == "int8"  # judged by int8's floors
    assert 5 in c["q"] and len(c["seconds"]) == len(c["q"]) and min(c["seconds"]) > 0 and c["ratio"][0] == 1.0
    assert load_manifest(engine).target.latency["q"] == c["q"]
    from specrt.custom_ops import int8_code
    from specrt.engines.ort import kernel_pays  # timed on the kernels specrt.load picks here (int8 matmuls: with AMX)

    assert c["ran_on"] == {"attention": "specrt" if kernel_pays() else "ort",
                           "matmul": "specrt" if kernel_pays() and int8_code() else "ort"}
    out = specrt.load(engine).generate([3, 1, 4, 1, 5], max_new_tokens=8, method="none")
    assert len(out.token_ids) >= 1


def test_a_bad_latency_record_is_refused(tmp_path):
    src = make_model(tmp_path / "model", **FUSED)
    engine = export_engine(src, tmp_path / "e", log=lambda *_: None, cfg=ExportConfig(max_len=MAX_LEN))
    path = engine / "manifest.json"
    raw = json.loads(path.read_text())
    raw["models"]["target"]["latency"] = {"q": [1, 2], "seconds": [0.001]}
    path.write_text(json.dumps(raw))
    with pytest.raises(EngineError, match="latency"):
        load_manifest(engine)


def test_a_bad_quantization_is_an_export_error(tmp_path):
    from specrt.export.errors import ExportError

    with pytest.raises(ExportError, match="unknown quantization option"):
        export_engine(make_model(tmp_path / "m", **FUSED), tmp_path / "e", log=lambda *_: None,
                      cfg=ExportConfig(max_len=MAX_LEN, quantize="int4,nope=1"))
