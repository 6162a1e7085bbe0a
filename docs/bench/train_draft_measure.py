# specrt train draft on the demo corpus split (the demo target's own), then draft-vs-committed-draft in one run.
import json, statistics, sys, time
from pathlib import Path
from specrt.tools.train.demo import split_corpus
from specrt.tools.train.draft import DraftTrainConfig, train
from specrt.tools.demo_engines import DEMO_MODELS
out = Path("/tmp/newdraft")
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
train_files, held = split_corpus()
cfg = DraftTrainConfig(layers=2, hidden=128, heads=2, steps=steps, batch=8, seq=128, lr=3e-3, eval_every=100,
                       save_every=100, threads=2)
t0 = time.time()
r = train(DEMO_MODELS / "target", [str(f) for f in train_files], out, cfg, heldout=[str(f) for f in held],
          progress=False, log=print)
print("trained in", round(time.time() - t0), "s; held-out", r["heldout"], flush=True)
