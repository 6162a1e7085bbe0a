# Prototype of the proposed runner: fused GQA graph, one head-major [1,Hkv,MAX,D] buffer per layer K/V bound once as
# past AND present (GQA appends in place), per call only ids/positions/mask/seqlens_k/total_sequence_length re-bound.
import sys, time, json
import numpy as np, onnxruntime as ort
MASK_MIN = -65504.0
class FusedRunner:
    def __init__(self, path, threads=1, max_len=1024, L=8, H=4, D=64, V=4096):
        o = ort.SessionOptions(); o.intra_op_num_threads = threads; o.inter_op_num_threads = 1
        o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
        self.cache = np.zeros((2 * L, 1, H, max_len, D), np.float32); self.V = V; self.length = 0
        self.b = self.s.io_binding()
        for i in range(L):
            for j, kv in ((2 * i, "key"), (2 * i + 1, "value")):
                a = self.cache[j]
                self.b.bind_input(f"past_{kv}.{i}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
                self.b.bind_output(f"present_{kv}.{i}", "cpu", 0, np.float32, a.shape, a.ctypes.data)
        self.logits = {}
    def forward(self, ids, positions=None, mask_block=None):
        """ids [Q] after the cache; writes K/V at [length, length+Q) (commit = advance length; rollback = set it)."""
        q, P = len(ids), self.length
        m = np.zeros((1, 1, q, P + q), np.float32)
        m[..., P:] = np.triu(np.full((q, q), MASK_MIN, np.float32), 1) if mask_block is None else np.where(mask_block, 0, MASK_MIN)
        pos = np.arange(P, P + q, dtype=np.int64)[None] if positions is None else np.asarray(positions, np.int64)[None]
        feeds = {"input_ids": np.asarray(ids, np.int64)[None], "position_ids": pos, "attention_mask": m,
                 "seqlens_k": np.array([P + q - 1], np.int32), "total_sequence_length": np.array(P + q, np.int32)}
        for k, a in feeds.items(): self.b.bind_input(k, "cpu", 0, a.dtype, a.shape, a.ctypes.data)
        lg = self.logits.get(q)
        if lg is None: lg = self.logits[q] = np.empty((1, q, self.V), np.float32)
        self.b.bind_output("logits", "cpu", 0, np.float32, lg.shape, lg.ctypes.data)
        self._keep = feeds
        self.s.run_with_iobinding(self.b)
        return lg[0]
def greedy(r, prompt, n):
    r.length = 0; out = []
    lg = r.forward(prompt); r.length += len(prompt)
    for _ in range(n):
        t = int(lg[-1].argmax()); out.append(t)
        if len(out) == n: break
        lg = r.forward([t]); r.length += 1
    return out
if __name__ == "__main__":
    path = sys.argv[1]; ids = json.loads(sys.argv[2])
    r = FusedRunner(path)
    greedy(r, ids[0], 16)
    n, t, toks = 0, 0.0, []
    for x in ids:
        t0 = time.perf_counter(); o = greedy(r, x, 128); t += time.perf_counter() - t0
        n += len(o); toks.append(o)
    print(json.dumps({"tok_s": n / t, "n": n, "toks": toks}))
