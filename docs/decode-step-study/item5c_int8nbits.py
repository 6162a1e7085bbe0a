# Item 5c: MatMulNBits 8-bit (bits=8, block 32, symmetric, accuracy_level 4) on fused.onnx; and int4 excluding lm_head on fused.onnx.
# Parity = greedy 128 tokens x 5 prompts with the prototype FusedRunner vs fused fp32; timing = interleaved decode steps (Q=1, Q=5) at P=200.
import sys, logging, json; sys.path.insert(0, '/tmp/i19'); logging.disable(logging.WARNING)
import onnx, numpy as np
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer, DefaultWeightOnlyQuantConfig
from proto_runner import FusedRunner, greedy
from common import interleave, feeds, MASK_MIN
def q(dst, bits, excl=()):
    cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=bits)
    m = MatMulNBitsQuantizer(onnx.load("/tmp/i19/fused.onnx"), algo_config=cfg, nodes_to_exclude=list(excl)); m.process(); m.model.save_model_to_file(dst, False)
    return dst
m = onnx.load("/tmp/i19/fused.onnx"); lm = [n.name for n in m.graph.node if n.output[0] == "logits"]
paths = {"fp32": "/tmp/i19/fused.onnx", "nbits8": q("/tmp/i19/fused_int8nb.onnx", 8), "int4": "/tmp/i19/fused_int4_a4.onnx",
         "int4_lm_fp32": q("/tmp/i19/fused_int4_nolm.onnx", 4, lm)}
ids = json.loads(json.load(open("/tmp/i19/e2e_ids.json")) if False else open("/tmp/i19/prompt_ids5.json").read())
rs = {k: FusedRunner(p) for k, p in paths.items()}
ref = [greedy(rs["fp32"], x, 128) for x in ids]
for k, r in rs.items():
    if k == "fp32": continue
    g = [greedy(r, x, 128) for x in ids]
    print(f"{k}: greedy identical-prefix vs fp32 {[next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 128) for x, y in zip(ref, g)]} of 128", flush=True)
for qq in (1, 5):
    fns = {}
    for k, r in rs.items():
        r.length = 200; toks = list(range(1, qq + 1))
        fns[k] = (lambda r=r, toks=toks: r.forward(toks))
    res = interleave(fns, reps=7, n=30)
    print(f"P=200 Q={qq} 1 thread: " + ", ".join(f"{k} {v*1e6:.0f} us ({res['fp32']/v:.2f}x)" for k, v in res.items()), flush=True)
