# Item 4 timing, interleaved: one step at P=200 (Q=1 decode, Q=5 verify), intra-op threads 1 and 2.
#  cur      : target.onnx, session.run with time-major past views + numpy write of new K/V (what HostRunner does)
#  fusedcat : fused.onnx, session.run, past = head-major prefix views cache[:, :, :P] (strided), present = P+Q copy out
#  fusedshr : fused.onnx, IO binding, one [1,H,MAX,D] buffer per K/V bound ONCE as past and present (GQA writes in place);
#             per step only input_ids/position_ids/mask/seqlens_k/total_sequence_length/logits are re-bound
#  genai    : the ORT GenAI builder's model.onnx run the same way as fusedshr (int64 2D mask, no bias, no position_ids)
import sys; sys.path.insert(0, '/tmp/i19')
from common import *
P, MAX = 200, 1024
rng = np.random.default_rng(0)
tcache = rng.standard_normal((2 * L, MAX, 1, H, D)).astype(np.float32)
hcache = np.ascontiguousarray(tcache.transpose(0, 2, 3, 1, 4))  # [2L,1,H,MAX,D]
pn = [f"past_{kv}.{i}" for i in range(L) for kv in ("key", "value")]
nn = [f"new_{kv}.{i}" for i in range(L) for kv in ("key", "value")]
GENAI = "/tmp/i19/genai_fp32/model.onnx"
def setup(threads, q):
    f = feeds(P, q)
    s_cur = sess(TARGET, threads); outn = [o.name for o in s_cur.get_outputs()]
    fc = dict(f); fc.update({n: tcache[j, :P] for j, n in enumerate(pn)})
    def cur():
        out = dict(zip(outn, s_cur.run(None, fc)))
        for j, n in enumerate(nn): tcache[j, P:P + q] = out[n]
        return out["logits"]
    s_f = sess("/tmp/i19/fused.onnx", threads)
    small = {"input_ids": f["input_ids"], "position_ids": f["position_ids"], "attention_mask": f["attention_mask"],
             "seqlens_k": np.array([P + q - 1], np.int32), "total_sequence_length": np.array(P + q, np.int32)}
    fcat = dict(small); fcat.update({n: hcache[j, :, :, :P] for j, n in enumerate(pn)})
    fouts = [o.name for o in s_f.get_outputs()]
    def fusedcat():
        out = s_f.run(None, fcat)
        return out[0]
    hshr = hcache.copy()
    b = s_f.io_binding(); logits = np.empty((1, q, V), np.float32)
    for j, n in enumerate(pn):
        a = hshr[j]; b.bind_input(n, "cpu", 0, np.float32, a.shape, a.ctypes.data)
        b.bind_output(n.replace("past", "present"), "cpu", 0, np.float32, a.shape, a.ctypes.data)
    b.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
    def fusedshr(_keep=hshr):
        for k, a in small.items(): b.bind_input(k, "cpu", 0, a.dtype, a.shape, a.ctypes.data)
        s_f.run_with_iobinding(b); return logits
    s_g = sess(GENAI, threads); gshr = hcache.copy()
    bg = s_g.io_binding(); glog = np.empty((1, q, V), np.float32)
    gin = {"input_ids": f["input_ids"], "attention_mask": np.ones((1, P + q), np.int64)}
    for i in range(L):
        for j, kv in ((2 * i, "key"), (2 * i + 1, "value")):
            a = gshr[j]
            bg.bind_input(f"past_key_values.{i}.{kv}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
            bg.bind_output(f"present.{i}.{kv}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
    bg.bind_output("logits", "cpu", 0, np.float32, glog.shape, glog.ctypes.data)
    def genai(_keep=gshr):
        for k, a in gin.items(): bg.bind_input(k, "cpu", 0, a.dtype, a.shape, a.ctypes.data)
        s_g.run_with_iobinding(bg); return glog
    # parity of the timed configurations (same random past in all): fused vs cur
    l_cur = cur().copy(); l_cat = fusedcat().copy(); l_shr = fusedshr().copy(); l_g = genai().copy()
    par = f"|fusedcat-cur| {np.abs(l_cat-l_cur).max():.1e} |fusedshr-cur| {np.abs(l_shr-l_cur).max():.1e} |genai-cur| {np.abs(l_g-l_cur).max():.1e}"
    return {"cur": cur, "fusedcat": fusedcat, "fusedshr": fusedshr, "genai": genai}, par
for threads in (1, 2):
    for q in (1, 5):
        fns, par = setup(threads, q)
        r = interleave(fns, reps=9, n=30)
        print(f"threads={threads} Q={q}: " + ", ".join(f"{k} {v*1e6:.0f} us ({r['cur']/v:.2f}x)" for k, v in r.items()) + f"   [{par}]", flush=True)
