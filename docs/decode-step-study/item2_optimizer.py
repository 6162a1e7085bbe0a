# Item 2: onnxruntime.transformers optimizer on target.onnx: node counts, parity, speed.
import sys, warnings, logging; sys.path.insert(0,'/tmp/i19'); warnings.filterwarnings("ignore")
from common import *
from onnxruntime.transformers.optimizer import optimize_model
from onnxruntime.transformers.fusion_options import FusionOptions
logging.disable(logging.WARNING)
base = count_ops(TARGET)
f1, f5 = feeds(200, 1), feeds(200, 5)
ref = sess(TARGET, 1)
r1, r5 = ref.run(None, f1), ref.run(None, f5)
results = {}
for mt in ["gpt2", "bert", "gpt_neox", "phi", "qwen3"]:
    for lvl in [0, 1, 2, 99]:
        key = f"{mt}_o{lvl}"
        try:
            fo = FusionOptions(mt)
            fo.enable_rotary_embeddings = True
            m = optimize_model(TARGET, model_type=mt, num_heads=4, hidden_size=256, opt_level=lvl, use_gpu=False,
                               optimization_options=fo, only_onnxruntime=False)
            out = f"/tmp/i19/opt_{key}.onnx"; m.save_model_to_file(out)
            c = count_ops(out)
            fused = {k: v for k, v in c.items() if k not in base or k in ("SimplifiedLayerNormalization",)}
            s = sess(out, 1)
            d1 = float(np.abs(s.run(None, f1)[0] - r1[0]).max()); d5 = float(np.abs(s.run(None, f5)[0] - r5[0]).max())
            results[key] = out
            print(f"{key}: nodes {sum(c.values())} (orig {sum(base.values())}); new op types {fused}; parity logits Q1 {d1:.1e} Q5 {d5:.1e}")
        except Exception as e:
            print(f"{key}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
# speed: the distinct-looking ones vs original, after ORT's own ENABLE_ALL
import collections
uniq = {}
for k, p in results.items():
    sig = tuple(sorted(count_ops(p).items()))
    uniq.setdefault(sig, k)
cands = {"orig": TARGET, **{k: results[k] for k in uniq.values()}}
for q, f in ((1, f1), (5, f5)):
    ss = {k: sess(p, 1) for k, p in cands.items()}
    r = interleave({k: (lambda s=s: s.run(None, f)) for k, s in ss.items()}, reps=5, n=30)
    print(f"Q={q} 1 thread: " + ", ".join(f"{k} {v*1e6:.0f} us ({r['orig']/v:.2f}x)" for k, v in r.items()))
