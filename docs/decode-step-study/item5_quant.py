# Item 5: int4 MatMulNBits (MatMul4BitsQuantizer, block 32, symmetric, accuracy_level 0 and 4) and dynamic int8
# (quantize_dynamic, QInt8 weights) on target.onnx and int4 on fused.onnx; parity = logits diff on a random decode
# step + greedy agreement (64 tokens x 3 prompts) vs fp32; interleaved step timing, 1 thread.
import sys, logging; sys.path.insert(0, '/tmp/i19'); logging.disable(logging.WARNING)
from common import *
import onnx, json
from onnxruntime.quantization import quantize_dynamic, QuantType
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer, DefaultWeightOnlyQuantConfig
def int4(src, dst, acc):
    cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=acc)
    q = MatMulNBitsQuantizer(onnx.load(src), algo_config=cfg); q.process(); q.model.save_model_to_file(dst, False)
    return dst
paths = {"fp32": TARGET,
         "int4_acc0": int4(TARGET, "/tmp/i19/target_int4_a0.onnx", 0),
         "int4_acc4": int4(TARGET, "/tmp/i19/target_int4_a4.onnx", 4)}
quantize_dynamic(TARGET, "/tmp/i19/target_int8dyn.onnx", weight_type=QuantType.QInt8); paths["int8_dynamic"] = "/tmp/i19/target_int8dyn.onnx"
int4("/tmp/i19/fused.onnx", "/tmp/i19/fused_int4_a4.onnx", 4)
for k, p in paths.items():
    print(k, "ops:", dict(count_ops(p).most_common(4)), "file MB", round(sum(os.path.getsize(x) for x in [p]) / 1e6, 1))
ss = {k: sess(p, 1) for k, p in paths.items()}
f1, f5 = feeds(200, 1), feeds(200, 5)
ref1 = ss["fp32"].run(None, f1)[0]
ids = json.loads(open("/tmp/i19/prompt_ids.json").read())
def greedy(s, prompt, n=64):
    f = {"input_ids": np.array([prompt], np.int64), "position_ids": np.arange(len(prompt))[None].astype(np.int64)}
    P = 0; past = [np.zeros((0, 1, H, D), np.float32)] * (2 * L); out = []; q = len(prompt)
    for step in range(n):
        m = np.zeros((1, 1, q, P + q), np.float32); m[..., P:] = np.triu(np.full((q, q), MASK_MIN, np.float32), 1)
        f["attention_mask"] = m
        for i in range(L): f[f"past_key.{i}"] = past[2 * i]; f[f"past_value.{i}"] = past[2 * i + 1]
        r = s.run(None, f)
        past = [np.concatenate([a, b]) for a, b in zip(past, r[1:])]; P += q
        t = int(r[0][0, -1].argmax()); out.append(t); q = 1
        f["input_ids"] = np.array([[t]], np.int64); f["position_ids"] = np.array([[P]], np.int64)
    return out
gref = [greedy(ss["fp32"], x) for x in ids]
for k, s in ss.items():
    if k == "fp32": continue
    g = [greedy(s, x) for x in ids]
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(gref, g)]
    same = np.mean([np.mean(np.array(x) == np.array(y)) for x, y in zip(gref, g)])
    print(f"{k}: decode logits max|diff| {np.abs(s.run(None, f1)[0]-ref1).max():.3f} (logit range {ref1.min():.1f}..{ref1.max():.1f}); greedy identical-prefix lengths {agree} of 64; position-wise agreement {same:.2f}")
for q, f in ((1, f1), (5, f5)):
    r = interleave({k: (lambda s=s: s.run(None, f)) for k, s in ss.items()}, reps=7, n=30)
    print(f"Q={q} 1 thread (plain run): " + ", ".join(f"{k} {v*1e6:.0f} us ({r['fp32']/v:.2f}x)" for k, v in r.items()), flush=True)
