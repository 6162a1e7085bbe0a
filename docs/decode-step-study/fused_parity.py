# Item 4 parity: fused.onnx (GQA) vs the torch DecoderWrapper (what target.onnx is traced from) and vs target.onnx,
# for decode (P=200,Q=1), chain verify (Q=5), an 8-node tree (positions P+depth, ancestor mask) and prefill (P=0,Q=37).
# Both K/V modes: "concat" (past [1,H,P,D] in, present [1,H,P+Q,D] out) and "shared" (one [1,H,MAX,D] buffer bound as past and present).
import sys; sys.path.insert(0, '/tmp/i19'); sys.path.insert(0, '/work')
from common import *
import torch
from transformers import AutoModelForCausalLM
from main.engines.wrapper import DecoderWrapper  # specrt's own wrapper (the repo root is the package)
MAX = 1024
model = AutoModelForCausalLM.from_pretrained(HF, dtype=torch.float32, local_files_only=True).eval()
wr = DecoderWrapper(model)
fused = sess("/tmp/i19/fused.onnx", 1)
cur = sess(TARGET, 1)
def tree_mask():
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]; m = np.zeros((8, 8), bool)
    for i, p in enumerate(parents):
        m[i, i] = True
        while p >= 0: m[i, p] = True; p = parents[p]
    return m
def case(P, q, tm=None, seed=1):
    f = feeds(P, q, seed)
    if tm is not None:
        f["attention_mask"][0, 0, :, P:] = np.where(tm, 0, MASK_MIN)
        f["position_ids"] = (P + tm.sum(-1) - 1)[None].astype(np.int64)
    return f
def run_fused(f, P, q, mode):
    b = fused.io_binding(); keep = []
    T_ = P + q
    ff = {"input_ids": f["input_ids"], "position_ids": f["position_ids"], "attention_mask": f["attention_mask"],
          "seqlens_k": np.array([T_ - 1], np.int32), "total_sequence_length": np.array(T_, np.int32)}
    for k, a in ff.items(): b.bind_cpu_input(k, a)
    logits = np.empty((1, q, V), np.float32); b.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
    news = []
    for i in range(L):
        for kv in ("key", "value"):
            tm_ = f[f"past_{kv}.{i}"]  # [P,1,H,D] time-major
            hm = np.ascontiguousarray(tm_.transpose(1, 2, 0, 3))  # [1,H,P,D]
            if mode == "shared":
                buf = np.zeros((1, H, MAX, D), np.float32); buf[:, :, :P] = hm; keep.append(buf)
                b.bind_input(f"past_{kv}.{i}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
                b.bind_output(f"present_{kv}.{i}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
                news.append(buf)
            else:
                keep.append(hm); b.bind_cpu_input(f"past_{kv}.{i}", hm); b.bind_output(f"present_{kv}.{i}", "cpu")
    fused.run_with_iobinding(b)
    if mode != "shared": news = b.copy_outputs_to_cpu()[1:]
    return logits, [n[:, :, P:P + q].transpose(2, 0, 1, 3) for n in news]  # -> [Q,1,H,D]
tm = tree_mask()
for name, (P, q, t) in {"decode": (200, 1, None), "verify": (200, 5, None), "tree": (200, 8, tm), "prefill": (0, 37, None)}.items():
    f = case(P, q, t)
    with torch.no_grad():
        ref = [x.numpy() for x in wr(*[torch.from_numpy(f[n]) for n in [i.name for i in cur.get_inputs()]])]
    c = cur.run(None, f)
    for mode in ("concat", "shared"):
        try:
            lg, kv = run_fused(f, P, q, mode)
            print(f"{name:8s} P={P} Q={q} {mode:6s}: fused-vs-torch logits {np.abs(lg-ref[0]).max():.2e} kv {max(np.abs(a-r).max() for a, r in zip(kv, ref[1:])):.2e};"
                  f" fused-vs-target.onnx logits {np.abs(lg-c[0]).max():.2e}; target.onnx-vs-torch {np.abs(c[0]-ref[0]).max():.2e};"
                  f" argmax agree {np.mean(lg.argmax(-1)==ref[0].argmax(-1)):.2f}")
        except Exception as e:
            print(f"{name} {mode}: FAILED {str(e)[:300]}")
