// specrt's int8 matmul: an ONNX Runtime custom op, ai.specrt::MatMulInt8, for the int8 lm_head specrt exports:
// uint8 activations quantized per row (QuantizeLinear, zero point z), int8 weights with one fp32 scale a column,
// and the row's scale multiplied in after (the Mul that follows com.microsoft::MatMulIntegerToFloat in the graph,
// folded in by custom_ops/__init__.py fuse_int8_matmuls). Inputs: A uint8 [..., K], B int8 [K, N], a_scale (fp32
// scalar), b_scale (fp32 [N]), a_zero_point (uint8 scalar), row_scale (fp32, one value a row of A). Output, fp32
// [..., N]:
//
//   Y[m, n] = (float(sum over k of (A[m, k] - z) * B[k, n]) * (a_scale * b_scale[n])) * row_scale[m]
//
// the same float operations in the same order as MatMulIntegerToFloat followed by the Mul, so the same bits.
//
// Why: the lm_head reads 49152 x 576 int8 weights, about half a SmolLM2 int4 step's bytes, and ONNX Runtime's
// kernel plus the row-scale Mul cost ~0.35 ms more at 5 rows than at 1 (profiled). Here the weights stream once
// for all of a call's rows: with AMX (Sapphire Rapids on) one tile multiply covers 16 rows x 16 columns x 64
// K-values and the sum stays in the tile unit over all of K (one scale a column: nothing to do between
// blocks), so the extra rows cost next to nothing; elsewhere AVX-512 VNNI, one dot product a row per 64 weights.
// Both compute the exact int32 sums and then the same float operations, so a row's bits do not depend on the
// path or on the call's other rows (a decode step equals the same token's row of a verify pass).
//
// ai.specrt::DynamicMatMulInt8 is the same kernel taking A in fp32 and quantizing each row itself, as the ops before it
// in a prefill graph did (custom_ops/__init__.py fuse_row_quantize: Abs, ReduceMax, Max with tiny, Mul by 1/127,
// QuantizeLinear, five ONNX Runtime passes over A): inputs A fp32, B, a_scale, b_scale, a_zero_point, tiny, inv127.
// The same bytes and row scales (quantize_rows), so the same bits; SmolLM2 int4's prefill of 128 tokens 43-50 ms
// instead of 53-63.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <tuple>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"

#include "kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// GCC 12 flags the _mm512_undefined_ps() inside _mm512_cvtepi32_ps where finish() is inlined: a false positive
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace {

// The vector code is compiled for its ISA whatever -march says (the glue below runs on any x86-64 CPU): GCC's target
// pragmas, clang's attribute pragmas (clang ignores GCC's)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#endif

constexpr int64_t kCols = 16;        // columns per group: one 512-bit register of int32 / fp32
constexpr int64_t kChunk = 64;       // K-values per packed tile
constexpr int64_t kTileBytes = kChunk * kCols;  // one (group, chunk): 16 K-quads x 16 columns x 4 bytes
constexpr int kTileRows = 16;        // rows of A an AMX tile holds
constexpr int kVnniRows = 8;         // rows the VNNI path keeps in registers
constexpr int64_t kPrefetch = 8 * kTileBytes;  // how far ahead a group asks for its next weights

// B repacked: tile (g, c) at data + (g * chunks + c) * kTileBytes; byte (q * 16 + j) * 4 + i holds B[c * 64 + 4q + i,
// g * 16 + j] (AMX's B layout, and VNNI's: one 64-byte row is one K-quad of 16 columns). K is padded to a chunk
// with zeros. bias[n] = z * sum over k of B[k, n] (the activations' zero point), scale[n] = a_scale * b_scale[n].
struct Packed {
  int64_t n = 0, k = 0, groups = 0, chunks = 0;
  std::unique_ptr<int8_t, decltype(&std::free)> data{nullptr, &std::free};
  std::vector<int32_t> bias;
  std::vector<float> scale;
};

void pack(const int8_t* b, int64_t k, int64_t n, float a_scale, const float* b_scale, uint8_t zero, Packed& p) {
  p.n = n, p.k = k, p.groups = n / kCols, p.chunks = (k + kChunk - 1) / kChunk;
  const size_t bytes = static_cast<size_t>(p.groups * p.chunks * kTileBytes);
  p.data.reset(static_cast<int8_t*>(std::aligned_alloc(64, bytes)));
  if (!p.data) throw std::bad_alloc();
  std::memset(p.data.get(), 0, bytes);
  p.bias.assign(n, 0), p.scale.resize(n);
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t col = 0; col < n; ++col) {
      const int64_t g = col / kCols, j = col % kCols, c = kk / kChunk, q = (kk % kChunk) / 4, i = kk % 4;
      p.data.get()[(g * p.chunks + c) * kTileBytes + (q * kCols + j) * 4 + i] = b[kk * n + col];
      p.bias[col] += zero * b[kk * n + col];
    }
  for (int64_t col = 0; col < n; ++col) p.scale[col] = a_scale * b_scale[col];
}

// The sessions of a process often open the same graph (a runner's decode, verify and batched graphs): they share one
// packed copy of each weight matrix (SmolLM2's lm_head: 28 MB), keyed by its shape, scales and a hash of its bytes, and
// freed with the last session using it.
std::shared_ptr<const Packed> shared_pack(const int8_t* b, int64_t k, int64_t n, float a_scale, const float* b_scale,
                                          uint8_t zero) {
  using Key = std::tuple<int64_t, int64_t, size_t, size_t, float, uint8_t>;
  static std::mutex mutex;
  static std::map<Key, std::weak_ptr<const Packed>> packed;
  const Key key{k, n, std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(b), k * n)),
                std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(b_scale), n * sizeof(float))),
                a_scale, zero};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto p = packed[key].lock()) return p;
  auto p = std::make_shared<Packed>();
  pack(b, k, n, a_scale, b_scale, zero, *p);
  packed[key] = p;
  return p;
}

// Row m's 16 outputs of group g from its exact int32 sum (zero point not yet taken off)
inline void finish(const Packed& p, __m512i sum, int64_t g, float row_scale, float* y) {
  const __m512i dot = _mm512_sub_epi32(sum, _mm512_loadu_si512(p.bias.data() + g * kCols));
  const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(p.scale.data() + g * kCols));
  _mm512_storeu_ps(y + g * kCols, _mm512_mul_ps(v, _mm512_set1_ps(row_scale)));
}

// DynamicMatMulInt8's activations, rows [r0, r1) of x [m, k] quantized as the graph's ops did before they were folded in
// (custom_ops/__init__.py fuse_row_quantize: Abs, ReduceMax, Max, Mul, QuantizeLinear): s = max(max |x|, tiny) * inv127,
// q = saturate(round half to even(x / s) + zero) (QuantizeLinear's definition: a division, not a product by 1 / s), so
// the same bytes; q [m, lda] (K zero-padded beyond k), s [m]
void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t k, int64_t lda, float tiny, float inv127,
                   uint8_t zero, uint8_t* q, float* s) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * k;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t t = 0; t < k; t += kCols) {
      const __mmask16 in = k - t >= kCols ? 0xFFFF : static_cast<__mmask16>((1u << (k - t)) - 1);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(in, row + t)));
    }
    const float scale = std::max(_mm512_reduce_max_ps(amax), tiny) * inv127;
    s[r] = scale;
    const __m512 divisor = _mm512_set1_ps(scale);
    const __m512i z = _mm512_set1_epi32(zero), lo = _mm512_setzero_si512(), hi = _mm512_set1_epi32(255);
    uint8_t* out = q + r * lda;
    for (int64_t t = 0; t < k; t += kCols) {
      const __mmask16 in = k - t >= kCols ? 0xFFFF : static_cast<__mmask16>((1u << (k - t)) - 1);
      const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(in, row + t), divisor)), z);
      _mm_mask_storeu_epi8(out + t, in, _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi)));
    }
    std::memset(out + k, 0, static_cast<size_t>(lda - k));
  }
}

// VNNI: rows [row0, row0 + R) x group g; a: [M, chunks * 64] uint8 (K zero-padded), y: [M, N]
template <int R>
void vnni_group(const Packed& p, const uint8_t* a, int64_t row0, const float* row_scale, int64_t g, float* y) {
  __m512i sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
  const int64_t lda = p.chunks * kChunk;
  const int8_t* t = p.data.get() + g * p.chunks * kTileBytes;
  for (int64_t c = 0; c < p.chunks; ++c, t += kTileBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetch), _MM_HINT_T0);
    for (int64_t q = 0; q < kChunk / 4; ++q) {
      const __m512i w = _mm512_load_si512(t + q * 64);
      for (int r = 0; r < R; ++r) {
        int32_t x;
        std::memcpy(&x, a + (row0 + r) * lda + c * kChunk + 4 * q, 4);
        sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_set1_epi32(x), w);
      }
    }
  }
  for (int r = 0; r < R; ++r) finish(p, sum[r], g, row_scale[row0 + r], y + (row0 + r) * p.n);
}

#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-int8"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-int8")
#endif

// AMX: rows [row0, row0 + rows) x groups [g, g_end), two groups a pass sharing each A tile. Tiles: 0 = A (rows x 64
// K-values), 1 and 2 = B (the two groups' chunk), 3 and 4 = C (rows x 16 int32 sums).
void amx_groups(const Packed& p, const uint8_t* a, int64_t row0, int rows, const float* row_scale, int64_t g,
                int64_t g_end, float* y) {
  TileConfig config;
  config.rows[0] = config.rows[3] = config.rows[4] = static_cast<uint8_t>(rows);
  config.rows[1] = config.rows[2] = kChunk / 4;
  for (int i = 0; i < 5; ++i) config.colsb[i] = 64;
  _tile_loadconfig(&config);
  const int64_t lda = p.chunks * kChunk;
  alignas(64) int32_t c[2][kTileRows * kCols];
  for (; g < g_end; g += 2) {
    const bool pair = g + 1 < g_end;
    const int8_t* t0 = p.data.get() + g * p.chunks * kTileBytes;
    const int8_t* t1 = t0 + p.chunks * kTileBytes;
    _tile_zero(3);
    _tile_zero(4);
    for (int64_t ch = 0; ch < p.chunks; ++ch) {
      for (int64_t line = 0; line < kTileBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(t0 + ch * kTileBytes + kPrefetch + line), _MM_HINT_T0);
        if (pair) _mm_prefetch(reinterpret_cast<const char*>(t1 + ch * kTileBytes + kPrefetch + line), _MM_HINT_T0);
      }
      _tile_loadd(0, a + row0 * lda + ch * kChunk, lda);
      _tile_loadd(1, t0 + ch * kTileBytes, 64);
      _tile_dpbusd(3, 0, 1);
      if (pair) {
        _tile_loadd(2, t1 + ch * kTileBytes, 64);
        _tile_dpbusd(4, 0, 2);
      }
    }
    _tile_stored(3, c[0], 64);
    if (pair) _tile_stored(4, c[1], 64);
    for (int h = 0; h < 1 + pair; ++h)
      for (int r = 0; r < rows; ++r)
        finish(p, _mm512_load_si512(c[h] + r * kCols), g + h, row_scale[row0 + r], y + (row0 + r) * p.n);
  }
  _tile_release();
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

bool cpu_has_amx() {  // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 24 & 1) && (edx >> 25 & 1);
}

// Whether this CPU has AMX's int8 tiles and Linux lets this process use them (asked once: arch_prctl); SPECRT_NO_AMX=1
// takes the VNNI path (the tests compare the two)
bool amx_enabled() {
#if defined(__linux__)
  static const bool enabled =
      cpu_has_amx() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else  // macOS grants no AMX (no Mac has it), other systems are not asked
  static const bool enabled = false;
#endif
  const char* off = std::getenv("SPECRT_NO_AMX");
  return enabled && !(off && std::strcmp(off, "1") == 0);
}

using VnniFn = void (*)(const Packed&, const uint8_t*, int64_t, const float*, int64_t, float*);
constexpr VnniFn kVnni[kVnniRows + 1] = {nullptr, &vnni_group<1>, &vnni_group<2>, &vnni_group<3>, &vnni_group<4>,
                             &vnni_group<5>, &vnni_group<6>, &vnni_group<7>, &vnni_group<8>};

struct Job {
  const Packed* p;
  const uint8_t* a;        // [m, chunks * 64]
  const float* row_scale;  // [m]
  int64_t m, span;         // rows; groups per task
  bool amx;
  float* y;                // [m, n]
};

// task i: groups [i * span, (i + 1) * span) for every row, in row blocks of up to kTileRows (VNNI: kVnniRows)
void run_task(void* data, size_t i) {
  const auto* job = static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(i) * job->span;
  const int64_t g_end = std::min<int64_t>(job->p->groups, g0 + job->span);
  const int block = job->amx ? kTileRows : kVnniRows;
  for (int64_t row0 = 0; row0 < job->m; row0 += block) {
    const int rows = static_cast<int>(std::min<int64_t>(block, job->m - row0));
    if (job->amx) {
      amx_groups(*job->p, job->a, row0, rows, job->row_scale, g0, g_end, job->y);
    } else {
      for (int64_t g = g0; g < g_end; ++g) kVnni[rows](*job->p, job->a, row0, job->row_scale, g, job->y);
    }
  }
}

template <typename T>
T scalar_input(const Ort::ConstKernelInfo& k, size_t i, const char* what) {
  int constant = 0;
  auto v = k.GetTensorConstantInput(i, &constant);
  if (!constant || v.GetTensorTypeAndShapeInfo().GetElementCount() != 1)
    ORT_CXX_API_THROW(std::string("specrt MatMulInt8: ") + what + " must be a scalar initializer", ORT_INVALID_ARGUMENT);
  return v.GetTensorData<T>()[0];
}

// DynamicMatMulInt8's row quantization as a ParallelFor task: rows [8i, 8i + 8)
struct QuantizeJob {
  const float* x;
  int64_t m, k, lda;
  float tiny, inv127;
  uint8_t zero;
  uint8_t* q;
  float* s;
};
constexpr int64_t kQuantizeRows = 8;

void quantize_task(void* data, size_t i) {
  const auto* job = static_cast<const QuantizeJob*>(data);
  const int64_t r0 = static_cast<int64_t>(i) * kQuantizeRows;
  quantize_rows(job->x, r0, std::min(job->m, r0 + kQuantizeRows), job->k, job->lda, job->tiny, job->inv127, job->zero,
                job->q, job->s);
}

// MatMulInt8 (dynamic = false): A uint8, its row scales input 5. DynamicMatMulInt8 (dynamic = true): A float, quantized
// per row here (quantize_rows; inputs 5 and 6: the scalars tiny and 1 / 127 of the ops it replaces).
struct MatMulInt8Kernel {
  std::shared_ptr<const Packed> shared;
  bool amx = false, dynamic = false;
  float tiny = 0.0f, inv127 = 0.0f;
  uint8_t zero = 0;

  MatMulInt8Kernel(const OrtApi&, const OrtKernelInfo* info, bool dynamic_rows) : dynamic(dynamic_rows) {
    Ort::ConstKernelInfo k(info);
    if (!specrt_avx512_vnni()) ORT_CXX_API_THROW("specrt MatMulInt8: this CPU has no AVX-512 VNNI", ORT_NOT_IMPLEMENTED);
    int constant_b = 0, constant_s = 0;
    auto b = k.GetTensorConstantInput(1, &constant_b), s = k.GetTensorConstantInput(3, &constant_s);
    if (!constant_b || !constant_s)
      ORT_CXX_API_THROW("specrt MatMulInt8: the weights and their scales must be initializers", ORT_INVALID_ARGUMENT);
    const std::vector<int64_t> shape = b.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2 || shape[1] % kCols ||
        s.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(shape[1]))
      ORT_CXX_API_THROW("specrt MatMulInt8: needs B [K, N] with N % 16 == 0 and one scale a column",
                        ORT_INVALID_ARGUMENT);
    zero = scalar_input<uint8_t>(k, 4, "a_zero_point");
    shared = shared_pack(b.GetTensorData<int8_t>(), shape[0], shape[1], scalar_input<float>(k, 2, "a_scale"),
                         s.GetTensorData<float>(), zero);
    if (dynamic) tiny = scalar_input<float>(k, 5, "tiny"), inv127 = scalar_input<float>(k, 6, "inv127");
    amx = amx_enabled();
  }

  void Compute(OrtKernelContext* context) {
    const Packed& packed = *shared;
    Ort::KernelContext ctx(context);
    auto a = ctx.GetInput(0);
    std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != packed.k)
      ORT_CXX_API_THROW("specrt MatMulInt8: A's last dimension is not K", ORT_INVALID_ARGUMENT);
    int64_t m = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) m *= shape[d];
    if (!dynamic && ctx.GetInput(5).GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(m))
      ORT_CXX_API_THROW("specrt MatMulInt8: row_scale needs one value a row of A", ORT_INVALID_ARGUMENT);
    shape.back() = packed.n;
    auto y = ctx.GetOutput(0, shape);
    if (m == 0) return;
    thread_local std::vector<uint8_t> padded;  // A with K padded to whole chunks (zeros: add nothing to the sums)
    thread_local std::vector<float> row_scales;  // DynamicMatMulInt8's
    const int64_t lda = packed.chunks * kChunk;
    const uint8_t* x = nullptr;
    const float* row_scale = nullptr;
    if (dynamic) {
      padded.resize(static_cast<size_t>(m * lda)), row_scales.resize(static_cast<size_t>(m));
      QuantizeJob job{a.GetTensorData<float>(), m, packed.k, lda, tiny, inv127, zero, padded.data(), row_scales.data()};
      ctx.ParallelFor(quantize_task, static_cast<size_t>((m + kQuantizeRows - 1) / kQuantizeRows), 0, &job);
      x = padded.data(), row_scale = row_scales.data();
    } else {
      x = a.GetTensorData<uint8_t>(), row_scale = ctx.GetInput(5).GetTensorData<float>();
      if (lda != packed.k) {
        padded.assign(static_cast<size_t>(m * lda), 0);
        for (int64_t r = 0; r < m; ++r) std::memcpy(padded.data() + r * lda, x + r * packed.k, packed.k);
        x = padded.data();
      }
    }
    Job job{&packed, x, row_scale, m, 8, amx, y.GetTensorMutableData<float>()};
    ctx.ParallelFor(run_task, static_cast<size_t>((packed.groups + job.span - 1) / job.span), 0, &job);
  }
};

// ai.specrt::MatMulInt8 (kDynamic = false) and ai.specrt::DynamicMatMulInt8 (true): the same kernel
template <bool kDynamic>
struct MatMulInt8Op : Ort::CustomOpBase<MatMulInt8Op<kDynamic>, MatMulInt8Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MatMulInt8Kernel(api, info, kDynamic); }
  const char* GetName() const { return kDynamic ? "DynamicMatMulInt8" : "MatMulInt8"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // A, B, a_scale, b_scale, a_zero_point, then row_scale (MatMulInt8) or tiny and inv127 (DynamicMatMulInt8)
  size_t GetInputTypeCount() const { return kDynamic ? 7 : 6; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i == 0 && !kDynamic) || i == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : i == 1                        ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8
                                           : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

  // Y: A's shape with its last dimension N (B's second)
  static OrtStatusPtr InferOutputShape(Ort::ShapeInferContext& ctx) {
    try {
      Ort::ShapeInferContext::Shape out = ctx.GetInputShape(0), b = ctx.GetInputShape(1);
      if (out.empty() || b.size() != 2) ORT_CXX_API_THROW("specrt MatMulInt8: A needs a dimension, B two", ORT_INVALID_ARGUMENT);
      out.back() = b[1];
      Ort::Status status = ctx.SetOutputShape(0, out);
      if (!status.IsOK()) return status.release();
    } catch (const Ort::Exception& e) {
      return Ort::Status(e).release();
    }
    return nullptr;
  }
};

MatMulInt8Op<false> matmul_int8_op;
MatMulInt8Op<true> dynamic_matmul_int8_op;

}  // namespace

const OrtCustomOp* specrt_matmul_int8_op() { return &matmul_int8_op; }
const OrtCustomOp* specrt_dynamic_matmul_int8_op() { return &dynamic_matmul_int8_op; }
bool specrt_matmul_int8_runs() { return specrt_avx512_vnni() && cpu_has_amx(); }
bool specrt_amx_enabled() { return amx_enabled(); }
#else
const OrtCustomOp* specrt_matmul_int8_op() { return nullptr; }
const OrtCustomOp* specrt_dynamic_matmul_int8_op() { return nullptr; }
bool specrt_matmul_int8_runs() { return false; }
bool specrt_amx_enabled() { return false; }
#endif
