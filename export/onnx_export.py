"""Export local HF checkpoints to an engine dir: ONNX graphs, tokenizer, manifest.json.

Every exported graph is run in ONNX Runtime against PyTorch on a calibration text (prefill chunks,
then decode steps) and on random inputs for each fixed shape (decode, chain verify, prefill, and a
tree mask); the export fails when KL, top-1 agreement or the relative difference exceed the bounds
of export/parity.py (a quantized graph: KL and top-1 on the calibration text, against the fp32 model).

``export_engine`` is the driver: the checks, then the target (and draft) graphs made here, the heads'
graphs (export/medusa_export.py, export/eagle_export.py) and the manifest, all written atomically.
"""
from __future__ import annotations

import contextlib
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
from ..contract import MASK_MIN, io_names
from ..engines.manifest import FORMAT, SCHEMA_VERSION, load_manifest
from ..engines.ort import OrtEngine
from ..engines.wrapper import DecoderWrapper, chain_mask, geometry
from .eagle_export import check_eagle_tree, eagle_target_config, export_eagle
from .errors import ExportError
from .gguf import hf_dir_from_gguf, is_gguf, source_of
from .hf_checkpoint import (TORCH_DTYPES, check_checkpoint_architecture, check_draft_vocab, copy_tokenizer, eos_ids,
                            load_hf, vocab_sha256)
from .medusa_export import check_medusa, export_medusa, medusa_target_config
from .windows import layer_windows
from . import parity
EXTERNAL_DATA_BYTES = 1 << 30  # models above 1 GiB store weights as external data (protobuf limit is 2 GiB)
LOW_MEMORY_BYTES = 1 << 30  # --low-memory auto: checkpoints above 1 GiB in fp32 are read a layer at a time


@dataclass
class ExportConfig:
    """What `specrt export` builds."""

    gamma: int = 8  # chain-verify draft length: verify shape is gamma + 1; the policy's largest γ (it picks 0..gamma per
    # step: a lookup method's long matches pay, docs/bench/serving-vs-llama.md)
    max_len: int = 2048  # KV cache capacity (prompt + generated tokens)
    dtype: str = "fp32"  # weights and K/V dtype in the graphs: fp32 | fp16
    prefill_chunk: int = 128  # prompt tokens per prefill call
    opset: int = 17  # ONNX opset for the (TorchScript-based) exporter
    with_hidden: bool = False  # also output the last hidden state (Medusa/EAGLE heads need it)
    aux_layers: tuple | None = None  # also output `aux_hidden`: the hidden states entering these layers (EAGLE-3)
    tree_mask: object = None  # bool [N, N] of an exported tree: adds a parity case at the tree-verify shape
    torch_weights: bool = False  # also save each model's HF weights (safetensors) to torch/<role>/ for the torch backend
    graph: str = "auto"  # "fused" (ORT fused ops, KV written in place) | "traced" (torch.onnx) | "auto": fused if possible
    quantize: str | None = None  # MatMul weights: None (as dtype) | "int8" | "int4" | "w8a8" | options (export/quantize.py)
    draft_quantize: str | None = "same"  # the draft's quantization: "same" (as quantize) | None | "int8" | "int4"
    parity_bounds: str | None = None  # override export/parity.py's BOUNDS: "off" | "kl_mean=..,top1=..,..." (recorded)
    prefill_graph: bool = True  # a MatMulNBits (int4/int8) target also gets a prefill graph on the integer kernel
    # (export/prefill_graph.py: ~3x faster prompts, its own int8 copy of the layers' weights)
    low_memory: str = "auto"  # "on": read the checkpoint a layer at a time (export/lazy_model.py) and write the graph
    # a tensor at a time; "off": load it whole; "auto": "on" for checkpoints over LOW_MEMORY_BYTES in fp32



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
    from .fused_graph import build_fused_graph, linear_inputs, run_in_place

    from .lazy_model import is_lazy
    from .smooth import recording_activation_max
    from .tensor_store import TensorStore

    geo = geometry(model)
    wrapper = DecoderWrapper(model, with_hidden=cfg.with_hidden, aux_layers=cfg.aux_layers)
    windows = layer_windows(model.config, cfg.max_len)
    layout = choose_kv_layout(model, cfg)
    lazy = is_lazy(model)
    # a lazily read, quantized model: no fp32 graph is run (its ONNX Runtime session is the whole model in fp32,
    # what a low-memory export must not hold), and the references are the calibration text's only, all a
    # quantized graph is judged on
    fp32_graph_checked = not (lazy and cfg.quantize)
    cases = parity_cases(wrapper, geo, cfg) if fp32_graph_checked else {}  # the references, before tracing
    linears = linear_inputs(model, cfg.with_hidden) if layout == "in_place" and cfg.quantize else {}
    with recording_activation_max(linears) as activation_max:  # export/smooth.py's statistics, on the same forward
        calibration = parity.calibration_case(model, geo.vocab_size, cfg.max_len)  # windows apply in the graph
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    big = lazy or n_bytes > EXTERNAL_DATA_BYTES
    t0 = time.time()
    if layout == "in_place":
        import onnx

        data = path.with_name(path.name + ".data")
        proto = build_fused_graph(model, cfg.max_len, cfg.with_hidden, cfg.aux_layers,
                                  TensorStore(path.parent, data) if big else None)
        onnx.save(proto, str(path))
        del proto
    else:
        trace_graph(wrapper, geo, path, cfg, big)
    seconds = time.time() - t0

    def run(engine):
        if layout == "in_place":
            return lambda feeds: run_in_place(engine, feeds, cfg.max_len)
        return lambda feeds: [engine.run({n: t.numpy() for n, t in zip(engine.input_names, feeds)})[n]
                              for n in engine.output_names]

    def check(scheme):
        return parity.check(run(OrtEngine(path)), cases, calibration, geo, cfg.dtype, cfg.prefill_chunk, scheme,
                            cfg.parity_bounds)

    report, absolute = check(cfg.dtype) if fp32_graph_checked else (None, None)
    entry = {}
    if cfg.quantize:
        from .quantize import QuantizeError, parity_scheme, quantize_graph

        try:
            entry["quantization"] = quantize_graph(path, cfg.quantize, external_data=big,
                                                   calibration_ids=calibration[0], activation_max=activation_max)
        except QuantizeError as e:
            raise ExportError(str(e)) from None
        # against the unquantized torch model: the quantized model is a (slightly) different one
        unquantized = report
        report, absolute = check(parity_scheme(cfg.quantize))
        if unquantized is not None:
            report["unquantized"] = {k: unquantized[k] for k in ("scheme", "cases", "bounds")}
    if layout == "in_place":  # the graph of batched calls (Q > 1 at batch > 1), sharing the weights file
        from .batched_graph import check_twin, write_twin

        entry["batched_file"] = write_twin(path)
        entry["batched_parity"] = check_twin(path, path.parent / entry["batched_file"], cfg.max_len, bool(cfg.quantize))
    if layout == "in_place":  # T(Q)/T(1) of the graph as quantized, on this machine (export/latency.py)
        from .latency import verify_curve

        entry["latency"] = verify_curve(path, cfg.max_len, extra_qs=(cfg.gamma + 1,))
    in_specs, out_specs = io_specs(geo, layout, cfg.dtype, cfg.with_hidden, cfg.aux_layers)
    return {"file": path.name, **asdict(geo), "dtype": cfg.dtype, "has_hidden": cfg.with_hidden,
            **({"aux_hidden_layers": list(cfg.aux_layers)} if cfg.aux_layers else {}),
            "kv_layout": layout, "quantize": cfg.quantize, **entry, **({"low_memory": True} if lazy else {}),
            **({"windows": windows} if windows else {}),
            "parameters": sum(p.numel() for p in model.parameters()), "inputs": in_specs, "outputs": out_specs,
            "export_seconds": round(seconds, 1), "parity": report, "parity_max_abs_diff": absolute}


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
    check_config(cfg)
    final = Path(out_dir)
    if final.exists() and (not final.is_dir() or any(final.iterdir())) and not force:
        raise ExportError(f"{final} exists and is not empty: pass --force (force=True) to replace it whole")
    target_dir = checkpoint_dir(target_dir, log)
    draft_dir = checkpoint_dir(draft_dir, log) if draft_dir else None
    tok_src = target_dir / "tokenizer.json"
    if not tok_src.is_file():
        raise ExportError(f"{target_dir} has no tokenizer.json (a fast HF tokenizer is required)")
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
    _replace_dir(final, out)
    return final


def checkpoint_dir(path, log) -> Path:
    """The HF dir of a checkpoint: ``path`` itself, or for a GGUF file the dir it converts to (export/gguf.py)."""
    path = Path(path)
    if is_gguf(path):
        return hf_dir_from_gguf(path, log=log)
    if path.is_file():
        raise ExportError(f"{path} is a file but not a GGUF file: pass a Hugging Face model dir or a .gguf file")
    return path


def check_config(cfg: ExportConfig) -> None:
    """ExportError for a value of ``cfg`` no export can build."""
    if cfg.gamma < 1 or cfg.max_len < 2 or cfg.dtype not in TORCH_DTYPES:
        raise ExportError(f"invalid export config: gamma={cfg.gamma} (>=1), max_len={cfg.max_len} (>=2), "
                          f"dtype={cfg.dtype!r} (fp32|fp16)")
    if cfg.graph not in ("auto", "fused", "traced"):
        raise ExportError(f"invalid export config: graph={cfg.graph!r} (auto|fused|traced)")
    if cfg.low_memory not in ("auto", "on", "off"):
        raise ExportError(f"invalid export config: low_memory={cfg.low_memory!r} (auto|on|off)")
    from .quantize import QuantizeError, parse_options

    for name, q in (("quantize", cfg.quantize), ("draft_quantize", cfg.draft_quantize)):
        try:
            if q is not None and not (q == "same" and name == "draft_quantize"):
                parse_options(str(q))
        except QuantizeError as e:
            raise ExportError(f"invalid export config: {name}={q!r}: {e} (None; the draft's may also be "
                              "'same')") from None
    parity.parse_override(cfg.parity_bounds)


def _replace_dir(final: Path, out: Path) -> None:
    """Move the finished engine dir ``out`` to ``final``, replacing what is there whole."""
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        out.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        out.rename(final)


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


@dataclass(frozen=True)
class _Heads:
    """The heads exported beside the target, checked before any graph: Medusa's or EAGLE's (or none)."""

    medusa_dir: object = None
    tree: object = None  # Medusa's compiled tree
    heads_cfg: object = None  # Medusa's HeadsConfig
    eagle_dir: object = None
    eagle_tree: dict | None = None  # EAGLE's dynamic tree budget {"nodes", "depth", "topk"}

    def target_config(self, model, target_vocab: str, target_dir: Path, cfg: ExportConfig) -> ExportConfig:
        """The target's ExportConfig with what the heads read (hidden, aux_hidden, the tree-verify parity case)."""
        if self.heads_cfg:
            return medusa_target_config(self.medusa_dir, self.heads_cfg, self.tree, model, target_vocab, target_dir, cfg)
        if self.eagle_dir:
            return eagle_target_config(self.eagle_dir, self.eagle_tree, model, target_vocab, target_dir, cfg)
        return cfg

    def tree_verify_size(self) -> int | None:
        """The target's tree-verify shape Q, None without heads."""
        if self.heads_cfg:
            return self.tree.size
        if self.eagle_dir:
            return self.eagle_tree["nodes"]
        return None


def check_heads(medusa_dir, tree, eagle_dir, eagle_tree) -> _Heads:
    """The heads options, checked before any graph is exported (Medusa and EAGLE share the tree-verify shape)."""
    if eagle_dir and medusa_dir:
        raise ExportError("export either --medusa or --eagle, not both (they share the tree-verify shape)")
    heads_cfg = check_medusa(medusa_dir, tree) if medusa_dir else None
    if eagle_dir:
        eagle_tree = check_eagle_tree(eagle_tree)
    return _Heads(medusa_dir, tree, heads_cfg, eagle_dir, eagle_tree)


def _export_into(out: Path, target_dir: Path, tok_src: Path, draft_dir, cfg: ExportConfig, log, medusa_dir, tree,
                 eagle_dir, eagle_tree) -> None:
    """The export itself, into the (new, empty) dir ``out``: tokenizer, model graphs, heads graphs, manifest."""
    copy_tokenizer(target_dir, out / "tokenizer")
    target_vocab = vocab_sha256(tok_src)
    heads = check_heads(medusa_dir, tree, eagle_dir, eagle_tree)
    roles = [("target", target_dir)] + ([("draft", Path(draft_dir))] if draft_dir else [])
    exported = {role: export_model(role, src, out, cfg, heads, target_vocab, log) for role, src in roles}
    models = {role: entry for role, (entry, _) in exported.items()}
    eos = exported["target"][1]
    medusa = export_medusa(medusa_dir, tree, out, cfg, log) if medusa_dir else None
    eagle = export_eagle(eagle_dir, heads.eagle_tree, target_dir, target_vocab, out, cfg, log) if eagle_dir else None
    write_manifest(out, cfg, target_vocab, eos, models, medusa, eagle)


def export_model(role: str, src: Path, out: Path, cfg: ExportConfig, heads: _Heads, target_vocab: str,
                 log) -> tuple[dict, list[int]]:
    """Load one checkpoint and export it as ``<role>.onnx``: (its manifest entry ``models.<role>``, its eos ids)."""
    model = open_model(src, cfg, log)
    vocab = target_vocab
    if role == "draft":  # (its vocabulary was checked against the target's before any export)
        vocab = vocab_sha256(src / "tokenizer.json")
    role_cfg = cfg
    if role == "draft" and cfg.draft_quantize != "same":
        role_cfg = replace(cfg, quantize=cfg.draft_quantize)
    if role == "target":
        role_cfg = heads.target_config(model, target_vocab, src, cfg)
    log(f"exporting {role} {type(model).__name__} from {src} ...")
    entry = export_graph(model, out / f"{role}.onnx", role_cfg)
    if role == "target" and entry["kv_layout"] == "in_place":  # decode steps computed as verify passes are
        entry.update(write_decode(out / entry["file"], bool(role_cfg.quantize)))
        if cfg.prefill_graph:
            entry.update(write_prefill(out / entry["decode_file"], model, entry["vocab_size"], cfg.max_len))
    if cfg.torch_weights:  # the exact weights the graph was exported from, in the graph's dtype
        model.save_pretrained(out / "torch" / role)
        entry["torch_weights"] = f"torch/{role}"
    shapes = {"decode": 1, "prefill": cfg.prefill_chunk}
    if role == "target":
        shapes["verify"] = cfg.gamma + 1
        if heads.tree_verify_size() is not None:
            shapes["tree_verify"] = heads.tree_verify_size()
    log_graph_summary(log, role, entry)
    checkpoint = source_of(src)  # a converted GGUF file: what it was
    return {**entry, "shapes": shapes, "vocab_sha256": vocab, "source": str(src.resolve()),
            **({"checkpoint": checkpoint} if checkpoint else {})}, eos_ids(src, model)


def open_model(src: Path, cfg: ExportConfig, log):
    """The torch model of checkpoint ``src``: read a layer at a time (export/lazy_model.py) where
    ``cfg.low_memory`` asks for it and the model gets the fused graph, else loaded whole."""
    from .fused_graph import FUSED_ARCHITECTURES, fused_unsupported
    from .lazy_model import checkpoint_bytes, lazy_unavailable, open_lazy

    if cfg.low_memory == "off" or (cfg.low_memory == "auto" and checkpoint_bytes(src) <= LOW_MEMORY_BYTES):
        return load_hf(src, cfg.dtype)
    archs = json.loads((src / "config.json").read_text()).get("architectures") or list(FUSED_ARCHITECTURES)
    why = (lazy_unavailable(src) or ("--torch-weights saves the whole model" if cfg.torch_weights else None)
           or ("--graph traced traces the whole model" if cfg.graph == "traced" else None)
           or (None if set(archs) & set(FUSED_ARCHITECTURES) else
               f"{archs[0]} has no fused graph (fused: {', '.join(FUSED_ARCHITECTURES)})"))
    model = open_lazy(src) if why is None else None
    if why is None:
        why = ("its tensors do not map one to one onto the model's parameters" if model is None
               else fused_unsupported(model, cfg.dtype, cfg.max_len))
    if why is None:
        log(f"reading {src.name} a layer at a time (low-memory export)")
        return model
    if cfg.low_memory == "on":
        raise ExportError(f"--low-memory on: {src} cannot be read a layer at a time: {why}")
    log(f"loading {src.name} whole ({why})")
    return load_hf(src, cfg.dtype)


def write_decode(path: Path, quantized: bool) -> dict:
    """The padded graph of the fused graph at ``path`` (export/decode_pad.py), checked: its manifest fields."""
    from .decode_pad import check_decode, write_decode_graph

    name = write_decode_graph(path)
    return {"decode_file": name, "decode_parity": check_decode(path, path.parent / name, quantized)}


def write_prefill(decode_path: Path, model, vocab_size: int, max_len: int) -> dict:
    """The prefill graph of the padded graph at ``decode_path`` (export/prefill_graph.py), checked on the
    calibration text: its manifest fields, or {} where the graph has no MatMulNBits to rewrite."""
    from .prefill_graph import check_prefill, write_prefill_graph

    name = write_prefill_graph(decode_path)
    if name is None:
        return {}
    ids = parity.calibration_ids(model, vocab_size, min(parity.MAX_CALIBRATION_TOKENS, max_len - 1))
    return {"prefill_file": name, "prefill_parity": check_prefill(decode_path, decode_path.parent / name, ids)}


def log_graph_summary(log, role: str, entry: dict) -> None:
    """One line: the graph's size and kind, its export time, and its parity (export/parity.summary)."""
    graph = ("fused" if entry["kv_layout"] == "in_place" else "traced") + (
        f", {entry['quantize']}" if entry["quantize"] else "")
    log(f"  {role}: {entry['parameters'] / 1e6:.2f}M params, {graph} graph, exported in {entry['export_seconds']} s; "
        + parity.summary(entry["parity"]))
    if entry.get("latency"):  # export/latency.py
        c = entry["latency"]
        log(f"  {role}: T(1) {c['seconds'][0] * 1e3:.2f} ms here; T(Q)/T(1) "
            + ", ".join(f"{q}: {r:.2f}" for q, r in zip(c["q"][1:], c["ratio"][1:])))
    if entry.get("decode_parity"):  # export/decode_pad.py
        d = entry["decode_parity"]
        rows = " (steps of 2 rows: ONNX Runtime's one-row matmul differs here)" if d.get("decode_rows") == 2 else ""
        log(f"  {role}: {entry['decode_file']}: decode steps vs verify pass max |Δlogit| {d['steps_vs_verify']:.2g}"
            + rows)
    if entry.get("prefill_parity"):  # export/prefill_graph.py
        f = entry["prefill_parity"]
        log(f"  {role}: {entry['prefill_file']}: prompts on the integer kernel, KL from the decode graph "
            f"{f['kl_mean']:.2g}, top-1 {f['top1'] if f['top1'] is None else format(f['top1'], '.0%')}")


def write_manifest(out: Path, cfg: ExportConfig, target_vocab: str, eos: list[int], models: dict,
                   medusa: dict | None, eagle: dict | None) -> None:
    """Write ``out/manifest.json`` (docs/engine-format.md) and validate it by loading it."""
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
