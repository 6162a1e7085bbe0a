"""The fused decoder graph: a Llama-family model written op by op with ONNX Runtime's fused kernels.

``torch.onnx`` traces HF attention into ~600 small nodes per step (RoPE slices, mask arithmetic,
transposes) and concatenates the whole past K/V inside the graph every call (docs/decode-step-study).
This builder writes the same function from the HF weights with ~11 nodes per layer:

    Gather(embed) -> per layer:
        (Skip)SimplifiedLayerNormalization -> MatMul(packed QKV) [+ Add(bias)]
        -> GroupQueryAttention(do_rotary, cos/sin caches, position_ids, attention_bias = the mask)
        -> MatMul(o_proj) -> SkipSimplifiedLayerNormalization -> gate|up MatMul, Split, SiLU, Mul -> down MatMul
    -> SkipSimplifiedLayerNormalization(final norm) -> MatMul(lm_head)

K/V are head-major [B, Hkv, max_len, D] and ``past_*`` / ``present_*`` are meant to be ONE buffer per
layer (ORT's shared past/present buffer): GroupQueryAttention writes the Q new entries in place at
[seqlens_k + 1 - Q, seqlens_k + 1) of each row, so no step copies the past (contract.KV_IN_PLACE).
The additive mask and position_ids are the ones the traced graph takes, so chains, trees and
stale cache entries work unchanged; a sliding-window layer (Mistral, Qwen2's ``max_window_layers``) takes
that mask with its window applied in the graph (export/windows.py). ONNX Runtime's CPU kernel runs Q > 1
only at batch 1: export/batched_graph.py derives the graph's batched twin for calls of several rows with Q > 1.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ..contract import io_names
from .lazy_model import resident
from .tensor_store import TensorStore
from .windows import layer_windows, window_masks

FUSED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def fused_unsupported(model, dtype: str, max_len: int) -> str | None:
    """Why ``model`` cannot get the fused graph (None: it can). Sliding windows are built in, at any ``max_len``."""
    arch = type(model).__name__
    cfg = model.config
    if arch not in FUSED_ARCHITECTURES:
        return f"{arch} has no fused graph builder (fused: {', '.join(FUSED_ARCHITECTURES)})"
    if dtype != "fp32":
        return "the fused graph is built in fp32 only (ONNX Runtime's CPU kernels compute fp16 graphs in fp32)"
    if any(getattr(layer.self_attn, name, None) is not None for layer in model.model.layers[:1]
           for name in ("q_norm", "k_norm")):
        return "per-head q/k norms (Qwen3, OLMo 2) are not built into the fused graph"
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if head_dim % 16:
        return f"head_dim {head_dim} (ONNX Runtime's GroupQueryAttention needs a multiple of 16)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the fused graph has SiLU)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


def rotary_caches(model, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_len, D/2] from the model's own rotary module (any HF rope scaling, attention scaling)."""
    rotary = model.model.rotary_emb
    positions = torch.arange(max_len)[None]
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(x, positions)  # [1, max_len, D]: the two halves repeat (rotate_half layout)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


class _Graph:
    """Nodes and fp32 initializers under construction; each initializer goes to ``store`` as it is made
    (export/tensor_store.py: into the proto, or straight to the graph's data file)."""

    def __init__(self, store: TensorStore | None = None):
        self.nodes, self.inits, self.store = [], [], store or TensorStore()

    def weight(self, name: str, tensor) -> str:
        arr = tensor.detach().float().numpy() if isinstance(tensor, torch.Tensor) else tensor
        self.inits.append(self.store.tensor(name, np.asarray(arr, dtype=np.float32)))
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer of ``array``'s own dtype (``weight`` stores float32), added once."""
        if all(i.name != name for i in self.inits):
            self.inits.append(self.store.tensor(name, array))
        return name

    def node(self, op: str, inputs: list, outputs: list, ms: bool = False, **attrs) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0], domain="com.microsoft" if ms else "",
                                           **attrs))
        return outputs[0]

    def linear(self, x: str, module, name: str, out: str) -> str:
        """x @ W.T (+ b) for an nn.Linear."""
        y = self.node("MatMul", [x, self.weight(name + ".weight", module.weight.T)], [out if module.bias is None else out + "_mm"])
        if module.bias is not None:
            y = self.node("Add", [y, self.weight(name + ".bias", module.bias)], [out])
        return y

    def packed_linear(self, x: str, modules: list, name: str) -> str:
        """x @ [W_1; W_2; ...].T (+ [b_1; b_2; ...]): nn.Linears of one input as ONE MatMul (one kernel call),
        their outputs side by side along the last axis."""
        biases = [m.bias for m in modules]
        packed = SimpleNamespace(weight=torch.cat([m.weight for m in modules]),
                                 bias=None if biases[0] is None else torch.cat(biases))
        return self.linear(x, packed, name, name)


def build_fused_graph(model, max_len: int, with_hidden: bool = False, aux_layers=None,
                      store: TensorStore | None = None):
    """The fused graph of a Llama-family HF model as an ``onnx.ModelProto`` (see the module docstring);
    ``aux_layers``: also output ``aux_hidden``, the residual stream entering those layers, concatenated.
    ``store``: where the weights go (default: into the proto); a lazily opened model
    (export/lazy_model.py) is read one layer at a time."""
    from onnx import TensorProto, helper

    cfg = model.config
    layers = model.model.layers
    n_layers, heads = len(layers), cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    eps = float(cfg.rms_norm_eps)
    windows = layer_windows(cfg, max_len) or [None] * n_layers  # None: full attention
    g = _Graph(store)
    cos, sin = rotary_caches(model, max_len)
    g.weight("cos_cache", cos)
    g.weight("sin_cache", sin)
    masks = window_masks(g, windows)  # window -> the mask its layers take (None: attention_mask)
    x = g.node("Gather", [g.weight("embed", model.model.embed_tokens.weight), "input_ids"], ["embedded"])
    resid, branch = x, None  # the residual stream, and the branch still to be added to it
    layer_inputs = {0: x}  # layer i -> the graph value of the hidden state entering it
    for i, layer in enumerate(layers):
        with resident(layer):
            resid, branch = _layer(g, i, layer, resid, branch, layer_inputs, heads, kv_heads, head_dim, eps,
                                   masks[windows[i]])
    hidden = g.node("SkipSimplifiedLayerNormalization", [resid, branch, g.weight("norm", model.model.norm.weight)],
                    ["hidden" if with_hidden else "final", "", "", ""], ms=True, epsilon=eps)
    g.linear(hidden, model.get_output_embeddings(), "lm_head", "logits")
    if aux_layers:
        g.node("Concat", [layer_inputs[i] for i in aux_layers], ["aux_hidden"], axis=-1)

    inputs, outputs = io_names(n_layers, with_hidden, "in_place", bool(aux_layers))
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    in_types = {"input_ids": (i64, ["batch", "query"]), "position_ids": (i64, ["batch", "query"]),
                "attention_mask": (f32, ["batch", 1, "query", "total"]), "seqlens_k": (i32, ["batch"]),
                "total_sequence_length": (i32, [])}
    kv = (f32, ["batch", kv_heads, "max_len", head_dim])
    out_types = {"logits": (f32, ["batch", "query", cfg.vocab_size]), "hidden": (f32, ["batch", "query", cfg.hidden_size]),
                 "aux_hidden": (f32, ["batch", "query", len(aux_layers or ()) * cfg.hidden_size])}
    value_info = [helper.make_tensor_value_info(n, *in_types.get(n, kv)) for n in inputs]
    graph = helper.make_graph(g.nodes, "specrt_fused_decoder", value_info,
                              [helper.make_tensor_value_info(n, *out_types.get(n, kv)) for n in outputs], g.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    proto.ir_version = 9
    return proto


def _layer(g: _Graph, i: int, layer, resid: str, branch: str | None, layer_inputs: dict, heads: int, kv_heads: int,
           head_dim: int, eps: float, mask: str) -> tuple[str, str]:
    """Decoder layer ``i``'s nodes; returns (the residual stream, the branch still to be added to it)."""
    attn, mlp = layer.self_attn, layer.mlp
    ln1 = g.weight(f"l{i}.ln1", layer.input_layernorm.weight)
    if branch is None:
        normed = g.node("SimplifiedLayerNormalization", [resid, ln1], [f"l{i}.n1"], axis=-1, epsilon=eps,
                        stash_type=1)
    else:
        normed = g.node("SkipSimplifiedLayerNormalization", [resid, branch, ln1], [f"l{i}.n1", "", "", f"l{i}.r1"],
                        ms=True, epsilon=eps)
        resid = layer_inputs[i] = f"l{i}.r1"
    qkv = g.packed_linear(normed, [attn.q_proj, attn.k_proj, attn.v_proj], f"l{i}.qkv")
    att = g.node("GroupQueryAttention",
                 [qkv, "", "", f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_sequence_length",
                  "cos_cache", "sin_cache", "position_ids", mask],
                 [f"l{i}.att", f"present_key.{i}", f"present_value.{i}"], ms=True, num_heads=heads,
                 kv_num_heads=kv_heads, scale=float(head_dim ** -0.5), do_rotary=1, rotary_interleaved=0,
                 local_window_size=-1)
    o = g.linear(att, attn.o_proj, f"l{i}.o", f"l{i}.o")
    normed = g.node("SkipSimplifiedLayerNormalization",
                    [resid, o, g.weight(f"l{i}.ln2", layer.post_attention_layernorm.weight)],
                    [f"l{i}.n2", "", "", f"l{i}.r2"], ms=True, epsilon=eps)
    resid = f"l{i}.r2"
    gate_up = g.packed_linear(normed, [mlp.gate_proj, mlp.up_proj], f"l{i}.gate_up")  # split in halves below
    halves = g.const("gate_up/split", np.array([mlp.gate_proj.out_features] * 2, np.int64))
    gate, up = g.node("Split", [gate_up, halves], [f"l{i}.gate", f"l{i}.up"], axis=-1), f"l{i}.up"
    silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], [f"l{i}.sig"])], [f"l{i}.silu"])
    branch = g.linear(g.node("Mul", [silu, up], [f"l{i}.act"]), mlp.down_proj, f"l{i}.down", f"l{i}.down")
    return resid, branch


def linear_inputs(model, with_hidden: bool = False) -> dict:
    """The fused graph's MatMul inputs by name -> the HF nn.Linear that reads the same activation: where
    export/smooth.py's statistics are taken on the torch model (``smooth.recording_activation_max``)."""
    out = {"hidden" if with_hidden else "final": model.get_output_embeddings()}
    for i, layer in enumerate(model.model.layers):
        out.update({f"l{i}.n1": layer.self_attn.q_proj, f"l{i}.att": layer.self_attn.o_proj,
                    f"l{i}.n2": layer.mlp.gate_proj, f"l{i}.act": layer.mlp.down_proj})
    return out


def run_in_place(engine, feeds: list[np.ndarray], max_len: int, stale: float = np.nan) -> list[np.ndarray]:
    """Run the fused graph on a traced-graph parity case (the traced graph's inputs, batch 1).

    The time-major past [P, 1, Hkv, D] goes into head-major buffers of ``max_len`` entries whose
    stale part is filled with ``stale`` (NaN: a stale entry that leaked into a result would show);
    returns the traced graph's outputs: logits, the new K/V read back from the buffers at [P, P+Q)
    as [Q, 1, Hkv, D], and hidden / aux_hidden where the graph has them.
    """
    from ..engines.ort import Binding

    ids, positions, mask, *past = feeds
    p, q = past[0].shape[0], ids.shape[1]
    binding = Binding(engine)
    caches = []
    for name, t in zip([n for n in engine.input_names if n.startswith("past_")], past):
        buf = np.full((1, t.shape[2], max_len, t.shape[3]), stale, dtype=np.float32)
        buf[0, :, :p] = t.float().numpy()[:, 0].transpose(1, 0, 2)
        binding.cache(name, name.replace("past_", "present_"), buf)
        caches.append(buf)
    binding.inputs(input_ids=ids.numpy(), position_ids=positions.numpy(), attention_mask=mask.float().numpy(),
                   seqlens_k=np.array([p + q - 1], np.int32), total_sequence_length=np.array(p + q, np.int32))
    for meta in engine.session.get_outputs():
        if not meta.name.startswith("present_"):
            binding.output(meta.name, (1, q, meta.shape[-1]))
    outs = binding.run()
    new = [buf[0, :, p:p + q].transpose(1, 0, 2)[:, None] for buf in caches]  # [Q, 1, Hkv, D]
    return [outs["logits"], *new] + [outs[n] for n in ("hidden", "aux_hidden") if n in outs]
