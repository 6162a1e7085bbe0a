"""Both learned proposers for the real SmolLM2-135M-Instruct, in one command (CPU).

    python -m specrt.tools.train.smollm2 --target HF_DIR --out DIR        # or --gguf SmolLM2-135M-Instruct.Q4_1.gguf

1. data   the target writes its own training text (``self_distill.make_data``: stdlib function
          prompts and chat tasks, none of them HumanEval's) on an int4 engine dir of it
          (``--engine``, else exported into DIR/engine-int4) -> DIR/data/{train,heldout}.jsonl;
2. features  the frozen target's hidden states and top-32 next tokens on that text, computed once
          (``features.py``) -> DIR/features/{train,heldout}.npz;
3. eagle  an EAGLE-1 head (``eagle.py``) on those features -> DIR/eagle;
4. draft  a 2-layer draft (hidden 576, the target's layers ``--draft-layers`` and its tied
          embedding, which stays frozen), distilled by KL to the target's top-32 (``draft.py``)
          -> DIR/draft.

Each stage is skipped when its result is already in DIR (re-running continues where it stopped).
DIR/run-STAGES.json records the options and each stage's wall time. Then, e.g.:

    specrt export --target HF_DIR --eagle DIR/eagle --quantize int4 --out engine_eagle
    specrt export --target HF_DIR --draft DIR/draft --quantize int4 --out engine_draft
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

DRAFT_LAYERS = (0, 29)  # the target's first and last layer


def target_draft_init(target_dir: Path, layers, out: Path) -> Path:
    """An HF dir holding a Llama draft made of the target's ``layers`` (its embedding, final norm and tied LM head
    kept): the starting point of the distilled draft."""
    import torch
    from transformers import AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layers)
    for key in ("layer_types",):  # per-layer lists follow the kept layers
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, [getattr(config, key)[i] for i in layers])
    draft = type(target)(config)
    state = target.state_dict()
    mine = {}
    for name in draft.state_dict():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            mine[name] = state[f"model.layers.{layers[int(i)]}.{rest}"]
        else:
            mine[name] = state[name]
    draft.load_state_dict(mine)
    draft.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)
    return out


def every_nth(path: Path, n: int, out: Path) -> None:
    """The JSONL records 0, n, 2n, ... of ``path`` into ``out``."""
    if path.is_file():
        out.write_text("".join(line + "\n" for line in path.read_text().splitlines()[::n]))


def export_engine(target_dir: Path, out: Path) -> Path:
    """An int4 engine dir of the target (for generating the data), exported once."""
    if not (out / "manifest.json").is_file():
        cmd = [sys.executable, "-c", "from specrt.tools.cli import main; main()", "export", "--target",
               str(target_dir), "--quantize", "int4", "--out", str(out), "--force"]
        subprocess.run(cmd, check=True)
    return out


def stage(record: dict, name: str, done: bool, run, out: Path) -> None:
    """Run a stage unless ``done`` or not asked for; its wall time goes into ``record`` and DIR/run-STAGES.json."""
    if name not in record["stages"]:
        return
    if done:
        print(f"[{name}] already done in {out}")
        return
    t0 = time.time()
    print(f"[{name}] ...")
    run()
    record["seconds"][name] = round(time.time() - t0, 1)
    path = out / f"run-{'-'.join(record['stages'])}.json"
    path.write_text(json.dumps(record, indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, help="SmolLM2-135M-Instruct HF dir")
    ap.add_argument("--gguf", type=Path, help="... or its GGUF file (converted to an HF dir once)")
    ap.add_argument("--engine", type=Path, help="an int4 engine dir of the target (default: exported into OUT)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--code-prompts", type=int, default=160, help="stdlib function prompts (train)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--eagle-steps", type=int, default=400)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4, help="windows per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per window")
    ap.add_argument("--positions", type=int, default=32, help="positions per window the LM-head terms train on "
                                                               "(the CE of EAGLE, the KL of the draft)")
    ap.add_argument("--draft-layers", default=",".join(map(str, DRAFT_LAYERS)))
    ap.add_argument("--train-every", type=int, default=4, help="train on every N-th generated document (N = 4: "
                                                               "a quarter of the text and of the target's passes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stages", default="data,eagle,draft", help="which stages to run (e.g. eagle and draft in two "
                                                                 "processes once the features are cached)")
    a = ap.parse_args(argv)
    if not (a.target or a.gguf):
        ap.error("--target HF_DIR or --gguf FILE")
    from ...export.gguf import hf_dir_from_gguf
    from .draft import DraftTrainConfig, train as train_draft
    from .eagle import EagleTrainConfig, train as train_eagle
    from .self_distill import make_data

    target = Path(a.target) if a.target else hf_dir_from_gguf(a.gguf)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    record = {"target": str(target), "options": {k: str(v) for k, v in vars(a).items()}, "seconds": {},
              "stages": a.stages.split(",")}
    data, feats = out / "data", str(out / "features")
    train_data = [str(data / f"train.every{a.train_every}.jsonl")]
    held_data = [str(data / f"heldout.every{a.train_every}.jsonl")]
    layers = tuple(int(x) for x in a.draft_layers.split(","))

    stage(record, "data", (data / "data.json").is_file(), lambda: make_data(
        a.engine or export_engine(target, out / "engine-int4"), target, data, code_prompts_n=a.code_prompts,
        max_new_tokens=a.max_new_tokens, max_batch=16, threads=a.threads), out)
    for name in ("train", "heldout"):
        every_nth(data / f"{name}.jsonl", a.train_every, data / f"{name}.every{a.train_every}.jsonl")
    stage(record, "eagle", (out / "eagle" / "training.json").is_file(), lambda: train_eagle(
        target, train_data, out / "eagle", EagleTrainConfig(steps=a.eagle_steps, batch=a.batch, seq=a.seq, lr=1e-3,
                                                            eval_every=40, eval_windows=8, threads=a.threads,
                                                            features=feats, cls_positions=a.positions),
        heldout=held_data, resume=(out / "eagle" / "checkpoint.pt").is_file()), out)
    stage(record, "draft", (out / "draft" / "training.json").is_file(), lambda: train_draft(
        target, train_data, out / "draft", DraftTrainConfig(
            steps=a.draft_steps, batch=a.batch, seq=a.seq, lr=1e-3, eval_every=40, eval_windows=8, threads=a.threads,
            init=str(target_draft_init(target, layers, out / "draft-init")), freeze_embeddings=True,
            features=feats, positions=a.positions),
        heldout=held_data, resume=(out / "draft" / "checkpoint.pt").is_file()), out)
    print(f"done: {out}/eagle, {out}/draft; wall times {record['seconds']}")


if __name__ == "__main__":
    main()
