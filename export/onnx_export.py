"""Export local HF checkpoints to an engine dir: ONNX graphs, tokenizer, manifest.json.

Every exported graph is run in ONNX Runtime against PyTorch on random inputs for each fixed
shape (decode, chain verify, prefill, and a tree mask); the export fails if the largest
absolute logits difference exceeds the tolerance for its dtype (``TOLERANCE``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..contract import io_names
from ..engines.manifest import FORMAT, SCHEMA_VERSION, check_vocab, load_manifest
from ..engines.ort import OrtEngine
from .medusa_heads import export_heads_graph
from ..engines.wrapper import MASK_MIN, DecoderWrapper, chain_mask, geometry

# Max |logits_ort - logits_torch| allowed at export, per dtype (logits of trained models are O(10)).
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
EXTERNAL_DATA_BYTES = 1 << 30  # models above 1 GiB store weights as external data (protobuf limit is 2 GiB)


class ExportError(RuntimeError):
    pass


@dataclass
class ExportConfig:
    """What `specrt export` builds."""

    gamma: int = 4  # chain-verify draft length: verify shape is gamma + 1
    max_len: int = 2048  # KV cache capacity (prompt + generated tokens)
    dtype: str = "fp32"  # weights and K/V dtype in the graphs: fp32 | fp16
    prefill_chunk: int = 128  # prompt tokens per prefill call
    opset: int = 17  # ONNX opset for the (TorchScript-based) exporter
    with_hidden: bool = False  # also output the last hidden state (Medusa/EAGLE heads need it)
    aux_layers: tuple | None = None  # also output `aux_hidden`: the hidden states entering these layers (EAGLE-3)
    tree_mask: object = None  # bool [N, N] of an exported tree: adds a parity case at the tree-verify shape
    torch_weights: bool = False  # also save each model's HF weights (safetensors) to torch/<role>/ for the torch backend
    graph: str = "auto"  # "fused" (ORT fused ops, KV written in place) | "traced" (torch.onnx) | "auto": fused if possible
    quantize: str | None = None  # MatMul weights: None (as dtype) | "int8" | "int4" (export/quantize.py)
    draft_quantize: str | None = "same"  # the draft's quantization: "same" (as quantize) | None | "int8" | "int4"


def load_hf(model_dir: str | Path, dtype: str = "fp32"):
    """Load a local HF causal LM (never the hub)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir} is not a Hugging Face model dir (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype], local_files_only=True)
    return model.eval()


def vocab_sha256(tokenizer_json: Path) -> str:
    """Hash of the token -> id map (added tokens included), independent of other tokenizer settings."""
    tok = json.loads(tokenizer_json.read_text())
    vocab = dict(tok["model"]["vocab"])
    vocab.update({a["content"]: a["id"] for a in tok.get("added_tokens", [])})
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()


def random_feeds(geo, dtype, past_len: int, q: int, mask: torch.Tensor | None = None, seed: int = 0):
    """Random input_ids/positions/past for a parity check; ``mask`` [q, q] replaces the causal block."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, geo.vocab_size, (1, q), generator=g)
    full = chain_mask(past_len, q, dtype)
    if mask is not None:
        full[0, 0, :, past_len:] = torch.where(mask, torch.zeros((), dtype=dtype), torch.tensor(MASK_MIN, dtype=dtype))
        depth = mask.sum(-1) - 1
        pos = (past_len + depth)[None]
    else:
        pos = torch.arange(past_len, past_len + q)[None]
    past = [torch.randn(past_len, 1, geo.num_kv_heads, geo.head_dim, generator=g).to(dtype)
            for _ in range(2 * geo.num_layers)]
    return [ids, pos, full, *past]


def example_tree_mask() -> torch.Tensor:
    """An 8-node tree (root, 2 children, grandchildren) as a boolean ancestor-or-self mask."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    m = torch.zeros(8, 8, dtype=torch.bool)
    for i, p in enumerate(parents):
        m[i, i] = True
        while p >= 0:
            m[i, p] = True
            p = parents[p]
    return m


def parity_cases(wrapper, geo, cfg: ExportConfig) -> dict:
    """Random feeds and torch reference outputs for each fixed shape (decode, verify, prefill, tree).

    Computed BEFORE tracing: tracing can leave a HF module in a state where later eager calls differ.
    """
    dtype = TORCH_DTYPES[cfg.dtype]
    cases = {"decode": (17, 1, None), "verify": (17, cfg.gamma + 1, None),
             "prefill": (0, min(37, cfg.prefill_chunk), None), "tree": (9, 8, example_tree_mask())}
    if cfg.tree_mask is not None:
        mask = torch.from_numpy(np.array(cfg.tree_mask, dtype=bool))  # a writable copy
        cases["tree_verify"] = (17, len(mask), mask)
    out = {}
    for name, (past, q, mask) in cases.items():
        feeds = random_feeds(geo, dtype, past, q, mask)
        with torch.no_grad():
            out[name] = (feeds, [t.float().numpy() for t in wrapper(*feeds)])
    return out


def check_parity(run, cases: dict, geo, dtype: str, tolerance: float) -> dict:
    """Max |ORT - torch| on logits, new K/V (and hidden) per case; raises ExportError above ``tolerance``.

    run(feeds) -> the traced graph's outputs in order (logits, new K/V..., hidden) as numpy arrays.
    """
    report = {}
    for name, (feeds, ref) in cases.items():
        got = run(feeds)
        diffs = [float(np.abs(g.astype(np.float32) - r).max()) for g, r in zip(got, ref)]
        report[name] = {"logits": diffs[0], "kv": max(diffs[1:1 + 2 * geo.num_layers])}
        if len(ref) > 1 + 2 * geo.num_layers:  # the feature outputs (hidden, aux_hidden)
            report[name]["hidden"] = max(diffs[1 + 2 * geo.num_layers:])
        report[name]["argmax_agreement"] = float((got[0].argmax(-1) == ref[0].argmax(-1)).mean())
        worst = max(v for k, v in report[name].items() if k != "argmax_agreement")
        if worst > tolerance:
            raise ExportError(f"parity check failed for shape {name!r} (Q={feeds[0].shape[1]}): max |ORT - torch| "
                              f"logits {diffs[0]:.2e}, K/V {report[name]['kv']:.2e} > tolerance "
                              f"{tolerance:.0e} ({dtype})")
    return report


def sliding_window(config, max_len: int) -> int | None:
    """The window every layer attends within (HF: key k visible to query q iff pos_k > pos_q - window), or
    None when no window can bite within ``max_len`` tokens; ExportError for a window that bites on some
    layers only (the runtime builds one mask for every layer)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False or window >= max_len:
        return None
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    if "sliding_attention" not in kinds:
        return None
    if kinds != {"sliding_attention"}:
        raise ExportError(f"sliding-window attention (window {window} < --max-len {max_len}) on some layers only "
                          f"(layer_types {sorted(kinds)}) is not supported: the runtime builds one mask for "
                          f"every layer; export with --max-len {window} or less")
    return int(window)


def choose_kv_layout(model, cfg: ExportConfig) -> str:
    """The graph to build: "in_place" (the fused graph) where the model has one, else "time_major" (traced)."""
    from .fused_graph import fused_unsupported

    if cfg.graph == "traced":
        return "time_major"
    reason = fused_unsupported(model, cfg.dtype, cfg.max_len)
    if reason is None:
        return "in_place"
    if cfg.graph == "fused":
        raise ExportError(f"--graph fused: {reason}; use --graph traced (or auto)")
    return "time_major"


def export_graph(model, path: Path, cfg: ExportConfig) -> dict:
    """Export one model to ``path`` (fused or traced, then quantized if asked); returns its manifest entry."""
    from .fused_graph import build_fused_graph, run_in_place

    geo = geometry(model)
    wrapper = DecoderWrapper(model, with_hidden=cfg.with_hidden, aux_layers=cfg.aux_layers)
    window = sliding_window(model.config, cfg.max_len)
    layout = choose_kv_layout(model, cfg)
    cases = parity_cases(wrapper, geo, cfg)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    big = n_bytes > EXTERNAL_DATA_BYTES
    t0 = time.time()
    if layout == "in_place":
        import onnx

        proto = build_fused_graph(model, cfg.max_len, cfg.with_hidden, cfg.aux_layers)
        onnx.save(proto, str(path), save_as_external_data=big, location=path.name + ".data")
    else:
        trace_graph(wrapper, geo, path, cfg, big)
    seconds = time.time() - t0

    def run(engine):
        if layout == "in_place":
            return lambda feeds: run_in_place(engine, feeds, cfg.max_len)
        return lambda feeds: [engine.run({n: t.numpy() for n, t in zip(engine.input_names, feeds)})[n]
                              for n in engine.output_names]

    report = check_parity(run(OrtEngine(path)), cases, geo, cfg.dtype, TOLERANCE[cfg.dtype])
    entry = {}
    if cfg.quantize:
        from .quantize import QUANT_TOLERANCE, QuantizeError, quantize_graph

        try:
            entry["quantization"] = quantize_graph(path, cfg.quantize, external_data=big)
        except QuantizeError as e:
            raise ExportError(str(e)) from None
        # against the fp32 model: the quantized model is a (slightly) different one
        report = check_parity(run(OrtEngine(path)), cases, geo, cfg.quantize, QUANT_TOLERANCE[cfg.quantize])
    in_specs, out_specs = io_specs(geo, layout, cfg.dtype, cfg.with_hidden, cfg.aux_layers)
    return {"file": path.name, **asdict(geo), "dtype": cfg.dtype, "has_hidden": cfg.with_hidden,
            **({"aux_hidden_layers": list(cfg.aux_layers)} if cfg.aux_layers else {}),
            "kv_layout": layout, "quantize": cfg.quantize, **entry,
            **({"sliding_window": window} if window is not None else {}),
            "parameters": sum(p.numel() for p in model.parameters()), "inputs": in_specs, "outputs": out_specs,
            "export_seconds": round(seconds, 1), "parity_max_abs_diff": report,
            "tolerance": QUANT_TOLERANCE[cfg.quantize] if cfg.quantize else TOLERANCE[cfg.dtype]}


def trace_graph(wrapper, geo, path: Path, cfg: ExportConfig, big: bool) -> None:
    """The time-major graph, traced from the torch wrapper by torch.onnx."""
    inputs, outputs = io_names(geo.num_layers, cfg.with_hidden, has_aux=bool(cfg.aux_layers))
    example = random_feeds(geo, TORCH_DTYPES[cfg.dtype], past_len=3, q=2)
    axes = {"input_ids": {0: "batch", 1: "query"}, "position_ids": {0: "batch", 1: "query"},
            "attention_mask": {0: "batch", 2: "query", 3: "total"}, "logits": {0: "batch", 1: "query"}}
    axes.update({n: {0: "past", 1: "batch"} for n in inputs[3:]})
    axes.update({n: {0: "query", 1: "batch"} for n in outputs[1 : 1 + 2 * geo.num_layers]})
    axes.update({n: {0: "batch", 1: "query"} for n in outputs[1 + 2 * geo.num_layers:]})  # hidden, aux_hidden
    with torch.no_grad():
        torch.onnx.export(wrapper, tuple(example), str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, opset_version=cfg.opset, dynamo=False)
    if big:
        import onnx

        proto = onnx.load(str(path))
        onnx.save(proto, str(path), save_as_external_data=True, location=path.name + ".data")


def io_specs(geo, layout: str, dtype: str, with_hidden: bool, aux_layers=None) -> tuple[list, list]:
    """The manifest's inputs/outputs lists ({"name", "dtype", "shape"}) of a graph (docs/engine-format.md)."""
    inputs, outputs = io_names(geo.num_layers, with_hidden, layout, bool(aux_layers))
    kv = "float16" if dtype == "fp16" else "float32"
    kv_shape = (["batch", geo.num_kv_heads, "max_len", geo.head_dim] if layout == "in_place"
                else ["past", "batch", geo.num_kv_heads, geo.head_dim])
    new_shape = kv_shape if layout == "in_place" else ["query", "batch", geo.num_kv_heads, geo.head_dim]
    fixed = {"input_ids": ("int64", ["batch", "query"]), "position_ids": ("int64", ["batch", "query"]),
             "attention_mask": (kv, ["batch", 1, "query", "past+query"]), "seqlens_k": ("int32", ["batch"]),
             "total_sequence_length": ("int32", [])}
    in_specs = [{"name": n, "dtype": fixed.get(n, (kv,))[0], "shape": fixed.get(n, (kv, kv_shape))[1]} for n in inputs]
    out_specs = [{"name": "logits", "dtype": "float32", "shape": ["batch", "query", geo.vocab_size]}]
    out_specs += [{"name": n, "dtype": kv, "shape": new_shape} for n in outputs[1:1 + 2 * geo.num_layers]]
    if with_hidden:
        out_specs.append({"name": "hidden", "dtype": kv, "shape": ["batch", "query", geo.hidden_size]})
    if aux_layers:
        out_specs.append({"name": "aux_hidden", "dtype": kv, "shape": ["batch", "query", len(aux_layers) * geo.hidden_size]})
    return in_specs, out_specs


def eos_ids(model_dir: Path, model) -> list[int]:
    ids = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update([e] if isinstance(e, int) else (e or []))
    return sorted(ids)


def export_engine(target_dir, out_dir, draft_dir=None, cfg: ExportConfig | None = None, log=print,
                  medusa_dir=None, tree=None, eagle_dir=None, eagle_tree: dict | None = None,
                  force: bool = False, verbose: bool = False) -> Path:
    """Export target (and draft) to ``out_dir``; validates and returns the engine dir.

    Atomic: everything is written into a hidden sibling dir, which replaces ``out_dir`` only once
    every graph passed its parity check and the manifest validates; a failed or interrupted export
    leaves nothing at ``out_dir``. An existing non-empty ``out_dir`` is refused unless ``force``
    (then replaced whole, never mixed with what was there).

    With ``medusa_dir`` (a heads dir from `specrt train medusa`) and ``tree`` (a compiled
    ``runtime.tree.Tree``), the target also outputs ``hidden``, gets the tree-verify shape
    Q = tree.size, and the heads are exported as their own graph (export/medusa_heads.py).
    With ``eagle_dir`` (a head dir from `specrt train eagle`) and ``eagle_tree`` ({"nodes", "depth",
    "topk"}: the dynamic draft tree's node budget incl. the root, depth and branching), the target
    also outputs ``hidden``, gets the tree-verify shape Q = nodes, and the head is exported as
    ``eagle.onnx`` (export/eagle_head.py); an EAGLE-3 head (export/eagle3_head.py) makes the target output
    ``aux_hidden`` of the head's layers instead and adds ``eagle_fc.onnx``. Medusa and EAGLE are exclusive
    (one tree-verify shape).
    """
    cfg = cfg or ExportConfig()
    if cfg.gamma < 1 or cfg.max_len < 2 or cfg.dtype not in TORCH_DTYPES:
        raise ExportError(f"invalid export config: gamma={cfg.gamma} (>=1), max_len={cfg.max_len} (>=2), "
                          f"dtype={cfg.dtype!r} (fp32|fp16)")
    if cfg.graph not in ("auto", "fused", "traced"):
        raise ExportError(f"invalid export config: graph={cfg.graph!r} (auto|fused|traced)")
    if cfg.quantize not in (None, "int8", "int4") or cfg.draft_quantize not in ("same", None, "int8", "int4"):
        raise ExportError(f"invalid export config: quantize={cfg.quantize!r}, draft_quantize={cfg.draft_quantize!r} "
                          "(int8|int4|None; the draft's may also be 'same')")
    target_dir, final = Path(target_dir), Path(out_dir)
    tok_src = target_dir / "tokenizer.json"
    if not tok_src.is_file():
        raise ExportError(f"{target_dir} has no tokenizer.json (a fast HF tokenizer is required)")
    if final.exists() and (not final.is_dir() or any(final.iterdir())) and not force:
        raise ExportError(f"{final} exists and is not empty: pass --force (force=True) to replace it whole")
    for src in (target_dir, *([Path(draft_dir)] if draft_dir else [])):  # the cheap checks, before any graph
        check_checkpoint_architecture(src)
    if draft_dir:
        check_draft_vocab(target_dir, Path(draft_dir))
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        with quiet(verbose):
            _export_into(out, target_dir, tok_src, draft_dir, cfg, log, medusa_dir, tree, eagle_dir, eagle_tree)
    except BaseException:  # failed, or interrupted (KeyboardInterrupt): nothing half-written is left behind
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        out.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        out.rename(final)
    return final


@contextlib.contextmanager
def quiet(verbose: bool):
    """Silence torch.onnx's TracerWarnings and transformers' logging and progress bars (unless verbose)."""
    if verbose:
        yield
        return
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def check_checkpoint_architecture(model_dir: Path) -> None:
    """Refuse an unsupported architecture from the checkpoint's config.json, before loading any weights."""
    from ..engines.wrapper import check_architecture_name

    config = model_dir / "config.json"
    if not config.is_file():
        raise ExportError(f"{model_dir} is not a Hugging Face model dir (no config.json)")
    for arch in json.loads(config.read_text()).get("architectures") or []:
        check_architecture_name(arch)


def check_draft_vocab(target_dir: Path, draft_dir: Path) -> None:
    """A draft must score the same token ids as the target: the same vocabulary size and tokenizer."""
    if not (draft_dir / "tokenizer.json").is_file():
        raise ExportError(f"draft {draft_dir} has no tokenizer.json: cannot check it shares the target's vocabulary")
    sizes = [json.loads((d / "config.json").read_text()).get("vocab_size") if (d / "config.json").is_file() else None
             for d in (target_dir, draft_dir)]
    check_vocab(*sizes, vocab_sha256(target_dir / "tokenizer.json"), vocab_sha256(draft_dir / "tokenizer.json"))


def _export_into(out: Path, target_dir: Path, tok_src: Path, draft_dir, cfg: ExportConfig, log, medusa_dir, tree,
                 eagle_dir, eagle_tree) -> None:
    """The export itself, into the (new, empty) dir ``out``."""
    (out / "tokenizer").mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / "tokenizer" / name)
    target_vocab = vocab_sha256(tok_src)
    if eagle_dir and medusa_dir:
        raise ExportError("export either --medusa or --eagle, not both (they share the tree-verify shape)")
    heads_cfg = _check_medusa(medusa_dir, tree) if medusa_dir else None
    if eagle_dir:
        from .eagle_export import check_eagle_tree, export_eagle

        eagle_tree = check_eagle_tree(eagle_tree)
    models, eos = {}, []
    roles = [("target", target_dir)] + ([("draft", Path(draft_dir))] if draft_dir else [])
    for role, src in roles:
        model = load_hf(src, cfg.dtype)
        vocab = target_vocab
        if role == "draft":  # (its vocabulary was checked against the target's before any export)
            vocab = vocab_sha256(src / "tokenizer.json")
        role_cfg = cfg
        if role == "draft" and cfg.draft_quantize != "same":
            role_cfg = replace(cfg, quantize=cfg.draft_quantize)
        if role == "target" and heads_cfg:
            from .medusa_heads import HeadsError, check_heads_match

            from .medusa_upstream import base_model_of

            geo = geometry(model)
            base = base_model_of(medusa_dir)
            try:
                check_heads_match(heads_cfg, geo.hidden_size, geo.vocab_size, target_vocab,
                                  where=f"heads {medusa_dir}" + (f" (base model {base})" if base else ""))
            except HeadsError as e:
                raise ExportError(f"{e} (target {target_dir})") from None
            role_cfg = replace(cfg, with_hidden=True, tree_mask=tree.mask)
        if role == "target" and eagle_dir:
            from .eagle_export import eagle_target_config

            role_cfg = eagle_target_config(eagle_dir, eagle_tree, model, target_vocab, target_dir, cfg)
        log(f"exporting {role} {type(model).__name__} from {src} ...")
        entry = export_graph(model, out / f"{role}.onnx", role_cfg)
        if cfg.torch_weights:  # the exact weights the graph was exported from, in the graph's dtype
            model.save_pretrained(out / "torch" / role)
            entry["torch_weights"] = f"torch/{role}"
        shapes = {"decode": 1, "prefill": cfg.prefill_chunk}
        if role == "target":
            shapes["verify"] = cfg.gamma + 1
            eos = eos_ids(src, model)
            if heads_cfg:
                shapes["tree_verify"] = tree.size
            if eagle_dir:
                shapes["tree_verify"] = eagle_tree["nodes"]
        models[role] = {**entry, "shapes": shapes, "vocab_sha256": vocab, "source": str(src.resolve())}
        p = entry["parity_max_abs_diff"]
        graph = ("fused" if entry["kv_layout"] == "in_place" else "traced") + (
            f", {entry['quantize']}" if entry["quantize"] else "")
        log(f"  {role}: {entry['parameters'] / 1e6:.2f}M params, {graph} graph, exported in {entry['export_seconds']} s; "
            "max |ORT - torch" + (" fp32" if entry["quantize"] else "") + "| logits " + ", ".join(f"{k} {v['logits']:.1e}" for k, v in p.items()) +
            f" (tolerance {entry['tolerance']:.0e})")
        del model
    medusa = _export_medusa(medusa_dir, tree, out, cfg, log) if medusa_dir else None
    eagle = export_eagle(eagle_dir, eagle_tree, target_dir, target_vocab, out, cfg, log) if eagle_dir else None
    manifest = {
        "format": FORMAT, "schema_version": SCHEMA_VERSION, "specrt_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "max_len": cfg.max_len, "gamma": cfg.gamma,
        "tokenizer": {"dir": "tokenizer", "eos_token_ids": eos, "vocab_sha256": target_vocab},
        "defaults": {"method": "draft" if "draft" in models else ("medusa" if medusa else ("eagle" if eagle else "ngram")),
                     "gamma": None},
        "models": models,
    }
    if medusa:
        manifest["medusa"] = medusa
    if eagle:
        manifest["eagle"] = eagle
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    load_manifest(out)


def _check_medusa(medusa_dir, tree):
    """Fail before any export if the heads dir is unusable or too shallow for the tree."""
    from .medusa_heads import HeadsError, read_heads_config

    if tree is None:
        raise ExportError("exporting Medusa heads needs a tree (--tree NAME|FILE)")
    try:
        heads_cfg, _ = read_heads_config(medusa_dir)
    except HeadsError as e:
        raise ExportError(str(e)) from None
    if tree.depth > heads_cfg.num_heads:
        raise ExportError(f"tree {tree.name!r} is {tree.depth} deep but {medusa_dir} has only "
                          f"{heads_cfg.num_heads} heads (a depth-d node is a candidate of head d)")
    return heads_cfg


def _export_medusa(medusa_dir, tree, out: Path, cfg: ExportConfig, log) -> dict:
    """Export the heads graph beside the target; returns the manifest's ``medusa`` section."""
    from .medusa_heads import load_heads

    heads, raw = load_heads(medusa_dir)
    log(f"exporting medusa heads 1..{tree.depth} of {heads.cfg.num_heads} from {medusa_dir} (tree {tree.name!r}: "
        f"{tree.size} nodes, depth {tree.depth}) ...")
    # a depth-D tree reads heads 1..D only: the graph computes no more (each head is a V x H projection)
    section = export_heads_graph(heads.first(tree.depth), out / "medusa.onnx", cfg.dtype, cfg.opset)
    log(f"  medusa: {section['parameters'] / 1e6:.2f}M params; max |ORT - torch| {section['parity_max_abs_diff']:.1e}")
    return {**section, "tree": tree.to_json(), "source": str(Path(medusa_dir).resolve()),
            "trained_heads": heads.cfg.num_heads, "accuracy": raw.get("accuracy")}
