# Item 1a: ORT profiling per op type, one decode step (P=200,Q=1) and verify (Q=5), 1 thread.
import sys, json, glob, collections; sys.path.insert(0,'/tmp/i19')
from common import *
for q in (1, 5):
    f = feeds(200, q)
    s = sess(TARGET, 1, profile=f"/tmp/i19/prof_q{q}")
    for _ in range(20): s.run(None, f)
    s.end_profiling()
    s = sess(TARGET, 1, profile=f"/tmp/i19/prof_q{q}")
    N = 200
    for _ in range(N): s.run(None, f)
    p = s.end_profiling()
    ev = json.load(open(p))
    by = collections.Counter(); cnt = collections.Counter(); runs = []
    for e in ev:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by[e["args"]["op_name"]] += e["dur"]; cnt[e["args"]["op_name"]] += 1
        if e.get("cat") == "Session" and e["name"] == "model_run":
            runs.append(e["dur"])
    runs = runs[-N:]
    tot_k = sum(by.values()) / (N + 20 * 0)  # includes warmups in same session? warmup happened in first session
    nrun = len([e for e in ev if e.get("cat") == "Session" and e["name"] == "model_run"])
    print(f"Q={q}: model_run median {statistics.median(runs):.1f} us over {nrun} runs; sum of kernel time/run {sum(by.values())/nrun:.1f} us")
    for op, t in by.most_common():
        print(f"   {op:32s} {t/nrun:8.1f} us/run  {100*t/sum(by.values()):5.1f}%  nodes/run {cnt[op]/nrun:.0f}")
