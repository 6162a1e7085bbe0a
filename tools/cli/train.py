"""`specrt train`: train what speculates for a target: ``medusa`` heads, an ``eagle`` head, a ``draft`` model."""
from __future__ import annotations

import click


def training_options(f):
    """Options every head trainer takes: data, schedule, checkpointing."""
    for option in reversed(_TRAINING_OPTIONS):
        f = option(f)
    return f


_TRAINING_OPTIONS = [
    click.option("--target", required=True, type=click.Path(exists=True, file_okay=False),
                 help="Local HF checkpoint dir of the target (frozen)."),
    click.option("--data", required=True, multiple=True,
                 help="Training text: a file, a directory (its text files), a glob, or JSONL of {\"text\"}, OpenAI "
                      "{\"messages\"} or ShareGPT {\"conversations\"} records (rendered with the target's chat "
                      "template). Repeatable."),
    click.option("--heldout", multiple=True, help="Held-out text (same forms). Default: every 20th document; one "
                                                  "document is split by blocks of 40 lines."),
    click.option("--steps", default=400, show_default=True, type=click.IntRange(1)),
    click.option("--batch", default=8, show_default=True, type=click.IntRange(1)),
    click.option("--seq", default=256, show_default=True, type=click.IntRange(8), help="Tokens per window."),
    click.option("--lr", default=1e-3, show_default=True, type=float),
    click.option("--eval-every", default=50, show_default=True, type=click.IntRange(1)),
    click.option("--save-every", default=50, show_default=True, type=click.IntRange(1)),
    click.option("--seed", default=0, show_default=True, type=int),
    click.option("--threads", default=1, show_default=True, type=click.IntRange(1)),
    click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "fp32"])),
    click.option("--features", default="", type=click.Path(file_okay=False),
                 help="Cache the frozen target's outputs (hidden states, top-32 tokens) in this dir, computed once "
                      "for all steps (tools/train/features.py): far cheaper steps on a large target."),
    click.option("--resume", is_flag=True, help="Continue the run from OUT/checkpoint.pt (same options)."),
    click.option("--force", is_flag=True, help="Replace a trained result already in OUT."),
    click.option("--stop-after", default=None, type=click.IntRange(1), help="Stop after this step (checkpointed)."),
]


def run_trainer(module: str, config: str, options: dict, target, data, heldout, out, resume, stop_after,
                force: bool = False) -> None:
    """Build ``tools/train/<module>.py``'s ``config`` from ``options`` and run its ``train``; errors as one line."""
    import importlib

    try:
        trainer = importlib.import_module(f"..train.{module}", __package__)
        from ..train.medusa import TrainError
    except ImportError as e:
        raise click.ClickException(f"training needs torch and transformers: pip install 'specrt[export]' ({e})")
    try:
        trainer.train(target, data, out, getattr(trainer, config)(**options), heldout=heldout or None, resume=resume,
                      stop_after=stop_after, log=click.echo, force=force)
    except TrainError as e:
        raise click.ClickException(str(e))


def _three_layers(value: str) -> tuple:
    """--aux-layers "i,j,k" -> (i, j, k); "" -> () (the default layers)."""
    if not value:
        return ()
    try:
        layers = tuple(int(x) for x in value.split(","))
    except ValueError:
        layers = ()
    if len(layers) != 3 or min(layers) < 0:
        raise click.BadParameter(f"three layer indices >= 0, e.g. 2,4,7; got {value!r}")
    return layers


@click.group()
def train():
    """Train speculative-decoding heads for a target checkpoint (CPU)."""


@train.command()
@training_options
@click.option("--heads", default=4, show_default=True, type=click.IntRange(1, 16), help="Number of heads K.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Heads dir to write.")
@click.option("--layers", default=1, show_default=True, type=click.IntRange(1), help="Residual blocks per head.")
@click.option("--positions", default=0, show_default=True, type=click.IntRange(0),
              help="Positions per window the heads train on, drawn at random (0 = all): cheaper steps.")
@click.option("--distill", default=1.0, show_default=True, type=click.FloatRange(0, 1),
              help="Self-distillation weight: 1 = learn the target's own distribution, 0 = the text's tokens.")
def medusa(target, data, heldout, heads, out, layers, steps, batch, seq, positions, lr, distill, eval_every, save_every, seed,
           threads, dtype, features, resume, force, stop_after):
    """Train K Medusa heads (residual block + linear each, backbone frozen) on TARGET's hidden states."""
    if features:
        raise click.UsageError("--features: EAGLE-1 (--version 1) and draft training only")
    run_trainer("medusa", "TrainConfig", dict(heads=heads, layers=layers, steps=steps, batch=batch, seq=seq,
                                             positions=positions, lr=lr, distill=distill, eval_every=eval_every,
                                             save_every=save_every, seed=seed, threads=threads, dtype=dtype),
                target, data, heldout, out, resume, stop_after, force)


@train.command()
@training_options
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Head dir to write.")
@click.option("--version", "version", default="1", show_default=True, type=click.Choice(["1", "3"]),
              help="1: EAGLE-1 head on the last feature; 3: EAGLE-3 head on three fused layers, trained with "
                   "training-time test.")
@click.option("--w-cls", default=0.1, show_default=True, type=click.FloatRange(0),
              help="Version 1: weight of the CE term (target's distribution vs lm_head of the predicted feature).")
@click.option("--ttt-steps", default=5, show_default=True, type=click.IntRange(1),
              help="Version 3: drafting steps unrolled per window (training-time test).")
@click.option("--ttt-positions", default=0, show_default=True, type=click.IntRange(0),
              help="Version 3: rows per window that steps 2..k train on, drawn at random (0 = all): cheaper steps.")
@click.option("--draft-vocab", default=0, show_default=True, type=click.IntRange(0),
              help="Version 3: the head's vocabulary, the most frequent training tokens (0 = the target's).")
@click.option("--cls-positions", default=0, show_default=True, type=click.IntRange(0),
              help="Version 1 with --features: rows per window the CE term trains on, drawn at random (0 = all): "
                   "cheaper steps.")
@click.option("--aux-layers", default="", callback=lambda ctx, param, v: _three_layers(v),
              help="Version 3: the three target layers fused, e.g. 2,4,7 (the hidden states entering them; "
                   "0 = the embeddings). Default: EAGLE-3's 2, L//2, L-3.")
def eagle(target, data, heldout, out, steps, batch, seq, lr, w_cls, eval_every, save_every, seed, threads, dtype,
          features, resume, force, stop_after, version="1", ttt_steps=5, ttt_positions=0, draft_vocab=0,
          aux_layers=(), cls_positions=0):
    """Train an EAGLE head (fc + one decoder layer over features and tokens; target frozen)."""
    common = dict(steps=steps, batch=batch, seq=seq, lr=lr, eval_every=eval_every, save_every=save_every, seed=seed,
                  threads=threads, dtype=dtype)
    if version == "3":
        if features:
            raise click.UsageError("--features: EAGLE-1 (--version 1) and draft training only")
        run_trainer("eagle3", "Eagle3TrainConfig",
                    dict(common, ttt_steps=ttt_steps, ttt_positions=ttt_positions, draft_vocab=draft_vocab,
                         aux_layers=aux_layers),
                    target, data, heldout, out, resume, stop_after, force)
        return
    run_trainer("eagle", "EagleTrainConfig", dict(common, w_cls=w_cls, features=features or "",
                                                     cls_positions=cls_positions), target, data, heldout, out, resume,
                stop_after, force)


@train.command()
@training_options
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Draft model dir to write (HF format).")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(1), help="Layers of a new draft.")
@click.option("--hidden", default=128, show_default=True, type=click.IntRange(8), help="Hidden size of a new draft.")
@click.option("--attention-heads", default=4, show_default=True, type=click.IntRange(1),
              help="Attention heads of a new draft.")
@click.option("--init", "init", default=None, type=click.Path(exists=True, file_okay=False),
              help="Start from this HF checkpoint (same vocabulary) instead of a new random draft.")
@click.option("--freeze-embeddings", is_flag=True, help="Keep the draft's (tied) embedding / LM head as initialised.")
@click.option("--positions", default=0, show_default=True, type=click.IntRange(0),
              help="With --features: positions per window the KL trains on, drawn at random (0 = all): cheaper steps.")
def draft(target, data, heldout, out, layers, hidden, attention_heads, init, freeze_embeddings, positions, steps, batch,
          seq, lr, eval_every, save_every, seed, threads, dtype, features, resume, force, stop_after):
    """Distil a small draft model from TARGET: KL(p_target || q_draft) on the target's own distributions."""
    run_trainer("draft", "DraftTrainConfig", dict(layers=layers, hidden=hidden, heads=attention_heads, steps=steps,
                                                  batch=batch, seq=seq, lr=lr, eval_every=eval_every,
                                                  save_every=save_every, seed=seed, threads=threads,
                                                  init=str(init or ""), freeze_embeddings=freeze_embeddings,
                                                  features=features or "", positions=positions),
                target, data, heldout, out, resume, stop_after, force)


@train.command()
@click.option("--engine", required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine dir of the target: it writes the continuations (specrt runtime, method none).")
@click.option("--target", default=None, type=click.Path(exists=True, file_okay=False),
              help="The target's HF dir (its chat template renders the chat prompts). Default: the engine dir's "
                   "tokenizer.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Dir for train.jsonl / heldout.jsonl.")
@click.option("--code-prompts", default=240, show_default=True, type=click.IntRange(0),
              help="Stdlib function prompts (signature + docstring) to continue; 16 more from held-out files.")
@click.option("--max-new-tokens", default=192, show_default=True, type=click.IntRange(1))
@click.option("--samples", default=2, show_default=True, type=click.IntRange(0),
              help="Sampled continuations per chat prompt (besides the greedy one).")
@click.option("--temperature", default=0.7, show_default=True, type=click.FloatRange(0))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=None, type=click.IntRange(1))
def data(engine, target, out, code_prompts, max_new_tokens, samples, temperature, max_batch, threads):
    """Self-distillation data: the target continues stdlib function prompts and chat tasks (no benchmark
    prompts); JSONL {"text"} for --data / --heldout of the trainers, and a corpus for `specrt serve
    --suffix-corpus OUT/train.jsonl`."""
    try:
        from ...engines import EngineError
        from ...engines.manifest import load_manifest
        from ..train.self_distill import make_data
    except ImportError as e:
        raise click.ClickException(f"needs the runtime and tokenizers: pip install 'specrt[export]' ({e})")
    if target is None:
        try:
            target = load_manifest(engine).tokenizer_dir
        except EngineError as e:
            raise click.ClickException(str(e))
    try:
        summary = make_data(engine, target, out, code_prompts_n=code_prompts, max_new_tokens=max_new_tokens,
                            samples=samples, temperature=temperature, max_batch=max_batch, threads=threads,
                            log=click.echo)
    except (EngineError, ValueError) as e:
        raise click.ClickException(str(e))
    click.echo(f"{out}: train {summary['train']['documents']} documents / {summary['train']['tokens']} tokens, "
               f"held-out {summary['heldout']['documents']} / {summary['heldout']['tokens']}")
