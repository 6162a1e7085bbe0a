import time, numpy as np, onnxruntime as ort, os, statistics
ENGINE = "/root/.cache/specrt/demo-933c6aff0322"
TARGET = ENGINE + "/target.onnx"
HF = "/work/main/tools/demo_models/target"
L, H, D, V, HID = 8, 4, 64, 4096, 256
MASK_MIN = -65504.0

def feeds(past=200, q=1, seed=0, b=1):
    rng = np.random.default_rng(seed)
    f = {"input_ids": rng.integers(0, V, (b, q)).astype(np.int64),
         "position_ids": np.arange(past, past+q, dtype=np.int64)[None].repeat(b, 0)}
    m = np.zeros((b, 1, q, past+q), np.float32)
    m[..., past:] = np.triu(np.full((q, q), MASK_MIN, np.float32), 1)
    f["attention_mask"] = m
    for i in range(L):
        f[f"past_key.{i}"] = rng.standard_normal((past, b, H, D)).astype(np.float32)
        f[f"past_value.{i}"] = rng.standard_normal((past, b, H, D)).astype(np.float32)
    return f

def sess(path, threads=1, opt=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, profile=None, **cfg):
    o = ort.SessionOptions(); o.graph_optimization_level = opt
    o.intra_op_num_threads = threads; o.inter_op_num_threads = 1
    if profile: o.enable_profiling = True; o.profile_file_prefix = profile
    for k, v in cfg.items(): o.add_session_config_entry(k, v)
    return ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])

def interleave(fns, reps=7, n=50, warm=10):
    """fns: dict name->callable. returns name->median seconds per call."""
    for f in fns.values():
        for _ in range(warm): f()
    res = {k: [] for k in fns}
    for r in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(n): f()
            res[k].append((time.perf_counter() - t) / n)
    return {k: statistics.median(v) for k, v in res.items()}

def count_ops(path_or_model):
    import onnx, collections
    m = onnx.load(path_or_model) if isinstance(path_or_model, str) else path_or_model
    return collections.Counter(n.op_type for n in m.graph.node)
