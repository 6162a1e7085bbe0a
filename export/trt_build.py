"""`specrt export --trt`: one TensorRT plan per exported ONNX graph.

Each plan gets one optimization profile per fixed query length the runtime uses (decode 1,
every chain verify 2..γ+1, the prefill chunk, the tree-verify size) and per batch size; within
a profile the past length ranges over 0..max_len. Reduced precision: TensorRT 10 takes the
fp16/bf16 builder flags (weak typing) over an fp32 graph; TensorRT 11 removed those flags and
builds strongly typed networks, whose precision is the ONNX graph's own (export with
``--dtype fp16``). A timing cache (``trt/timing.cache``) is loaded before and saved after each
build, so rebuilding is fast. Plans land in ``ENGINE_DIR/trt/<role>.plan``; the manifest
records them under ``models.<role>.trt`` (docs/engine-format.md).

Written against TensorRT's documented Python API (``tensorrt`` 10.x and later); nothing here
runs without tensorrt and an NVIDIA GPU.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

PRECISIONS = ("fp32", "fp16", "bf16")


class TrtBuildError(RuntimeError):
    pass


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as e:
        raise TrtBuildError(f"needs tensorrt (not installed): pip install 'specrt[tensorrt]' ({e})") from None
    return trt


def profile_shapes(spec: dict, q: int, batch: int, max_len: int) -> dict:
    """{input name: (min, opt, max)} for one fixed query length and batch; past 0..max_len."""
    h, d = spec["num_kv_heads"], spec["head_dim"]
    opt_p = max_len // 2
    shapes = {
        "input_ids": ((batch, q),) * 3,
        "position_ids": ((batch, q),) * 3,
        "attention_mask": ((batch, 1, q, q), (batch, 1, q, opt_p + q), (batch, 1, q, max_len + q)),
    }
    past = ((0, batch, h, d), (opt_p, batch, h, d), (max_len, batch, h, d))
    for i in range(spec["num_layers"]):
        shapes[f"past_key.{i}"] = past
        shapes[f"past_value.{i}"] = past
    return shapes


def build_plan(onnx_path: Path, plan_path: Path, spec: dict, queries, batches, max_len: int, precision: str,
               timing_cache: Path, workspace_gib: float = 8.0, log=print) -> dict:
    """Build and write one plan; returns its manifest record."""
    trt = import_tensorrt()
    if precision not in PRECISIONS:
        raise TrtBuildError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    weak_typing = hasattr(trt.BuilderFlag, "FP16")  # TensorRT 10; 11 builds strongly typed networks only
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # also reads external weight data beside the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtBuildError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    graph_dtype = spec["dtype"]
    if precision != "fp32" and precision != graph_dtype:
        if not weak_typing:
            raise TrtBuildError(f"this TensorRT ({trt.__version__}) builds strongly typed networks only (no "
                                f"BuilderFlag.{precision.upper()}): the plan's precision is the ONNX graph's "
                                f"({graph_dtype}); export with --dtype {precision} instead")
        config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.BF16)
    blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(blob)
    config.set_timing_cache(cache, False)
    profiles = []
    for b in batches:
        for q in queries:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in profile_shapes(spec, q, b, max_len).items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
            profiles.append({"batch": b, "query": q, "past": [0, max_len]})
    t0 = time.time()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TrtBuildError(f"TensorRT failed to build a plan for {onnx_path.name} (see the TensorRT log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(plan))
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    seconds = time.time() - t0
    log(f"  TensorRT plan {plan_path.name}: {len(profiles)} profiles, {precision}, built in {seconds:.0f} s")
    return {"plan": str(plan_path.relative_to(plan_path.parent.parent)), "precision": precision,
            "profiles": profiles, "tensorrt_version": trt.__version__, "build_seconds": round(seconds, 1)}


def build_engine_plans(engine_dir, precision: str = "fp16", batches=(1,), workspace_gib: float = 8.0,
                       log=print) -> dict:
    """Build a plan for every model graph of an exported engine dir and record them in its manifest."""
    from ..engines.manifest import load_manifest

    m = load_manifest(engine_dir)
    raw = json.loads((m.root / "manifest.json").read_text())
    records = {}
    for role, spec in m.graphs.items():
        if spec.kv_layout == "in_place":
            raise TrtBuildError(f"{spec.file} is a fused graph (ONNX Runtime contrib ops): TensorRT builds from "
                                "traced graphs; export with --graph traced")
        entry = raw["models"][role]
        queries = sorted({*range(1, m.gamma + 2), *map(int, spec.shapes.values())})
        records[role] = build_plan(m.root / spec.file, m.root / "trt" / f"{role}.plan", entry, queries,
                                   sorted(set(batches)), m.max_len, precision, m.root / "trt" / "timing.cache",
                                   workspace_gib, log)
        entry["trt"] = records[role]
    (m.root / "manifest.json").write_text(json.dumps(raw, indent=1))
    load_manifest(m.root)
    return records
