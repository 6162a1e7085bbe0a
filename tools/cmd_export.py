"""`specrt export`: local HF checkpoints -> engine dir."""
from __future__ import annotations

import click


@click.command()
@click.option("--target", "target", required=True, type=click.Path(exists=True, file_okay=False),
              help="Local HF checkpoint dir of the target model.")
@click.option("--draft", type=click.Path(exists=True, file_okay=False), help="Local HF checkpoint dir of a draft model.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Engine dir to write.")
@click.option("--gamma", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Chain-verify draft length (verify shape gamma+1; the adaptive maximum).")
@click.option("--max-len", default=2048, show_default=True, type=click.IntRange(2), help="KV cache capacity in tokens.")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16"]))
@click.option("--prefill-chunk", default=128, show_default=True, type=click.IntRange(1), help="Prompt tokens per prefill call.")
def export(target, draft, out, gamma, max_len, dtype, prefill_chunk):
    """Export TARGET (and DRAFT) to ONNX, check ORT against PyTorch, write manifest.json."""
    try:
        from ..export.onnx_export import ExportConfig, ExportError, export_engine
        from ..export.wrapper import UnsupportedArchitecture
    except ImportError as e:
        raise click.ClickException(f"exporting needs torch, transformers and onnx: pip install 'specrt[export]' ({e})")
    from ..engines import EngineError

    cfg = ExportConfig(gamma=gamma, max_len=max_len, dtype=dtype, prefill_chunk=prefill_chunk)
    try:
        path = export_engine(target, out, draft_dir=draft, cfg=cfg, log=click.echo)
    except (ExportError, UnsupportedArchitecture, EngineError) as e:
        raise click.ClickException(str(e))
    click.echo(f"engine dir written: {path}")
