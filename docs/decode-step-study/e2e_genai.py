# ORT GenAI greedy decoding of the builder's fp32 model (intra_op_num_threads=1 in genai_config): same token ids as input
import sys, time, json
import onnxruntime_genai as og
ids = json.loads(sys.argv[1])
model = og.Model("/tmp/i19/genai_fp32_t1")
def gen(x, n):
    p = og.GeneratorParams(model); p.set_search_options(max_length=len(x) + n, do_sample=False)
    g = og.Generator(model, p); g.append_tokens(x); out = []
    while not g.is_done():
        g.generate_next_token(); out.append(int(g.get_next_tokens()[0]))
    return out
gen(ids[0], 16)
n, t, toks = 0, 0.0, []
for x in ids:
    t0 = time.perf_counter(); o = gen(x, 128); t += time.perf_counter() - t0
    n += len(o); toks.append(o)
print(json.dumps({"tok_s": n / t, "n": n, "toks": toks}))
