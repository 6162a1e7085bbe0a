# Item 4c: stale cache contents beyond the valid length must not matter with shared buffers (rollback = set length).
# Fill positions >= P of every buffer with NaN (and with 1e4), run decode / verify / tree; compare logits with a zero-filled run;
# then rollback check: run Q=5 at P, "accept" 2 (length P+2), run Q=1 and compare with a fresh cache holding only P+2 entries.
import sys, json; sys.path.insert(0, '/tmp/i19')
import numpy as np
from proto_runner import FusedRunner
rng = np.random.default_rng(0); P = 200
r = FusedRunner("/tmp/i19/fused.onnx")
base = rng.standard_normal(r.cache[:, :, :, :P].shape).astype(np.float32)
tm = np.array([[1,0,0,0,0,0,0,0],[1,1,0,0,0,0,0,0],[1,0,1,0,0,0,0,0],[1,1,0,1,0,0,0,0],[1,1,0,0,1,0,0,0],[1,0,1,0,0,1,0,0],[1,1,0,1,0,0,1,0],[1,0,1,0,0,1,0,1]], bool)
for name, ids, pos, blk in (("decode", [5], None, None), ("verify", [5, 6, 7, 8, 9], None, None), ("tree", list(range(10, 18)), P + tm.sum(-1) - 1, tm)):
    outs = {}
    for fill in ("zero", "nan", "big"):
        r.cache[:] = {"zero": 0.0, "nan": np.nan, "big": 1e4}[fill]; r.cache[:, :, :, :P] = base; r.length = P
        outs[fill] = r.forward(ids, pos, blk).copy()
    print(f"{name}: |nan-fill - zero-fill| {np.nanmax(np.abs(outs['nan'] - outs['zero'])) if not np.isnan(outs['nan']).any() else 'NaN in output'}, "
          f"|1e4-fill - zero-fill| {np.abs(outs['big'] - outs['zero']).max():.1e}")
# rollback: verify 5 tokens, keep 2, then decode one; vs a clean cache built by feeding the 2 kept tokens
r.cache[:] = np.nan; r.cache[:, :, :, :P] = base; r.length = P
r.forward([5, 6, 7, 8, 9]); r.length = P + 2; a = r.forward([42]).copy()
r2 = FusedRunner("/tmp/i19/fused.onnx"); r2.cache[:, :, :, :P] = base; r2.length = P
r2.forward([5, 6]); r2.length = P + 2; b = r2.forward([42]).copy()
print(f"rollback (verify Q=5, keep 2, decode 1) vs clean: max|diff| {np.abs(a - b).max():.1e}")
