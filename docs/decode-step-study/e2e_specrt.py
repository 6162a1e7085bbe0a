# specrt plain greedy decoding, 1 thread: prints json {tok_s, tokens per prompt}
import sys, time, json; sys.path.insert(0, '/tmp/i19')
import specrt
from e2e_prompts import PROMPTS
rt = specrt.load("/root/.cache/specrt/demo-933c6aff0322", threads=1)
ids = [rt.encode(p) for p in PROMPTS]
rt.generate(ids[0], max_new_tokens=16, method="none")  # warm-up
n, t, toks = 0, 0.0, []
for x in ids:
    t0 = time.perf_counter(); o = rt.generate(x, max_new_tokens=128, method="none"); t += time.perf_counter() - t0
    n += len(o.token_ids); toks.append(o.token_ids)
print(json.dumps({"tok_s": n / t, "n": n, "ids": ids, "toks": toks}))
