# Item 4b: step time vs past length P (50/200/800), Q=1 and Q=5, 1 thread, interleaved:
# cur (target.onnx + numpy write), fusedshr (fused.onnx, shared buffers, bias+position_ids), nobias (fused_nobias.onnx: chain-only), genai.
import sys; sys.path.insert(0, '/tmp/i19')
src = open('/tmp/i19/item4_timing.py').read().split("for threads in (1, 2):")[0]
from common import *
for P_ in (50, 200, 800):
    g = {}; exec(src.replace("P, MAX = 200, 1024", f"P, MAX = {P_}, 1024"), g)
    for q in (1, 5):
        fns, par = g["setup"](1, q)
        s = g["sess"]("/tmp/i19/fused_nobias.onnx", 1); buf = g["hcache"].copy(); b = s.io_binding(); lg = np.empty((1, q, V), np.float32)
        for j, n in enumerate(g["pn"]):
            b.bind_input(n, "cpu", 0, np.float32, buf[j].shape, buf[j].ctypes.data); b.bind_output(n.replace("past", "present"), "cpu", 0, np.float32, buf[j].shape, buf[j].ctypes.data)
        b.bind_output("logits", "cpu", 0, np.float32, lg.shape, lg.ctypes.data)
        small = {"input_ids": feeds(P_, q)["input_ids"], "seqlens_k": np.array([P_ + q - 1], np.int32), "total_sequence_length": np.array(P_ + q, np.int32)}
        def nobias(_k=(buf, small)):
            for k, a in small.items(): b.bind_input(k, "cpu", 0, a.dtype, a.shape, a.ctypes.data)
            s.run_with_iobinding(b); return lg
        ln = nobias().copy(); lc = fns["cur"]().copy()
        r = interleave({"cur": fns["cur"], "fusedshr": fns["fusedshr"], "nobias": nobias, "genai": fns["genai"]}, reps=7, n=30)
        print(f"P={P_} Q={q}: " + ", ".join(f"{k} {v*1e6:.0f} us ({r['cur']/v:.2f}x)" for k, v in r.items()) + f"  [{par}; |nobias-cur| {np.abs(ln-lc).max():.1e}]", flush=True)
