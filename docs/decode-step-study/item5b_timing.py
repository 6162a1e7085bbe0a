# Item 5b: int4 with the lm_head MatMul left fp32 (greedy agreement), and fused.onnx int4 (acc4) vs fused fp32 with shared buffers.
import sys, logging; sys.path.insert(0, '/tmp/i19'); logging.disable(logging.WARNING)
exec(open('/tmp/i19/item5_quant.py').read().split("paths = {")[0])
import onnx
m = onnx.load(TARGET); inits = {i.name: i for i in m.graph.initializer}
lm = [n.name for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in inits and list(inits[n.input[1]].dims) == [256, 4096]]
print("lm_head node", lm)
cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4)

cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4)
# fused_int4_a4.onnx was written by item5_quant.py
# fused fp32 vs fused int4, shared buffers, interleaved
exec(open('/tmp/i19/item4_timing.py').read().split("for threads in (1, 2):")[0])
# reuse setup(): its 'genai' slot is replaced by a shared-buffer run of fused_int4 built the same way as fusedshr
def setup_int4(threads, q):
    fns, _ = setup(threads, q)  # cur, fusedcat, fusedshr, genai(unused)
    s4 = sess("/tmp/i19/fused_int4_a4.onnx", threads); f = feeds(P, q)
    buf = hcache.copy(); b4 = s4.io_binding(); lg = np.empty((1, q, V), np.float32)
    for j, n in enumerate(pn):
        b4.bind_input(n, "cpu", 0, np.float32, buf[j].shape, buf[j].ctypes.data); b4.bind_output(n.replace("past", "present"), "cpu", 0, np.float32, buf[j].shape, buf[j].ctypes.data)
    b4.bind_output("logits", "cpu", 0, np.float32, lg.shape, lg.ctypes.data)
    small = {"input_ids": f["input_ids"], "position_ids": f["position_ids"], "attention_mask": f["attention_mask"],
             "seqlens_k": np.array([P + q - 1], np.int32), "total_sequence_length": np.array(P + q, np.int32)}
    def fused_int4(_k=(buf, small)):
        for k, a in small.items(): b4.bind_input(k, "cpu", 0, a.dtype, a.shape, a.ctypes.data)
        s4.run_with_iobinding(b4); return lg
    return {"cur": fns["cur"], "fusedshr": fns["fusedshr"], "fusedshr_int4": fused_int4}
for q in (1, 5):
    fns = setup_int4(1, q)
    r = interleave(fns, reps=7, n=30)
    print(f"threads=1 Q={q}: " + ", ".join(f"{k} {v*1e6:.0f} us ({r['cur']/v:.2f}x)" for k, v in r.items()), flush=True)
