"""A checkpoint opened layer by layer: the torch model of an export that never holds all its weights.

``open_lazy(dir)`` builds the HF model on the meta device and reads from the checkpoint's safetensors
files (sharded or not) only what is used: the embedding, final norm and lm_head stay resident; each
decoder layer's weights are read (as fp32) when a forward reaches it and dropped when it leaves, and
``resident(layer)`` holds one layer's weights for code that reads them outside a forward (the fused
graph builder). A forward of the lazy model is the HF model's own forward, so references computed
with it (export/parity.py) are the ones a fully loaded model gives; peak memory is the resident
tensors plus one layer (SmolLM2-1.7B: ~0.4 GB + 0.27 GB instead of 6.8 GB).

    model = open_lazy(Path("SmolLM2-1.7B"))        # None where this checkpoint cannot be read lazily
    logits = model(input_ids=ids).logits            # reads every layer once
    with resident(model.model.layers[3]):
        w = model.model.layers[3].mlp.up_proj.weight  # a real fp32 tensor here
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The tensors of a safetensors checkpoint dir by name, each read as fp32 with plain file reads (no
    memory map: the process holds what it asked for, not the pages of the whole file)."""

    DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}  # BF16: widened below

    def __init__(self, model_dir: Path):
        index = model_dir / SAFETENSORS_INDEX
        files = ({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()} if index.is_file()
                 else {model_dir / "model.safetensors"})
        self.entries = {}  # name -> (file, dtype, shape, byte offset, byte length)
        for path in sorted(files):
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for name, t in header.items():
                if name != "__metadata__":
                    start, end = t["data_offsets"]
                    self.entries[name] = (path, t["dtype"], t["shape"], 8 + size + start, end - start)

    def __contains__(self, name: str) -> bool:
        return name in self.entries and self.entries[name][1] in self.DTYPES

    def read(self, name: str) -> torch.Tensor:
        path, dtype, shape, offset, length = self.entries[name]
        raw = np.empty(length // np.dtype(self.DTYPES[dtype]).itemsize, self.DTYPES[dtype])
        with open(path, "rb") as f:
            f.seek(offset)
            f.readinto(memoryview(raw).cast("B"))
        if dtype == "BF16":  # the top half of an fp32: exact
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(raw.astype(np.float32, copy=False).reshape(shape))


def is_lazy(model) -> bool:
    """Whether ``model`` was opened by ``open_lazy``."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return any(getattr(layer, "_specrt_lazy", None) is not None for layer in layers)


def checkpoint_bytes(model_dir: Path) -> int:
    """The checkpoint's size in fp32 (its parameter count times 4), from the safetensors headers; 0 where
    the weights are not in safetensors files."""
    if lazy_unavailable(model_dir):
        return 0
    return sum(4 * int(np.prod(e[2])) for e in Checkpoint(model_dir).entries.values())


def lazy_unavailable(model_dir: Path) -> str | None:
    """Why ``model_dir`` cannot be opened lazily (None: it can)."""
    if not ((model_dir / "model.safetensors").is_file() or (model_dir / SAFETENSORS_INDEX).is_file()):
        return "its weights are not in safetensors files"
    return None


def open_lazy(model_dir: Path):
    """The HF causal LM of ``model_dir`` with lazily read decoder layers (see the module docstring), or None
    where its parameters do not map one to one onto the checkpoint's tensors (it is then loaded whole)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    ckpt = Checkpoint(model_dir)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or any(True for layer in layers for _ in layer.buffers()):
        return None
    in_layers = {id(p) for p in layers.parameters()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, module in model.named_modules():  # the resident tensors, read once
        for key, p in list(module._parameters.items()):
            full = f"{name}.{key}" if name else key
            if p is None or id(p) in in_layers or (tied and module is model.get_output_embeddings()):
                continue
            if full not in ckpt:
                return None
            module._parameters[key] = torch.nn.Parameter(ckpt.read(full), requires_grad=False)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:  # its buffers are computed, not stored
        model.model.rotary_emb = type(rotary)(config=model.config)
    if any(b.is_meta for b in model.buffers()):
        return None
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}."
        if any(prefix + n not in ckpt for n, _ in layer.named_parameters()):
            return None
        layer._specrt_lazy = (ckpt, prefix)
        layer.register_forward_pre_hook(lambda m, args: _load(m))
        layer.register_forward_hook(lambda m, args, out: _drop(m))
    model.name_or_path = str(model_dir)  # where export/parity.py finds the tokenizer
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return model


def _modules_params(layer):
    for module in layer.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                yield module, key, p


def _load(layer) -> None:
    ckpt, prefix = layer._specrt_lazy
    names = dict((id(p), n) for n, p in layer.named_parameters())
    for module, key, p in _modules_params(layer):
        if p.is_meta:
            module._parameters[key] = torch.nn.Parameter(ckpt.read(prefix + names[id(p)]), requires_grad=False)


def _drop(layer) -> None:
    for module, key, p in _modules_params(layer):
        module._parameters[key] = torch.nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=False)


@contextlib.contextmanager
def resident(layer):
    """Hold ``layer``'s weights in memory within the block (nothing to do for a layer that is not lazy)."""
    if getattr(layer, "_specrt_lazy", None) is None:
        yield
        return
    _load(layer)
    try:
        yield
    finally:
        _drop(layer)
