# interleaved end-to-end: alternate specrt / ORT GenAI processes, 5 rounds; generate time only (load excluded)
import subprocess, json, statistics
S = "/work/main/.venv/bin/python"; G = "/tmp/i19/genai-venv/bin/python"
res = {"specrt": [], "genai": []}; first = {}
for r in range(5):
    a = json.loads(subprocess.run([S, "/tmp/i19/e2e_specrt.py"], capture_output=True, text=True, cwd="/tmp").stdout.strip().splitlines()[-1])
    b = json.loads(subprocess.run([G, "/tmp/i19/e2e_genai.py", json.dumps(a["ids"])], capture_output=True, text=True, cwd="/tmp").stdout.strip().splitlines()[-1])
    res["specrt"].append(a["tok_s"]); res["genai"].append(b["tok_s"]); first = (a, b)
    print(f"round {r}: specrt {a['tok_s']:.0f} tok/s ({a['n']} tokens), genai {b['tok_s']:.0f} tok/s ({b['n']} tokens)", flush=True)
a, b = first
agree = [sum(1 for x, y in zip(p, q) if x == y) / max(len(p), 1) for p, q in zip(a["toks"], b["toks"])]
same_prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a["toks"], b["toks"])]
print(f"median specrt {statistics.median(res['specrt']):.0f} tok/s, genai {statistics.median(res['genai']):.0f} tok/s, ratio {statistics.median(res['genai'])/statistics.median(res['specrt']):.2f}")
print(f"token agreement per prompt {agree}; identical prefix lengths {same_prefix}; lengths specrt {[len(p) for p in a['toks']]} genai {[len(q) for q in b['toks']]}")
