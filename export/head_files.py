"""The on-disk form shared by trained head dirs (Medusa heads, EAGLE head): config.json + model.safetensors."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def write_head_dir(out: str | Path, state: dict, cfg, fmt: str, dtype, extra: dict | None = None) -> Path:
    """Write ``state`` (cast to ``dtype``) as model.safetensors and ``cfg`` + ``extra`` as config.json."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype) if v.is_floating_point() else v.detach() for k, v in state.items()}  # ids stay ints
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = {"format": fmt, **asdict(cfg), "dtype": str(dtype).replace("torch.", ""), **(extra or {})}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def read_head_dir(head_dir: str | Path, fmt: str, cfg_cls, error, kind: str, noun: str, train_cmd: str):
    """(cfg_cls instance, raw config) of a head dir; ``error`` (an exception class) names what is wrong.

    kind: "an EAGLE head" / "a Medusa heads" (what the dir should be); noun: "head" / "heads".
    """
    head_dir = Path(head_dir)
    path = head_dir / "config.json"
    if not path.is_file() or not (head_dir / "model.safetensors").is_file():
        raise error(f"{head_dir} is not {kind} dir (needs config.json and model.safetensors; "
                    f"train one with `{train_cmd}`)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON: {e}") from None
    if raw.get("format") != fmt:
        raise error(f"{path}: format is {raw.get('format')!r}, expected {fmt!r}")
    try:
        cfg = cfg_cls(**{k: raw[k] for k in cfg_cls.__dataclass_fields__ if k in raw})
    except TypeError as e:
        raise error(f"{path}: incomplete {noun} config ({e})") from None
    return cfg, raw
