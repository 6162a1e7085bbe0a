// specrt's int4 matmul: an ONNX Runtime custom op, ai.specrt::MatMulNBits, that computes what
// com.microsoft::MatMulNBits computes at accuracy level 4 (int8 activations) for the graphs specrt
// exports: 4-bit symmetric weights in blocks of 32 along K (zero point 8, one fp32 scale a block), no
// bias, K a multiple of 32 and N of 16. Y[m, n] = sum over blocks b of sa[m, b] * sw[n, b] * dot(qa, qw),
// where each row's activations are quantized to int8 per block of 32 (sa = max|a| / 127, round to nearest).
//
// Why: ONNX Runtime's kernel at level 4 costs ~0.2 decode steps per extra row (T(5)/T(1) ~1.8 on SmolLM2),
// so a verify pass is expensive. specrt's unpacks each weight block once per call for all the call's rows, the
// weights repacked at load (matmul_nbits.h), so an extra row costs a fraction of what the first one pays.
//
// With the attribute swiglu = 1 (custom_ops/__init__.py fuse_swiglu folds a SwiGLU MLP's activation in) the node
// outputs silu(Y[:, :N/2]) * Y[:, N/2:], [M, N/2]: gate and up columns are packed in pairs of groups, each task
// computes both halves of its output columns and applies the activation while they are in cache (ONNX Runtime's
// Split, Sigmoid and two Muls, four ops a layer, and a [M, N] tensor written and read back, gone). With the
// attribute norm_epsilon (fuse_norms folds the RMS norm before it in) A is the norm's input: inputs 3 and 4 are its
// gamma and optional skip, output 1 the optional x + skip, and each row is normalized before it is quantized.
//
// Exactness: every row is computed by the same instructions in the same order whatever the call's other
// rows (its own quantization, its own accumulators), so a one-token decode step equals the same token's row
// of a verify pass bit for bit; and every ISA variant gives the same bits (matmul_nbits.h).
//
// This file is the ONNX Runtime glue and the choice of variant, compiled with the library's common flags; the
// arithmetic lives in one file per ISA (matmul_nbits_ref.cpp, _avx2.cpp, _avx512.cpp). The variant: the best this
// CPU runs (CPUID), or $SPECRT_ISA (ref, avx2, avx512; capped at what the CPU runs), read when a session opens.
#include <cstring>
#include <string>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"

#include "kernels.h"
#include "matmul_nbits.h"

namespace {

using specrt_nbits::kBlock;
using specrt_nbits::kCols;
using specrt_nbits::kTileBytes;
using specrt_nbits::Packed;
using specrt_nbits::Variant;

bool cpu_supports(const char* feature) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // __builtin_cpu_supports takes a literal: one call per name the variants need
  if (!std::strcmp(feature, "avx512")) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }
  if (!std::strcmp(feature, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return !std::strcmp(feature, "ref");
}

// The variants, best first: each runs where cpu_supports(its isa) and it was compiled in (x86-64 only but the reference)
const Variant* variants[] = {specrt_nbits::avx512_variant(), specrt_nbits::avx2_variant(), specrt_nbits::ref_variant()};

// The variant $SPECRT_ISA asks for: unset or "auto", the best this CPU runs; a name, the best this CPU runs at or below
// it (avx512 on an AVX2 machine runs avx2); nullptr for any other value
const Variant* chosen_variant() {
  const char* env = std::getenv("SPECRT_ISA");
  const std::string want = env && *env ? env : "auto";
  bool below = want == "auto";
  for (const Variant* v : variants) {
    if (!v) continue;
    below = below || want == v->isa;
    if (below && cpu_supports(v->isa)) return v;
  }
  return nullptr;
}

// b: [N, blocks, 16] bytes, element 2t of a block in byte t's low nibble, 2t + 1 in its high nibble
// (MatMulNBits' layout); scales: [N * blocks]. Packed as matmul_nbits.h says.
void pack(const uint8_t* b, const float* scales, int64_t n, int64_t k, bool swiglu, Packed& p) {
  p.n = n, p.k = k, p.groups = n / kCols, p.blocks = k / kBlock;
  const size_t bytes = static_cast<size_t>(p.groups * p.blocks * kTileBytes);
  p.data.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
  if (!p.data) throw std::bad_alloc();
  auto nibble = [&](int64_t col, int64_t blk, int64_t kk) {
    return (b[(col * p.blocks + blk) * (kBlock / 2) + kk / 2] >> (4 * (kk & 1))) & 15;
  };
  for (int64_t g = 0; g < p.groups; ++g) {
    // SwiGLU: gate group i (columns 16i..) packed as group 2i, up group i (columns n/2 + 16i..) as 2i + 1
    const int64_t col0 = (swiglu ? (g % 2) * (n / 2) + (g / 2) * kCols : g * kCols);
    for (int64_t blk = 0; blk < p.blocks; ++blk) {
      uint8_t* tile = p.data.get() + (g * p.blocks + blk) * kTileBytes;
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t c = 0; c < kCols; ++c)
          for (int64_t j = 0; j < 4; ++j)
            tile[i * 64 + c * 4 + j] = static_cast<uint8_t>(nibble(col0 + c, blk, 8 * i + j) |
                                                            nibble(col0 + c, blk, 8 * i + 4 + j) << 4);
      float* s = reinterpret_cast<float*>(tile + 256);
      for (int64_t c = 0; c < kCols; ++c) s[c] = scales[(col0 + c) * p.blocks + blk];
    }
  }
}

// The optional attribute swiglu = 1: the node computes silu(Y[:, :N/2]) * Y[:, N/2:] ([M, N/2]), a SwiGLU MLP's
// gate and up projections with the activation (custom_ops/__init__.py fuse_swiglu).
bool swiglu_attribute(const Ort::ConstKernelInfo& k) {
  try {
    return k.GetAttribute<int64_t>("swiglu") != 0;
  } catch (const Ort::Exception&) {
    return false;
  }
}

// The optional attribute norm_epsilon: the node's A is the input of an RMS norm folded in, inputs 3 its gamma [K] and 4
// (optional) a skip added first, output 1 (optional) that sum (custom_ops/__init__.py fuse_norms).
bool norm_attribute(const Ort::ConstKernelInfo& k, float& epsilon) {
  try {
    epsilon = k.GetAttribute<float>("norm_epsilon");
    return true;
  } catch (const Ort::Exception&) {
    return false;
  }
}

struct MatMulKernel {
  Packed packed;
  const Variant* variant = nullptr;
  bool swiglu = false, norm = false, amx = false;
  float epsilon = 0.0f;

  MatMulKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo k(info);
    variant = chosen_variant();
    if (!variant)
      ORT_CXX_API_THROW("specrt MatMulNBits: SPECRT_ISA must be one of auto, ref, avx2, avx512", ORT_INVALID_ARGUMENT);
    const int64_t n = k.GetAttribute<int64_t>("N"), kk = k.GetAttribute<int64_t>("K");
    if (k.GetAttribute<int64_t>("bits") != 4 || k.GetAttribute<int64_t>("block_size") != kBlock || n % kCols ||
        kk % kBlock)
      ORT_CXX_API_THROW("specrt MatMulNBits: needs bits 4, block_size 32, N % 16 == 0, K % 32 == 0",
                        ORT_INVALID_ARGUMENT);
    norm = norm_attribute(k, epsilon);
    if (k.GetInputCount() != (norm ? 4u : 3u) && !(norm && k.GetInputCount() == 5))
      ORT_CXX_API_THROW("specrt MatMulNBits: needs A, B and scales (no zero points or bias), then with norm_epsilon the "
                        "norm's gamma and optionally its skip", ORT_INVALID_ARGUMENT);
    int constant_b = 0, constant_s = 0;
    auto b = k.GetTensorConstantInput(1, &constant_b), s = k.GetTensorConstantInput(2, &constant_s);
    if (!constant_b || !constant_s)
      ORT_CXX_API_THROW("specrt MatMulNBits: the weights and scales must be initializers", ORT_INVALID_ARGUMENT);
    if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n * kk / 2) ||
        s.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n * kk / kBlock))
      ORT_CXX_API_THROW("specrt MatMulNBits: weights or scales do not match N and K", ORT_INVALID_ARGUMENT);
    swiglu = swiglu_attribute(k);
    if (swiglu && n % (2 * kCols))
      ORT_CXX_API_THROW("specrt MatMulNBits: swiglu needs N % 32 == 0", ORT_INVALID_ARGUMENT);
    pack(b.GetTensorData<uint8_t>(), s.GetTensorData<float>(), n, kk, swiglu, packed);
    amx = variant == specrt_nbits::avx512_variant() && specrt_amx_enabled();
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto a = ctx.GetInput(0);
    std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != packed.k)
      ORT_CXX_API_THROW("specrt MatMulNBits: A's last dimension is not K", ORT_INVALID_ARGUMENT);
    int64_t m = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) m *= shape[d];
    shape.back() = swiglu ? packed.n / 2 : packed.n;
    auto y = ctx.GetOutput(0, shape);
    if (m == 0) return;
    thread_local specrt_nbits::Rows rows;
    thread_local std::vector<float> scratch;  // SwiGLU: gate and up, before the activation
    const float* x = a.GetTensorData<float>();
    thread_local std::vector<float> normed;  // the norm's output: the matmul's activations
    if (norm) {
      const size_t count = static_cast<size_t>(m * packed.k);
      auto gamma = ctx.GetInput(3);
      if (gamma.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(packed.k))
        ORT_CXX_API_THROW("specrt MatMulNBits: the norm's gamma must have K values", ORT_INVALID_ARGUMENT);
      const float* skip = nullptr;
      if (ctx.GetInputCount() > 4) {
        auto s = ctx.GetInput(4);
        if (s.GetTensorTypeAndShapeInfo().GetElementCount() != count)
          ORT_CXX_API_THROW("specrt MatMulNBits: the norm's skip must have A's shape", ORT_INVALID_ARGUMENT);
        skip = s.GetTensorData<float>();
      }
      float* sum = nullptr;
      if (ctx.GetOutputCount() > 1) {
        std::vector<int64_t> a_shape = a.GetTensorTypeAndShapeInfo().GetShape();
        sum = ctx.GetOutput(1, a_shape).GetTensorMutableData<float>();
      }
      normed.resize(count);
      variant->rms_norm(x, skip, gamma.GetTensorData<float>(), epsilon, m, packed.k, sum, normed.data());
      x = normed.data();
    }
    variant->quantize(x, m, packed.k, rows);
    if (swiglu) scratch.resize(m * packed.n);
    float* out = y.GetTensorMutableData<float>();
    // tasks of 4 groups (64 columns): enough of them to share among threads, each a whole wide tile
    specrt_nbits::Job job{&packed, &rows, m, 4, swiglu ? scratch.data() : out, swiglu ? out : nullptr, amx};
    ctx.ParallelFor(variant->run_task, static_cast<size_t>((packed.groups + job.span - 1) / job.span), 0, &job);
  }
};

struct MatMulOp : Ort::CustomOpBase<MatMulOp, MatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MatMulKernel(api, info); }
  const char* GetName() const { return "MatMulNBits"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 5; }  // A, B, scales; a folded norm's gamma and skip
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 3 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 2; }  // Y; a folded norm's input + skip
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }

  // Y: A's shape with its last dimension N
  static OrtStatusPtr InferOutputShape(Ort::ShapeInferContext& ctx) {
    try {
      Ort::ShapeInferContext::Shape out = ctx.GetInputShape(0);
      if (out.empty()) ORT_CXX_API_THROW("specrt MatMulNBits: A must have a dimension", ORT_INVALID_ARGUMENT);
      int64_t n = ctx.GetAttrInt("N");
      try {
        if (ctx.GetAttrInt("swiglu")) n /= 2;
      } catch (const Ort::Exception&) {
      }
      out.back() = Ort::ShapeInferContext::SymbolicInteger(n);
      Ort::Status status = ctx.SetOutputShape(0, out);
      if (!status.IsOK()) return status.release();
    } catch (const Ort::Exception& e) {
      return Ort::Status(e).release();
    }
    return nullptr;
  }
};

MatMulOp matmul_op;

}  // namespace

const OrtCustomOp* specrt_matmul_nbits_op() { return &matmul_op; }

bool specrt_avx512_vnni() { return cpu_supports("avx512"); }

#ifndef SPECRT_KERNEL_EXPORT  // libspecrt compiles this file in and keeps the symbol to itself (runtime/cpp)
#define SPECRT_KERNEL_EXPORT __attribute__((visibility("default")))
#endif
extern "C" SPECRT_KERNEL_EXPORT const char* specrt_matmul_nbits_isa() {
  const Variant* v = chosen_variant();
  if (!v) return "";
  const char* env = std::getenv("SPECRT_ISA");
  // the reference is slower than ONNX Runtime's kernel: it takes the nodes only when asked for by name
  if (v == specrt_nbits::ref_variant() && !(env && !std::strcmp(env, "ref"))) return "ort";
  return v->isa;
}

bool specrt_matmul_nbits_runs() {
  const char* isa = specrt_matmul_nbits_isa();
  return *isa && std::strcmp(isa, "ort") != 0;
}
