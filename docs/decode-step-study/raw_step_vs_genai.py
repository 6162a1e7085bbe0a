# One step of specrt's fused graph vs ORT GenAI's builder graph, same ORT, same shared-buffer binding, 1 thread.
# usage: python raw_step_vs_genai.py P OURS_INT4.onnx OURS_FP32.onnx  (GenAI models built into /tmp/genai_int4, /tmp/i19/genai_fp32)
import numpy as np, onnxruntime as ort, time, sys
MASK_MIN = -65504.0
L, H, D, V, MAX = 8, 4, 64, 4096, 1024
P = int(sys.argv[1]) if len(sys.argv) > 1 else 100
def sess(p):
    o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.inter_op_num_threads = 1
    return ort.InferenceSession(p, o, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
def ours(path, bias=True):
    s = sess(path); b = s.io_binding(); cache = rng.standard_normal((2*L, 1, H, MAX, D)).astype(np.float32)
    for i in range(L):
        for j, kv in ((2*i, "key"), (2*i+1, "value")):
            a = cache[j]; b.bind_input(f"past_{kv}.{i}", "cpu", 0, np.float32, a.shape, a.ctypes.data); b.bind_output(f"present_{kv}.{i}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
    lg = np.empty((1,1,V), np.float32); b.bind_output("logits", "cpu", 0, np.float32, lg.shape, lg.ctypes.data)
    f = {"input_ids": np.array([[5]]), "position_ids": np.array([[P]]), "attention_mask": np.zeros((1,1,1,P+1), np.float32), "seqlens_k": np.array([P], np.int32), "total_sequence_length": np.array(P+1, np.int32)}
    def run():
        for k, a in f.items(): b.bind_cpu_input(k, a)
        s.run_with_iobinding(b)
    return run, (cache, f, lg)
def genai(path):
    s = sess(path); b = s.io_binding(); cache = rng.standard_normal((2*L, 1, H, MAX, D)).astype(np.float32)
    for i in range(L):
        for j, kv in ((2*i, "key"), (2*i+1, "value")):
            a = cache[j]; b.bind_input(f"past_key_values.{i}.{kv}", "cpu", 0, np.float32, a.shape, a.ctypes.data); b.bind_output(f"present.{i}.{kv}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
    lg = np.empty((1,1,V), np.float32); b.bind_output("logits", "cpu", 0, np.float32, lg.shape, lg.ctypes.data)
    f = {"input_ids": np.array([[5]]), "attention_mask": np.ones((1, P+1), np.int64)}
    def run():
        for k, a in f.items(): b.bind_cpu_input(k, a)
        s.run_with_iobinding(b)
    return run, (cache, f, lg)
fns = {"ours int4": ours(sys.argv[2]), "genai int4": genai("/tmp/genai_int4/model.onnx"), "ours fp32": ours(sys.argv[3]), "genai fp32": genai("/tmp/i19/genai_fp32/model.onnx")}
for fn, _ in fns.values():
    for _ in range(30): fn()
res = {k: [] for k in fns}
for rep in range(9):
    for k, (fn, _) in fns.items():
        t = time.perf_counter()
        for _ in range(200): fn()
        res[k].append((time.perf_counter() - t) / 200 * 1e6)
print(P, {k: round(float(np.median(v))) for k, v in res.items()})
