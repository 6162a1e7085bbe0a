"""`specrt export`: local HF checkpoints (or GGUF files) -> engine dir."""
from __future__ import annotations

import click


@click.command()
@click.option("--target", "target", required=True, type=click.Path(exists=True),
              help="The target model: a local HF checkpoint dir, or a GGUF file (llama.cpp / Ollama; read through "
                   "transformers, weights dequantized, then quantized again as --quantize says).")
@click.option("--draft", type=click.Path(exists=True),
              help="A draft model: a local HF checkpoint dir or a GGUF file.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Engine dir to write.")
@click.option("--force", is_flag=True, help="Replace an existing engine dir at --out (whole; it is never mixed).")
@click.option("--verbose", is_flag=True, help="Show the tracer's warnings and transformers' loading bars.")
@click.option("--gamma", default=8, show_default=True, type=click.IntRange(1, 64),
              help="Chain-verify draft length (verify shape gamma+1; the adaptive maximum).")
@click.option("--max-len", default=2048, show_default=True, type=click.IntRange(2), help="KV cache capacity in tokens.")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--graph", default="auto", show_default=True, type=click.Choice(["auto", "fused", "traced"]),
              help="fused: ONNX Runtime's fused attention/norm ops, KV cache written in place (Llama, Mistral, "
                   "Qwen2; CPU; 1.3-2.3x faster steps); traced: torch.onnx (any family; torch/CUDA/TensorRT); "
                   "auto: fused where the model has it.")
@click.option("--quantize", type=click.Choice(["none", "int8", "int4", "w8a8"]), default="none", show_default=True,
              help="Weight quantization of every MatMul (int8/int4: ORT MatMulNBits, blocks of 32; w8a8: ORT's "
                   "integer GEMM, per-row int8 activations, a verify pass costing ~1.1x a decode step: "
                   "docs/export.md); speculation is exact w.r.t. the quantized target's verify passes (see "
                   "docs/real-models.md for how they differ from its decode steps).")
@click.option("--draft-quantize", type=click.Choice(["same", "none", "int8", "int4", "w8a8"]), default="same",
              show_default=True, help="The draft's quantization (same: as --quantize).")
@click.option("--prefill-chunk", default=128, show_default=True, type=click.IntRange(1), help="Prompt tokens per prefill call.")
@click.option("--prefill-graph/--no-prefill-graph", default=True, show_default=True,
              help="int4/int8 (MatMulNBits) targets: also write a prefill graph on the integer kernel (prompts ~3x "
                   "faster on CPU; the layers' weights once more in int8: docs/export.md).")
@click.option("--low-memory", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Read the checkpoint a layer at a time and write the graphs a tensor at a time (safetensors "
                   "checkpoints of fused-graph families; the same engine, in a fraction of the memory: "
                   "docs/export.md). auto: for checkpoints over 1 GiB in fp32.")
@click.option("--measure-default/--no-measure-default", default=True, show_default=True,
              help="Time every method the engine dir has on a few prompts here and make the fastest (plain "
                   "decoding included) the manifest's default method (docs/export.md).")
@click.option("--medusa", "medusa_dir", type=click.Path(exists=True, file_okay=False),
              help="Medusa heads dir (`specrt train medusa`): exported as medusa.onnx; the target also outputs hidden.")
@click.option("--tree", default="medusa-32", show_default=True,
              help="Medusa candidate tree: a default (medusa-8/16/32/64) or a JSON file of paths; "
                   "its node count is the target's tree-verify shape.")
@click.option("--eagle", "eagle_dir", type=click.Path(exists=True, file_okay=False),
              help="EAGLE head dir (`specrt train eagle`; SafeAILab/speculators EAGLE-1/3 dirs too): exported as "
                   "eagle.onnx; the target also outputs hidden (EAGLE-3, detected from the dir's config: aux_hidden "
                   "of its three layers, and eagle_fc.onnx).")
@click.option("--eagle-nodes", default=32, show_default=True, type=click.IntRange(2),
              help="EAGLE dynamic tree: nodes per verify pass, root included (the target's tree-verify shape).")
@click.option("--eagle-depth", default=5, show_default=True, type=click.IntRange(1), help="EAGLE draft depth.")
@click.option("--eagle-topk", default=8, show_default=True, type=click.IntRange(1),
              help="EAGLE: children per node and nodes expanded per depth.")
@click.option("--torch-weights", is_flag=True,
              help="Also save the HF weights (safetensors) to OUT/torch/<role>/: what the torch backend runs.")
@click.option("--trt", "trt", is_flag=True, help="Also build a TensorRT plan per graph (needs tensorrt and a GPU).")
@click.option("--parity-bounds", metavar="off|KEY=VALUE,...",
              help="Override the parity bounds (docs/export.md, Parity): 'off' (measure and record only) or "
                   "some of kl_mean, kl_max, top1, rel, e.g. 'kl_mean=0.8,top1=0.7' ('none' lifts one). "
                   "Prints a warning; the manifest records the override.")
@click.option("--trt-precision", default="fp16", show_default=True, type=click.Choice(["fp32", "fp16", "bf16"]),
              help="TensorRT plan precision (TensorRT 11: must equal --dtype, strong typing only).")
def export(target, draft, out, force, verbose, gamma, max_len, dtype, graph, quantize, draft_quantize, prefill_chunk,
           prefill_graph, medusa_dir, tree, torch_weights, trt, trt_precision, eagle_dir=None, eagle_nodes=32, eagle_depth=5,
           eagle_topk=8, parity_bounds=None, low_memory="auto", measure_default=True):
    """Export TARGET (and DRAFT) to ONNX, check ORT against PyTorch, write manifest.json.

    The engine dir appears at --out only when every graph passed its parity check."""
    try:
        from ...export.errors import ExportError
        from ...export.onnx_export import ExportConfig, export_engine
        from ...engines.wrapper import UnsupportedArchitecture
    except ImportError as e:
        raise click.ClickException(f"exporting needs torch, transformers and onnx: pip install 'specrt[export]' ({e})")
    from ...engines import EngineError

    from ...trees import TreeError, load_tree

    if trt:  # fail before a long export when TensorRT is missing
        from ...export.trt_build import TrtBuildError, import_tensorrt

        try:
            import_tensorrt()
        except TrtBuildError as e:
            raise click.ClickException(str(e))
    if trt and graph == "fused":
        raise click.ClickException("--trt builds plans from traced graphs: use --graph traced (or auto)")
    none = {"none": None}
    cfg = ExportConfig(gamma=gamma, max_len=max_len, dtype=dtype, prefill_chunk=prefill_chunk,
                       torch_weights=torch_weights, graph="traced" if trt else graph,
                       quantize=none.get(quantize, quantize), draft_quantize=none.get(draft_quantize, draft_quantize),
                       parity_bounds=parity_bounds, prefill_graph=prefill_graph, low_memory=low_memory)
    if parity_bounds is not None:
        from ...export.parity import parse_override

        try:
            parse_override(parity_bounds)
        except ExportError as e:
            raise click.ClickException(str(e))
        click.echo(f"WARNING: --parity-bounds {parity_bounds}: the export's parity bounds are overridden; the "
                   "engine dir's manifest records it (models.<role>.parity.override)", err=True)
    try:
        medusa = dict(medusa_dir=medusa_dir, tree=load_tree(tree)) if medusa_dir else {}
        if eagle_dir:
            medusa.update(eagle_dir=eagle_dir, eagle_tree={"nodes": eagle_nodes, "depth": eagle_depth,
                                                           "topk": eagle_topk})
        path = export_engine(target, out, draft_dir=draft, cfg=cfg, log=click.echo, force=force, verbose=verbose, **medusa)
    except (ExportError, UnsupportedArchitecture, EngineError, TreeError) as e:
        raise click.ClickException(str(e))
    if trt:
        from ...export.trt_build import build_engine_plans

        try:
            build_engine_plans(path, precision=trt_precision, log=click.echo)
        except (TrtBuildError, EngineError) as e:
            raise click.ClickException(str(e))
    if measure_default:
        from ..profile.default_method import choose_default

        choose_default(path, log=click.echo)
    click.echo(f"engine dir written: {path}")
