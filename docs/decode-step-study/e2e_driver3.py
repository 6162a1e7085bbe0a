# interleaved end-to-end, 5 rounds: specrt (current), ORT GenAI, prototype FusedRunner (fused.onnx fp32), prototype int4 (fused_int4_a4.onnx)
import subprocess, json, statistics
S = "/work/main/.venv/bin/python"; G = "/tmp/i19/genai-venv/bin/python"
names = ["specrt", "genai", "proto_fp32", "proto_int4"]; res = {k: [] for k in names}; last = {}
def run(cmd): return json.loads(subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp").stdout.strip().splitlines()[-1])
for r in range(5):
    a = run([S, "/tmp/i19/e2e_specrt.py"]); ids = json.dumps(a["ids"])
    out = {"specrt": a, "genai": run([G, "/tmp/i19/e2e_genai.py", ids]),
           "proto_fp32": run([S, "/tmp/i19/proto_runner.py", "/tmp/i19/fused.onnx", ids]),
           "proto_int4": run([S, "/tmp/i19/proto_runner.py", "/tmp/i19/fused_int4_a4.onnx", ids])}
    for k in names: res[k].append(out[k]["tok_s"])
    last = out
    print(f"round {r}: " + ", ".join(f"{k} {out[k]['tok_s']:.0f}" for k in names) + " tok/s", flush=True)
med = {k: statistics.median(v) for k, v in res.items()}
print("median tok/s: " + ", ".join(f"{k} {v:.0f} ({v/med['specrt']:.2f}x)" for k, v in med.items()))
ref = last["specrt"]["toks"]
for k in names[1:]:
    pre = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(ref, last[k]["toks"])]
    print(f"{k}: identical-prefix length vs specrt per prompt {pre} (of 128)")
