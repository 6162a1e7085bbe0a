import json, statistics
import specrt
from specrt.export.onnx_export import ExportConfig, export_engine
from specrt.tools.demo_engines import DEMO_MODELS, demo_engine_dir
from specrt.tools.prompts import CODE
new = export_engine(DEMO_MODELS / "target", "/tmp/newdraft_engine", draft_dir="/tmp/newdraft",
                    cfg=ExportConfig(max_len=1024), force=True, log=lambda *a: None)
rts = {"committed draft": specrt.load(demo_engine_dir(log=lambda *a: None)), "specrt train draft": specrt.load(new)}
res = {}
for rep in range(3):
    for name, rt in rts.items():
        for gamma in (4, None):
            tok = sec = acc = prop = passes = 0
            for p in CODE:
                o = rt.generate(p, max_new_tokens=128, method="draft", gamma=gamma)
                s = o.stats
                tok += s["new_tokens"]; sec += s["seconds"]; acc += s["accepted"]; prop += s["proposed"]; passes += s["target_passes"]
            res.setdefault((name, gamma), []).append({"tps": tok / sec, "acc": acc / max(prop, 1), "tpp": tok / passes})
for (name, gamma), v in res.items():
    print(f"{name:<22} gamma={gamma}: {statistics.median(x['tps'] for x in v):.0f} tok/s, accepted share "
          f"{statistics.median(x['acc'] for x in v):.3f}, tokens/pass {statistics.median(x['tpp'] for x in v):.2f}")
