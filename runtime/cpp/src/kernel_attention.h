// specrt's CPU attention kernel in libspecrt: custom_ops/attention.cpp is compiled into the library
// (-march=native) and registered in a session whose graph has its GroupQueryAttention nodes renamed to
// the kernel's domain, as the Python runtime does (engines/ort.py, custom_ops/__init__.py).
//
// Which attention a graph runs: "specrt" (the kernel), "ort" (ONNX Runtime's) or "auto" (the default:
// the kernel where this build has its vector code, AVX-512 or AVX2 with FMA; else ONNX Runtime's).
// A graph whose attention nodes are not all ones the kernel computes (a window, a softcap, separate K/V
// inputs, ...) runs ONNX Runtime's whatever was asked, as in Python.
#pragma once
#include <string>

#include "ort.h"

namespace specrt::impl {

// "specrt" or "ort" for `asked` ("auto" | "ort" | "specrt"; "": $SPECRT_ATTENTION, else "auto");
// ArgumentError for any other value.
std::string resolve_attention(const std::string &asked);

// Whether this build runs the kernel's vector code (AVX-512, or AVX2 with FMA); its portable code is
// slower than ONNX Runtime's attention, so "auto" keeps ONNX Runtime's without it.
bool kernel_has_vector_code();

// Whether graphs on the kernel run their int4 MatMulNBits nodes on specrt's int4 matmul too
// (custom_ops/matmul_nbits.cpp): $SPECRT_MATMUL "auto" (the default: where the CPU has AVX-512 VNNI), "ort" or
// "specrt" (ArgumentError without AVX-512 VNNI); ArgumentError for any other value.
bool resolve_matmul();

// `model` (a serialized ModelProto) with its com.microsoft::GroupQueryAttention nodes moved to the kernel's
// domain (and that domain's opset imported), when the kernel computes every one of them; `nodes` = how many
// (0: none renamed, and the returned string is empty). With `matmul`, the MatMulNBits nodes the int4 matmul
// computes move too, each SwiGLU activation after one folded into it (custom_ops/__init__.py fuse_swiglu's rule);
// `matmuls` = how many. EngineError for bytes that are not a ModelProto.
std::string kernel_attention_model(const std::string &model, bool matmul, int &nodes, int &matmuls);

// Register the kernel's custom op domain in `options` (once per options object).
void register_kernel(Ort::SessionOptions &options);

}  // namespace specrt::impl
