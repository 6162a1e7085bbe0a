"""Does the runtime draft what the EAGLE heads predict? (docs/bench/eagle3.md, "Why")

For the committed EAGLE-1 and EAGLE-3 demo heads: greedy `--method eagle` on the 8 code prompts
(a tree every round), recording each round's depth-1 candidates; then the same final sequences
through the target and the head in torch, teacher-forced. Prints, per head, the share of rounds
whose depth-1 candidates hold the token the target emitted next (and top-1), runtime vs torch.

    python docs/bench/eagle_depth1_check.py [WORK_DIR]
"""
import sys
from pathlib import Path

import numpy as np
import torch

import specrt
from specrt.export.eagle3_head import is_eagle3, load_head3
from specrt.export.eagle_head import load_head
from specrt.export.hf_checkpoint import load_hf
from specrt.export.onnx_export import ExportConfig, export_engine
from specrt.tools.prompts import CODE
from specrt.tools.train.eagle3 import unroll

MODELS = Path(specrt.__file__).parent / "tools" / "demo_models"
TREE = {"nodes": 32, "depth": 5, "topk": 8}


def depth1_logits(model, head, seq: list) -> torch.Tensor:
    """[T-1, V] the head's teacher-forced logits: row t scores token t + 2."""
    ids = torch.tensor(seq)[None]
    with torch.no_grad():
        o = model(input_ids=ids, output_hidden_states=True)
        if not is_eagle3(head.dir):
            return unroll(head, o.hidden_states[-1][:, :-1], ids, 1, head.empty_past())[0][1][0]
        g = head.fuse(torch.cat([o.hidden_states[i] for i in head.cfg.aux_layers], -1))[:, :-1]
        lg = unroll(head.step, g, ids, 1, head.empty_past())[0][1][0]  # [T-1, Vd]
        return torch.full((lg.shape[0], model.config.vocab_size), -1e9).index_copy_(1, head.draft_ids(), lg)


def main(work: Path) -> None:
    model = load_hf(MODELS / "target").float().eval()
    for name, head_dir in [("eagle1", MODELS / "eagle"), ("eagle3", MODELS / "eagle3")]:
        engine = work / name
        if not (engine / "manifest.json").exists():
            export_engine(MODELS / "target", engine, eagle_dir=head_dir, eagle_tree=TREE, log=lambda *a, **k: None,
                          force=True, cfg=ExportConfig(gamma=4, max_len=1024))
        rt = specrt.load(engine)
        core, rounds = rt.core("eagle"), []
        propose = core.proposer.propose

        def recording(rows, ks):
            out = propose(rows, ks)
            for row, p in zip(rows, out):
                if p.tree is not None:
                    first = np.flatnonzero(p.tree.depths[1:] == 1)  # node i + 1 sits at depth 1
                    rounds.append((len(row.seq), p.tokens[first].tolist()))
            return out

        core.proposer.propose = recording
        head = (load_head3 if is_eagle3(head_dir) else load_head)(head_dir, model)[0]
        head.dir = head_dir
        hits = np.zeros(4)
        n = 0
        for prompt in CODE:
            rounds.clear()
            ids = rt.encode(prompt)
            seq = ids + rt.generate(ids, max_new_tokens=96, method="eagle", gamma=1).token_ids
            logits = depth1_logits(model, head, seq)
            for length, candidates in rounds:
                if length < len(seq):
                    top = torch.topk(logits[length - 2], TREE["topk"]).indices.tolist()
                    t = seq[length]
                    hits += [t in candidates, t == candidates[0], t in top, t == top[0]]
                    n += 1
        r = hits / n
        print(f"{name}: {n} rounds; runtime depth-1 holds the target's token {r[0]:.3f} (top-1 {r[1]:.3f}); "
              f"torch teacher-forced top-{TREE['topk']} {r[2]:.3f} (top-1 {r[3]:.3f})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/specrt_eagle_depth1"))
