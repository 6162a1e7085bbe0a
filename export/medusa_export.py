"""`specrt export --medusa HEADS_DIR --tree NAME|FILE`: the target's export options for Medusa heads and
the heads' graph (export/medusa_heads.py; specrt's heads dirs or FasterDecoding's, export/medusa_upstream.py).

The target gets the ``hidden`` output and the tree-verify shape Q = tree.size; the heads graph
``medusa.onnx`` computes heads 1..tree.depth only.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..engines.wrapper import geometry
from .errors import ExportError
from .medusa_config import HeadsError
from .medusa_heads import check_heads_match, export_heads_graph, load_heads, read_heads_config
from .medusa_upstream import base_model_of


def check_medusa(medusa_dir, tree):
    """Fail before any export if the heads dir is unusable or too shallow for the tree; returns its HeadsConfig."""
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


def medusa_target_config(medusa_dir, heads_cfg, tree, model, target_vocab: str, target_dir, cfg):
    """The target's ExportConfig for the heads (hidden, a parity case at the tree's shape); ExportError for
    heads of another target, before the long export."""
    geo = geometry(model)
    base = base_model_of(medusa_dir)
    try:
        check_heads_match(heads_cfg, geo.hidden_size, geo.vocab_size, target_vocab,
                          where=f"heads {medusa_dir}" + (f" (base model {base})" if base else ""))
    except HeadsError as e:
        raise ExportError(f"{e} (target {target_dir})") from None
    return replace(cfg, with_hidden=True, tree_mask=tree.mask)


def export_medusa(medusa_dir, tree, out: Path, cfg, log) -> dict:
    """Export the heads graph beside the target; returns the manifest's ``medusa`` section."""
    heads, raw = load_heads(medusa_dir)
    log(f"exporting medusa heads 1..{tree.depth} of {heads.cfg.num_heads} from {medusa_dir} (tree {tree.name!r}: "
        f"{tree.size} nodes, depth {tree.depth}) ...")
    # a depth-D tree reads heads 1..D only: the graph computes no more (each head is a V x H projection)
    section = export_heads_graph(heads.first(tree.depth), out / "medusa.onnx", cfg.dtype, cfg.opset)
    log(f"  medusa: {section['parameters'] / 1e6:.2f}M params; max |ORT - torch| {section['parity_max_abs_diff']:.1e}")
    return {**section, "tree": tree.to_json(), "source": str(Path(medusa_dir).resolve()),
            "trained_heads": heads.cfg.num_heads, "accuracy": raw.get("accuracy")}
