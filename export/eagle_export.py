"""`specrt export --eagle HEAD_DIR`: the target's export options for an EAGLE head and the head's graphs.

The head dir's version decides: an EAGLE-1 head (export/eagle_head.py) reads the target's ``hidden``;
an EAGLE-3 head (export/eagle3_head.py; specrt's ``version: 3``, SafeAILab's or speculators' format)
reads ``aux_hidden``, the hidden states entering its three layers, so the target graph gets that
output too (traced and fused graphs both build it) and the fc graph ``eagle_fc.onnx`` is written.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..engines.wrapper import geometry
from ..trees import compile_tree
from .eagle3_head import export_head3_graphs, is_eagle3, load_head3, read_head3_config, resolve_aux_layers
from .eagle_config import EagleError
from .eagle_head import check_head_match, export_head_graph, load_head, read_head_config
from .errors import ExportError
from .hf_checkpoint import load_hf


def check_eagle_tree(eagle_tree) -> dict:
    """The dynamic draft tree's budget ({"nodes", "depth", "topk"}; defaults filled in); ExportError if invalid."""
    t = {"nodes": 32, "depth": 5, "topk": 8, **(eagle_tree or {})}
    if not all(isinstance(t[k], int) and t[k] >= 1 for k in ("nodes", "depth", "topk")) or t["nodes"] < 2:
        raise ExportError(f"EAGLE tree needs integers nodes >= 2, depth >= 1, topk >= 1; got {t}")
    return {k: t[k] for k in ("nodes", "depth", "topk")}


def eagle_target_config(eagle_dir, eagle_tree: dict, model, target_vocab: str, target_dir, cfg):
    """The target's ExportConfig for the head (hidden, EAGLE-3's aux_hidden, a parity case at Q = nodes);
    ExportError for a head of another target, before the long export."""
    geo = geometry(model)
    aux = None
    try:
        if is_eagle3(eagle_dir):
            head_cfg = read_head3_config(eagle_dir)[0]
            aux = tuple(resolve_aux_layers(head_cfg, geo.num_layers))
        else:
            head_cfg = read_head_config(eagle_dir)[0]
        check_head_match(head_cfg, geo.hidden_size, geo.vocab_size, target_vocab, where=f"EAGLE head {eagle_dir}")
    except EagleError as e:
        raise ExportError(f"{e} (target {target_dir})") from None
    chain = compile_tree([[0] * d for d in range(1, eagle_tree["nodes"])])  # parity case at Q = nodes
    return replace(cfg, with_hidden=True, aux_layers=aux, tree_mask=chain.mask)


def export_eagle(eagle_dir, eagle_tree: dict, target_dir, target_vocab: str, out: Path, cfg, log) -> dict:
    """Export the EAGLE head beside the target; returns the manifest's ``eagle`` section."""
    model = load_hf(target_dir).float()
    version = 3 if is_eagle3(eagle_dir) else 1
    try:
        if version == 3:
            head, raw = load_head3(eagle_dir, model)
            log(f"exporting EAGLE-3 head from {eagle_dir} (layers {head.cfg.aux_layers}, draft vocabulary "
                f"{head.cfg.draft_vocab}; dynamic tree: {eagle_tree}) ...")
            section = export_head3_graphs(head, out, cfg.dtype, cfg.opset)
        else:
            head, raw = load_head(eagle_dir, model)
            log(f"exporting EAGLE head from {eagle_dir} (dynamic tree: {eagle_tree}) ...")
            section = export_head_graph(head, out / "eagle.onnx", cfg.dtype, cfg.opset)
    except EagleError as e:
        raise ExportError(str(e)) from None
    log(f"  eagle: {section['parameters'] / 1e6:.2f}M params; max |ORT - torch| {section['parity_max_abs_diff']:.1e}")
    return {**section, "tree": eagle_tree, "source": str(Path(eagle_dir).resolve()), "accuracy": raw.get("accuracy")}
