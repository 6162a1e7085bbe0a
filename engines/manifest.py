"""manifest.json: the engine dir's contract (documented field by field in docs/engine-format.md).

Loading validates everything a runtime relies on and raises ``EngineError`` naming the
problem: a missing file, a corrupt or unknown-version manifest, a draft whose vocabulary
differs from the target's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..contract import KV_LAYOUTS, io_names
from .base import EngineError

FORMAT = "specrt-engine"
SCHEMA_VERSION = 2  # 2 added models.<role>.kv_layout ("in_place" fused graphs) and .quantize
READABLE_VERSIONS = (1, 2)  # a version-1 dir is read as kv_layout "time_major", no quantization
ROLES = ("target", "draft")


@dataclass(frozen=True)
class ModelGeometry:
    """The sizes a runtime needs to allocate a model's KV cache and read its outputs."""

    architecture: str  # HF architecture class name, e.g. "LlamaForCausalLM"
    num_layers: int  # decoder layers (one past_key/past_value pair each)
    num_kv_heads: int  # key/value heads per layer
    head_dim: int  # per-head size
    hidden_size: int  # width of the optional `hidden` output
    vocab_size: int  # logits width


@dataclass(frozen=True)
class GraphSpec:
    """One exported model graph, as recorded in the manifest under ``models.<role>``."""

    role: str  # "target" | "draft"
    file: str  # ONNX file name, relative to the engine dir
    geometry: ModelGeometry  # cache and output sizes
    dtype: str  # "fp32" | "fp16": dtype of masks, past/new K/V (logits are always fp32)
    has_hidden: bool  # whether the graph also outputs `hidden`
    shapes: dict  # fixed query lengths: {"decode": 1, "verify": gamma+1, "prefill": chunk}
    inputs: list  # [{"name", "dtype", "shape"}] in graph order
    outputs: list  # [{"name", "dtype", "shape"}] in graph order
    vocab_sha256: str  # hash of the tokenizer vocabulary this model was exported with
    kv_layout: str = "time_major"  # "time_major" (traced graph) | "in_place" (fused graph): contract.py
    quantize: str | None = None  # MatMul quantization: None | "int8" | "int4" | "w8a8" [+ options] (export/quantize.py)
    sliding_window: int | None = None  # engine dirs before per-layer windows: one window on every layer, applied
    # by the runtime to the mask (contract.apply_sliding_window); graphs exported since apply theirs themselves
    windows: tuple | None = None  # per layer the sliding window the graph applies itself (None: full attention)
    aux_hidden_layers: tuple | None = None  # layers whose input hidden states form `aux_hidden` (EAGLE-3); None: no output
    batched_file: str | None = None  # in_place graphs: the batched twin (calls of several rows of Q > 1 tokens),
    # engine-dir relative; None: such calls run row by row
    decode_file: str | None = None  # in_place target graphs: the padded graph of single-row calls (decode steps
    # computed as verify passes are; export/decode_pad.py), engine-dir relative; None: they run the fused graph
    prefill_file: str | None = None  # in_place target graphs with MatMulNBits: the padded graph on the integer kernel
    # that prompts run through (export/prefill_graph.py), engine-dir relative; None: prompts run as decode steps do
    latency: dict | None = None  # export-time T(Q): {"q": [...], "seconds": [...], "ratio": [...], "past", ...}
    # (export/latency.py); None: not measured (traced graphs, older engine dirs)


@dataclass(frozen=True)
class MedusaSpec:
    """The optional Medusa heads graph, as recorded in the manifest's top-level ``medusa`` section."""

    file: str  # ONNX file name of the heads graph, relative to the engine dir
    num_heads: int  # K: head k predicts the token k+1 positions after the hidden state's position
    hidden_size: int  # H: width of the `hidden` input (the target's hidden size)
    vocab_size: int  # V: width of each head's logits (the target's vocabulary)
    dtype: str  # "fp32" | "fp16": dtype of the `hidden` input (logits are always fp32)
    tree: dict  # the exported candidate tree: {"name", "nodes", "depth", "choices"} (Medusa paths)
    inputs: list  # [{"name": "hidden", ...}]
    outputs: list  # [{"name": "medusa_logits", ...}]


@dataclass(frozen=True)
class EagleSpec:
    """The optional EAGLE head graph, as recorded in the manifest's top-level ``eagle`` section."""

    file: str  # ONNX file name of the head graph, relative to the engine dir
    hidden_size: int  # H: width of the `hidden` input/`next_hidden` output (the target's hidden size)
    vocab_size: int  # V: width of the head's logits (the target's vocabulary)
    num_kv_heads: int  # the head's own KV cache: one layer of [max_len, 1, num_kv_heads, head_dim]
    head_dim: int
    dtype: str  # "fp32" | "fp16": dtype of features, mask and K/V (logits are always fp32)
    tree: dict  # dynamic draft tree defaults: {"nodes" (root incl. = tree_verify shape), "depth", "topk"}
    inputs: list  # [{"name": "input_ids", ...}, {"name": "hidden", ...}, ...]
    outputs: list  # [{"name": "logits", ...}, ..., {"name": "next_hidden", ...}]
    version: int = 1  # 1: EAGLE-1 head on the target's `hidden`; 3: EAGLE-3 head on the fused `aux_hidden`
    fc_file: str | None = None  # version 3: the fc graph (aux_hidden [B, Q, 3H] -> hidden [B, Q, H]), engine-dir relative
    aux_hidden_layers: list | None = None  # version 3: the target layers it fuses (= models.target.aux_hidden_layers)
    draft_vocab_size: int | None = None  # version 3: the head's own vocabulary (logits are mapped to the target's)


@dataclass(frozen=True)
class Manifest:
    """A validated engine dir."""

    root: Path  # the engine dir
    graphs: dict  # role -> GraphSpec
    tokenizer_dir: Path  # HF tokenizer files (tokenizer.json, tokenizer_config.json)
    eos_token_ids: tuple  # token ids that end generation
    max_len: int  # KV cache capacity in tokens (prompt + generated)
    gamma: int  # exported chain-verify draft length (verify shape = gamma + 1)
    defaults: dict = field(default_factory=dict)  # runtime defaults, e.g. {"method": "draft"}
    raw: dict = field(default_factory=dict)  # the manifest as read
    medusa: MedusaSpec | None = None  # Medusa heads graph and tree, when exported with --medusa
    eagle: EagleSpec | None = None  # EAGLE head graph and draft-tree defaults, when exported with --eagle

    @property
    def target(self) -> GraphSpec:
        return self.graphs["target"]

    @property
    def draft(self) -> GraphSpec | None:
        return self.graphs.get("draft")


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise EngineError(f"manifest.json: missing field {where}{key!r}")
    return d[key]


def _graph(root: Path, role: str, m: dict) -> GraphSpec:
    where = f"models.{role}."
    geo_fields = [f.name for f in fields(ModelGeometry)]
    geo = ModelGeometry(**{k: _require(m, k, where) for k in geo_fields})
    spec = GraphSpec(role=role, file=_require(m, "file", where), geometry=geo, dtype=_require(m, "dtype", where),
                     has_hidden=bool(m.get("has_hidden", False)), shapes=_require(m, "shapes", where),
                     inputs=_require(m, "inputs", where), outputs=_require(m, "outputs", where),
                     vocab_sha256=_require(m, "vocab_sha256", where),
                     kv_layout=m.get("kv_layout", "time_major"), quantize=m.get("quantize"),
                     sliding_window=m.get("sliding_window"), windows=_windows(m, geo.num_layers, where),
                     aux_hidden_layers=_aux_layers(m, geo.num_layers, where), batched_file=m.get("batched_file"),
                     decode_file=m.get("decode_file"), prefill_file=m.get("prefill_file"), latency=_latency(m, where))
    for name in (spec.file, spec.batched_file, spec.decode_file, spec.prefill_file):
        if name is not None and not (root / name).is_file():
            raise EngineError(f"engine dir {root}: {role} graph file {name!r} is missing")
    if spec.batched_file is not None and spec.kv_layout != "in_place":
        raise EngineError(f"manifest.json: {where}batched_file is for kv_layout in_place graphs only")
    for key in ("decode_file", "prefill_file"):
        if getattr(spec, key) is not None and spec.kv_layout != "in_place":
            raise EngineError(f"manifest.json: {where}{key} is for kv_layout in_place graphs only")
    if spec.dtype not in ("fp32", "fp16"):
        raise EngineError(f"manifest.json: {where}dtype must be fp32 or fp16, got {spec.dtype!r}")
    if spec.kv_layout not in KV_LAYOUTS:
        raise EngineError(f"manifest.json: {where}kv_layout must be one of {list(KV_LAYOUTS)}, got {spec.kv_layout!r}")
    want_in, want_out = io_names(geo.num_layers, spec.has_hidden, spec.kv_layout, spec.aux_hidden_layers is not None)
    if [i["name"] for i in spec.inputs] != want_in or [o["name"] for o in spec.outputs] != want_out:
        raise EngineError(f"manifest.json: {where}inputs/outputs do not match the graph contract for "
                          f"{geo.num_layers} layers (see docs/engine-format.md)")
    return spec


def _latency(m: dict, where: str) -> dict | None:
    """``latency``: absent, or {"q": [Q...], "seconds": [T(Q)...], ...} with one positive time per Q."""
    c = m.get("latency")
    if c is None:
        return None
    ok = (isinstance(c, dict) and isinstance(c.get("q"), list) and isinstance(c.get("seconds"), list)
          and len(c["q"]) == len(c["seconds"]) > 0 and all(isinstance(q, int) and q >= 1 for q in c["q"])
          and all(isinstance(t, (int, float)) and t > 0 for t in c["seconds"]))
    if not ok:
        raise EngineError(f"manifest.json: {where}latency must hold lists q (positive ints) and seconds "
                          f"(positive) of one length, got {c!r}")
    return c


def _windows(m: dict, num_layers: int, where: str) -> tuple | None:
    """``windows``: absent, or per layer a positive window or null, e.g. Gemma 2 [4096, null, 4096, null]."""
    windows = m.get("windows")
    if windows is None:
        return None
    if (not isinstance(windows, list) or len(windows) != num_layers or not all(
            w is None or (isinstance(w, int) and not isinstance(w, bool) and w > 0) for w in windows)):
        raise EngineError(f"manifest.json: {where}windows must list, for each of the {num_layers} layers, a "
                          f"positive window or null, got {windows!r}")
    return tuple(windows)


def _aux_layers(m: dict, num_layers: int, where: str) -> tuple | None:
    """``aux_hidden_layers``: absent, or a non-empty list of layer indices in [0, num_layers)."""
    layers = m.get("aux_hidden_layers")
    if layers is None:
        return None
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers)):
        raise EngineError(f"manifest.json: {where}aux_hidden_layers must be a non-empty list of layer indices "
                          f"in 0..{num_layers - 1}, got {layers!r}")
    return tuple(layers)


def load_manifest(engine_dir: str | Path) -> Manifest:
    root = Path(engine_dir)
    if not root.is_dir():
        raise EngineError(f"engine dir {root} does not exist or is not a directory")
    path = root / "manifest.json"
    if not path.is_file():
        raise EngineError(f"engine dir {root} has no manifest.json (export one with `specrt export`)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise EngineError(f"{path} is not a specrt engine manifest (format != {FORMAT!r})")
    version = raw.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise EngineError(f"{path}: schema_version {version!r} is not supported by this specrt "
                          f"(supports {', '.join(map(str, READABLE_VERSIONS))}); re-export the engine or upgrade specrt")
    models = _require(raw, "models", "")
    if not isinstance(models, dict) or "target" not in models:
        raise EngineError(f"{path}: models.target is missing")
    unknown = set(models) - set(ROLES)
    if unknown:
        raise EngineError(f"{path}: unknown model roles {sorted(unknown)}; known: {list(ROLES)}")
    graphs = {role: _graph(root, role, models[role]) for role in models}
    tok = _require(raw, "tokenizer", "")
    tok_dir = root / _require(tok, "dir", "tokenizer.")
    if not (tok_dir / "tokenizer.json").is_file():
        raise EngineError(f"engine dir {root}: tokenizer file {tok_dir / 'tokenizer.json'} is missing")
    if "draft" in graphs:
        check_vocab_match(graphs["target"], graphs["draft"])
    medusa = _medusa(root, raw["medusa"], graphs["target"]) if raw.get("medusa") else None
    eagle = _eagle(root, raw["eagle"], graphs["target"]) if raw.get("eagle") else None
    return Manifest(root=root, graphs=graphs, tokenizer_dir=tok_dir,
                    eos_token_ids=tuple(_require(tok, "eos_token_ids", "tokenizer.")),
                    max_len=int(_require(raw, "max_len", "")), gamma=int(_require(raw, "gamma", "")),
                    defaults=dict(raw.get("defaults", {})), raw=raw, medusa=medusa, eagle=eagle)


def _medusa(root: Path, m: dict, target: GraphSpec) -> MedusaSpec:
    """Validate the optional ``medusa`` section against the target graph it reads from."""
    spec = MedusaSpec(**{f.name: _require(m, f.name, "medusa.") for f in fields(MedusaSpec)})
    _check_head_section(root, spec, target, "medusa", "medusa heads", plural=True)
    depth = _require(spec.tree, "depth", "medusa.tree.")
    if depth > spec.num_heads:
        raise EngineError(f"manifest.json: medusa.tree is {depth} deep but there are only {spec.num_heads} heads")
    return spec


def _eagle(root: Path, m: dict, target: GraphSpec) -> EagleSpec:
    """Validate the optional ``eagle`` section against the target graph it reads from."""
    optional = {"version", "fc_file", "aux_hidden_layers", "draft_vocab_size"}
    spec = EagleSpec(**{f.name: _require(m, f.name, "eagle.") for f in fields(EagleSpec) if f.name not in optional},
                     **{k: m[k] for k in optional if k in m})
    _check_head_section(root, spec, target, "eagle", "EAGLE head", plural=False)
    for key in ("depth", "topk"):
        if int(_require(spec.tree, key, "eagle.tree.")) < 1:
            raise EngineError(f"manifest.json: eagle.tree.{key} must be >= 1")
    if spec.version not in (1, 3):
        raise EngineError(f"manifest.json: eagle.version must be 1 or 3, got {spec.version!r}")
    if spec.version == 3:
        if not spec.fc_file or not (root / spec.fc_file).is_file():
            raise EngineError(f"engine dir {root}: the EAGLE-3 fc graph file {spec.fc_file!r} is missing")
        if target.aux_hidden_layers is None or list(target.aux_hidden_layers) != list(spec.aux_hidden_layers or []):
            raise EngineError(f"manifest.json: the EAGLE-3 head fuses layers {spec.aux_hidden_layers} but the target "
                              f"outputs aux_hidden of layers {target.aux_hidden_layers}")
    return spec


def _check_head_section(root: Path, spec, target: GraphSpec, section: str, label: str, plural: bool) -> None:
    """Checks shared by the ``medusa`` and ``eagle`` sections: the head graph file exists, the target
    outputs ``hidden``, hidden/vocab sizes match the target, and the tree fits its tree-verify shape."""
    if not (root / spec.file).is_file():
        raise EngineError(f"engine dir {root}: {label} graph file {spec.file!r} is missing")
    geo = target.geometry
    if not target.has_hidden:
        raise EngineError(f"manifest.json: {label} need{'' if plural else 's'} a target graph with the `hidden` "
                          "output (has_hidden)")
    if (spec.hidden_size, spec.vocab_size) != (geo.hidden_size, geo.vocab_size):
        raise EngineError(f"manifest.json: {label} (hidden {spec.hidden_size}, vocab {spec.vocab_size}) "
                          f"{'do' if plural else 'does'} not match the target (hidden {geo.hidden_size}, "
                          f"vocab {geo.vocab_size})")
    nodes = _require(spec.tree, "nodes", f"{section}.tree.")
    if target.shapes.get("tree_verify") != nodes:
        raise EngineError(f"manifest.json: {section}.tree has {nodes} nodes but models.target.shapes.tree_verify "
                          f"is {target.shapes.get('tree_verify')}")


def check_vocab_match(target: GraphSpec, draft: GraphSpec) -> None:
    """A draft must score the same token ids as the target; otherwise p and q are not comparable."""
    check_vocab(target.geometry.vocab_size, draft.geometry.vocab_size, target.vocab_sha256, draft.vocab_sha256)


def check_vocab(target_size, draft_size, target_sha256: str, draft_sha256: str) -> None:
    """``check_vocab_match`` on the raw facts (export checks them from the checkpoints, before any graph);
    a size of None is not compared."""
    if None not in (target_size, draft_size) and target_size != draft_size:
        raise EngineError(f"draft vocabulary differs from the target's: draft has {draft_size} logits, "
                          f"target {target_size}")
    if target_sha256 != draft_sha256:
        raise EngineError("draft vocabulary differs from the target's: same size but different tokenizer "
                          f"vocabularies (sha256 {draft_sha256[:12]} vs {target_sha256[:12]})")
