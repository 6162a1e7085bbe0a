// specrt's int4 matmul: an ONNX Runtime custom op, ai.specrt::MatMulNBits, that computes what
// com.microsoft::MatMulNBits computes at accuracy level 4 (int8 activations) for the graphs specrt
// exports: 4-bit symmetric weights in blocks of 32 along K (zero point 8, one fp32 scale a block), no
// bias, K a multiple of 32 and N of 16. Y[m, n] = sum over blocks b of sa[m, b] * sw[n, b] * dot(qa, qw),
// where each row's activations are quantized to int8 per block of 32 (sa = max|a| / 127, round to nearest).
//
// Why: ONNX Runtime's kernel at level 4 costs ~0.2 decode steps per extra row (T(5)/T(1) ~1.8 on SmolLM2),
// so a verify pass is expensive. This one unpacks each weight block ONCE per call for all the call's rows
// (up to 8 rows in registers, the weights repacked at load so one 512-bit register holds 16 columns x 4
// K-values), and each row costs one VNNI dot product per 64 weights plus 3 instructions per block: an
// extra row costs a fraction of the unpacking the first one pays.
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
// of a verify pass bit for bit.
//
// With AMX (Sapphire Rapids on; matmul_int8.cpp's amx_enabled, SPECRT_NO_AMX=1 turns it off), a call's rows in tiles of
// 16 (a last one of at least 9) take AMX's int8 tiles instead: a group's weights unpacked once to signed bytes for all
// the tiles, one tile multiply for a tile's int32 sums of a block, then the same float operations (amx_groups).
// Measured on SmolLM2 int4 (2 threads, one process, paths alternating): a plain step of 16 rows 11.0 vs 12.9 ms at 32
// cached tokens, 30.4 vs 31.6 at 512; a decode step (< 9 rows) as before. Unpacking a whole group ahead and reading a
// block's sums back two blocks late (no store-to-load stall): 16 rows x 3 and x 5 positions 5% and 11% faster again.
//
// AVX-512 VNNI only (custom_ops/__init__.py renames MatMulNBits nodes where the CPU has it; elsewhere ONNX
// Runtime's kernel stays). Built into libspecrt_kernels.so with the attention kernel (attention.cpp's
// RegisterCustomOps adds both, kernels.h); libspecrt compiles it in (runtime/cpp/CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace {

// The vector code is compiled for AVX-512 VNNI whatever -march says (the library also serves CPUs without it,
// where Python never renames a node to this op and the kernel's constructor refuses): only the functions between
// push_options and pop_options, never ONNX Runtime's inline API code.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#include "exp16.h"

constexpr int64_t kCols = 16;                 // columns per group: one 512-bit register of int32 / fp32
constexpr int64_t kBlock = 32;                // K-values per quantization block
constexpr int64_t kTileBytes = 256 + 64;      // one (group, block): 16 x 32 nibbles, then 16 fp32 scales
constexpr int kMaxRows = 8;                   // rows a register tile holds
constexpr int kTileRows = 16;                 // rows an AMX tile holds
constexpr int64_t kAmxRows = 9;               // AMX from this many rows (SmolLM2 int4 passes of 9-16 rows: 2-15% faster)
constexpr int64_t kPrefetch = 32 * kTileBytes;  // how far ahead a tile asks for its group's next weights (10 KB)

// The weights of one node, repacked: tile (g, b) at data + (g * blocks + b) * kTileBytes. Byte c * 4 + j of
// its 64-byte chunk i holds, for column g * 16 + c, K-value b * 32 + 8 * i + j in the low nibble and
// b * 32 + 8 * i + 4 + j in the high nibble (stored unsigned: q + 8).
struct Packed {
  int64_t n = 0, k = 0, groups = 0, blocks = 0;
  std::unique_ptr<uint8_t, decltype(&std::free)> data{nullptr, &std::free};
};

// b: [N, blocks, 16] bytes, element 2t of a block in byte t's low nibble, 2t + 1 in its high nibble
// (MatMulNBits' layout); scales: [N * blocks]
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

// A thread's scratch of at least n bytes, 64-byte aligned (grown as needed, kept for its next call)
int8_t* scratch_bytes(int64_t n) {
  thread_local std::unique_ptr<int8_t, decltype(&std::free)> data{nullptr, &std::free};
  thread_local int64_t size = 0;
  if (n > size) {
    size = (n + 63) / 64 * 64;
    data.reset(static_cast<int8_t*>(std::aligned_alloc(64, static_cast<size_t>(size))));
    if (!data) throw std::bad_alloc();
  }
  return data.get();
}

// A call's activations quantized per row and block, block-major so that a tile reads all its rows' words at
// constant offsets from one pointer: q [blocks, M, 32] int8, scale [blocks, M], bias [blocks, M] = -8 * sum of
// the block's q (the weights' zero point, folded into the accumulator's start).
struct Rows {
  int64_t m = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> bias;
};

void quantize(const float* a, int64_t m, int64_t k, Rows& rows) {
  const int64_t blocks = k / kBlock;
  rows.m = m, rows.q.resize(m * k), rows.scale.resize(m * blocks), rows.bias.resize(m * blocks);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* x = a + r * k + blk * kBlock;
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
      const __m512 inv = _mm512_set1_ps(inverse);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      int8_t* out = rows.q.data() + (blk * m + r) * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(q1));
      rows.scale[blk * m + r] = scale;
      rows.bias[blk * m + r] = -8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

// The RMS norm before the matmul, folded in (custom_ops/__init__.py fuse_norms): row r of x [m, k] (+ skip), written
// to sum where given, then out = v / sqrt(mean(v^2) + epsilon) * gamma, as ONNX Runtime's (Skip)SimplifiedLayerNormalization.
void rms_norm(const float* x, const float* skip, const float* gamma, float epsilon, int64_t m, int64_t k, float* sum,
              float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float* o = out + r * k;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t t = 0; t < k; t += 16) {
      __m512 v = _mm512_loadu_ps(xr + t);
      if (skip) v = _mm512_add_ps(v, _mm512_loadu_ps(skip + r * k + t));
      if (sum) _mm512_storeu_ps(sum + r * k + t, v);
      _mm512_storeu_ps(o + t, v);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / k + epsilon));
    for (int64_t t = 0; t < k; t += 16)
      _mm512_storeu_ps(o + t, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(o + t), inverse), _mm512_loadu_ps(gamma + t)));
  }
}

// Y rows row0..row0+R-1, columns of groups g0..g0+G-1: every weight block unpacked once for the R rows.
template <int R, int G>
void tile(const Packed& p, const Rows& a, int64_t row0, int64_t g0, float* y) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const uint8_t* last = p.data.get() + (p.groups * p.blocks - 1) * kTileBytes;  // the packed weights' last tile
  const uint8_t* t = p.data.get() + g0 * p.blocks * kTileBytes;  // group g0's tile of the block; group g0 + g's at + g * stride
  const int64_t stride = p.blocks * kTileBytes;
  const int8_t* q = a.q.data() + row0 * kBlock;  // the block's words: row row0 + r's at q + 32 r
  const float* sa = a.scale.data() + row0;
  const int32_t* bias = a.bias.data() + row0;
  for (int64_t blk = 0; blk < p.blocks; ++blk, t += kTileBytes, q += a.m * kBlock, sa += a.m, bias += a.m) {
    for (int g = 0; g < G; ++g) {
      // the weights 32 tiles on, so that the memory keeps streaming while the rows' dot products run (SmolLM2
      // int4, 2 threads: T(1) -8%, T(5) -12%, 16 rows' matmuls -10%)
      const uint8_t* ahead = std::min(t + g * stride + kPrefetch, last);
      for (int64_t line = 0; line < kTileBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    }
    __m512i dot[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) dot[r][g] = _mm512_set1_epi32(bias[r]);
    for (int i = 0; i < 4; ++i) {
      __m512i lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_load_si512(t + g * stride + 64 * i);
        lo[g] = _mm512_and_si512(v, low);
        hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t q_lo, q_hi;
        std::memcpy(&q_lo, q + kBlock * r + 8 * i, 4), std::memcpy(&q_hi, q + kBlock * r + 8 * i + 4, 4);
        const __m512i x_lo = _mm512_set1_epi32(q_lo), x_hi = _mm512_set1_epi32(q_hi);
        for (int g = 0; g < G; ++g) {
          dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], lo[g], x_lo);
          dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], hi[g], x_hi);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s_row = _mm512_set1_ps(sa[r]);
      for (int g = 0; g < G; ++g) {
        const __m512 s = _mm512_mul_ps(_mm512_load_ps(reinterpret_cast<const float*>(t + g * stride + 256)), s_row);
        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][g]), s, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(y + (row0 + r) * p.n + (g0 + g) * kCols, acc[r][g]);
}

using TileFn = void (*)(const Packed&, const Rows&, int64_t, int64_t, float*);
// groups a tile spans for R rows: enough independent accumulators to hide the dot products' latency, and each
// broadcast activation word shared by two groups' dot products up to 6 rows (2 x 2 x 6 registers of sums; at
// 7-8 rows they would spill). One group at 5-6 rows cost 12% more per call (SmolLM2's shapes, one thread).
constexpr int groups_for(int r) { return r <= 2 ? 4 : r <= 6 ? 2 : 1; }
template <int R>
constexpr TileFn wide() { return &tile<R, groups_for(R)>; }
constexpr TileFn kWide[kMaxRows + 1] = {nullptr, wide<1>(), wide<2>(), wide<3>(), wide<4>(),
                                        wide<5>(), wide<6>(), wide<7>(), wide<8>()};
constexpr TileFn kNarrow[kMaxRows + 1] = {nullptr, &tile<1, 1>, &tile<2, 1>, &tile<3, 1>, &tile<4, 1>,
                                          &tile<5, 1>, &tile<6, 1>, &tile<7, 1>, &tile<8, 1>};

struct Job {
  const Packed* p;
  const Rows* a;
  int64_t m;
  int64_t span;  // groups per task
  float* y;      // [m, n]: the matmul's output (SwiGLU: its packed column order, a scratch)
  float* act;    // SwiGLU: [m, n / 2] silu(gate) * up; nullptr: none
  bool amx;      // tiles of 16 rows (the last one: at least kAmxRows) go through amx_groups
};


// silu(gate) * up = gate * sigmoid(gate) * up, sigmoid from e = e^-|gate|: 1 / (1 + e) where gate >= 0, else e / (1 + e)
inline __m512 swiglu16(__m512 gate, __m512 up) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));
  const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 top = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.0f), e);
  const __m512 sigmoid = _mm512_div_ps(top, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid), up);
}

// rows [row0, job->m) x groups [g0, g_end) in register tiles of up to 8 rows
void register_tiles(const Job* job, int64_t row0, int64_t g0, int64_t g_end) {
  for (; row0 < job->m; row0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, job->m - row0));
    const int64_t wide_groups = groups_for(rows);
    int64_t g = g0;
    for (; g + wide_groups <= g_end; g += wide_groups) kWide[rows](*job->p, *job->a, row0, g, job->y);
    for (; g < g_end; ++g) kNarrow[rows](*job->p, *job->a, row0, g, job->y);
  }
}

// SwiGLU: silu(gate) * up of groups [g0, g_end) (packed pairs 2i, 2i + 1: output columns 16i..16i+15) for every row
void swiglu_groups(const Job* job, int64_t g0, int64_t g_end) {
  const int64_t n = job->p->n;
  for (int64_t r = 0; r < job->m; ++r)
    for (int64_t g = g0; g < g_end; g += 2) {
      const float* y = job->y + r * n + g * kCols;
      _mm512_storeu_ps(job->act + r * (n / 2) + g / 2 * kCols, swiglu16(_mm512_loadu_ps(y), _mm512_loadu_ps(y + kCols)));
    }
}

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-int8")

// AMX: rows [0, rows) (at least kAmxRows) x groups [g, g_end), in tiles of 16 rows (the last one: at least kAmxRows).
// Per group, its 16 x 32 nibbles of every block are unpacked once, for all the tiles, to signed bytes (q - 8) in AMX's
// B layout (64-byte row 2i: K-values 8i..8i+3 of the 16 columns, row 2i + 1: 8i+4..8i+7; chunk i's low and high
// nibbles); then per tile and block one tile multiply gives every row's exact int32 sum of the block, sum of (q - 8) *
// x: the VNNI path's dot (its bias is the -8 * sum of x). Then the same float operations as tile<R, G>, so a row's bits
// do not depend on the path. Tiles: 1 = B (the group's weights of the block); a tile of 16 rows: 0 = A (the rows' 32
// int8 activations of the block), 2 and 3 = C (rows x 16 int32 sums, blocks taking turns); the last tile, when
// shorter: 4 = A, 5 and 6 = C.
//
// Memory written by vector stores and read at once by a tile load, or by a tile store and read at once by vector
// loads, stalls (here: 18 vs 5 ns a tile multiply, 17 vs 9 with its sums read back): hence the weights unpacked a whole
// group ahead, and a block's sums read back kLag blocks after the tile store.
constexpr int64_t kLag = 2;   // blocks between a block's tile store and its sums' float steps
constexpr int64_t kRing = 4;  // blocks of sums in memory: more than kLag

// next: the next group's packed weights, asked for from memory while this tile runs (nullptr: none)
template <bool kFull>  // a tile of 16 rows (tiles 0, 2, 3), or the shorter last one (4, 5, 6)
void amx_tile(const Packed& p, const Rows& a, int64_t row0, int rows, int64_t g, const int8_t* w, const uint8_t* next,
              float* y) {
  alignas(64) int32_t c[kRing][kTileRows * kCols];
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* t = p.data.get() + g * p.blocks * kTileBytes;  // block b's column scales at t + b * kTileBytes + 256
  for (int64_t blk = 0; blk < p.blocks + 1 + kLag; ++blk) {
    if (blk < p.blocks) {  // block blk's sums into C tile blk % 2 (tile numbers: literals in the intrinsics)
      const int8_t* q = a.q.data() + (blk * a.m + row0) * kBlock;
      if (next)
        for (int64_t line = 0; line < kTileBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + blk * kTileBytes + line), _MM_HINT_T0);
      _tile_loadd(1, w + blk * kBlock * kCols, 64);
      if constexpr (kFull) {
        _tile_loadd(0, q, kBlock);
        if (blk % 2 == 0) {
          _tile_zero(2);
          _tile_dpbssd(2, 0, 1);
        } else {
          _tile_zero(3);
          _tile_dpbssd(3, 0, 1);
        }
      } else {
        _tile_loadd(4, q, kBlock);
        if (blk % 2 == 0) {
          _tile_zero(5);
          _tile_dpbssd(5, 4, 1);
        } else {
          _tile_zero(6);
          _tile_dpbssd(6, 4, 1);
        }
      }
    }
    const int64_t stored = blk - 1;  // the block before: its sums to memory, while block blk's multiply runs
    if (stored >= 0 && stored < p.blocks) {
      int32_t* to = c[stored % kRing];
      if constexpr (kFull) {
        if (stored % 2 == 0) _tile_stored(2, to, 64); else _tile_stored(3, to, 64);
      } else {
        if (stored % 2 == 0) _tile_stored(5, to, 64); else _tile_stored(6, to, 64);
      }
    }
    const int64_t e = blk - 1 - kLag;  // kLag blocks before that: its sums into float, as tile<R, G> does
    if (e < 0) continue;
    const __m512 s_col = _mm512_load_ps(reinterpret_cast<const float*>(t + e * kTileBytes + 256));
    const float* sa = a.scale.data() + e * a.m + row0;
    const int32_t* sums = c[e % kRing];
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r)
      if (r < rows)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kCols)),
                                 _mm512_mul_ps(s_col, _mm512_set1_ps(sa[r])), acc[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r)
    if (r < rows) _mm512_storeu_ps(y + (row0 + r) * p.n + g * kCols, acc[r]);
}

void amx_groups(const Packed& p, const Rows& a, int64_t rows, int64_t g, int64_t g_end, float* y) {
  const int64_t full = rows / kTileRows * kTileRows;
  const int last = static_cast<int>(rows - full);  // 0, or a shorter tile of at least kAmxRows rows
  TileConfig config;
  config.rows[0] = config.rows[2] = config.rows[3] = kTileRows;
  config.rows[4] = config.rows[5] = config.rows[6] = static_cast<uint8_t>(last ? last : kTileRows);
  config.colsb[0] = config.colsb[4] = kBlock;
  config.rows[1] = kBlock / 4;
  config.colsb[1] = config.colsb[2] = config.colsb[3] = config.colsb[5] = config.colsb[6] = 64;
  _tile_loadconfig(&config);
  const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  int8_t* w = scratch_bytes(p.blocks * kBlock * kCols);  // the group's unpacked weights, [blocks, 512]
  for (; g < g_end; ++g) {
    const uint8_t* t = p.data.get() + g * p.blocks * kTileBytes;
    for (int64_t blk = 0; blk < p.blocks; ++blk, t += kTileBytes)
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_load_si512(t + 64 * i);
        int8_t* out = w + blk * kBlock * kCols + 128 * i;
        _mm512_store_si512(out, _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
        _mm512_store_si512(out + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
      }
    const uint8_t* next = g + 1 < p.groups ? t : nullptr;  // the first tile asks for the next group's weights
    for (int64_t row0 = 0; row0 < full; row0 += kTileRows, next = nullptr)
      amx_tile<true>(p, a, row0, kTileRows, g, w, next, y);
    if (last) amx_tile<false>(p, a, full, last, g, w, next, y);
  }
  _tile_release();
}

#pragma GCC pop_options

// Rows a call of m rows takes through AMX: its whole tiles of 16 and a last one of at least kAmxRows (the rest, and every
// call of fewer rows: the register tiles)
constexpr int64_t amx_rows_of(int64_t m) { return m % kTileRows >= kAmxRows ? m : m / kTileRows * kTileRows; }

// task i: groups [i * span, (i + 1) * span) for every row: tiles of 16 rows through AMX where the job says (the last one
// of at least kAmxRows), the other rows in register tiles; then SwiGLU's activation. (Outside the target regions: it
// calls into both.)
void run_task(void* data, size_t i) {
  const auto* job = static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(i) * job->span, g_end = std::min<int64_t>(job->p->groups, g0 + job->span);
  const int64_t amx_rows = job->amx ? amx_rows_of(job->m) : 0;
  if (amx_rows) amx_groups(*job->p, *job->a, amx_rows, g0, g_end, job->y);
  register_tiles(job, amx_rows, g0, g_end);
  if (job->act) swiglu_groups(job, g0, g_end);
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
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
  bool swiglu = false, norm = false, amx = false;
  float epsilon = 0.0f;

  MatMulKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo k(info);
    if (!cpu_has_vnni())
      ORT_CXX_API_THROW("specrt MatMulNBits: this CPU has no AVX-512 VNNI", ORT_NOT_IMPLEMENTED);
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
    amx = specrt_amx_enabled();
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
    thread_local Rows rows;
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
      rms_norm(x, skip, gamma.GetTensorData<float>(), epsilon, m, packed.k, sum, normed.data());
      x = normed.data();
    }
    quantize(x, m, packed.k, rows);
    if (swiglu) scratch.resize(m * packed.n);
    float* out = y.GetTensorMutableData<float>();
    // tasks of 4 groups (64 columns): enough of them to share among threads, each a whole wide tile
    Job job{&packed, &rows, m, 4, swiglu ? scratch.data() : out, swiglu ? out : nullptr, amx};
    ctx.ParallelFor(run_task, static_cast<size_t>((packed.groups + job.span - 1) / job.span), 0, &job);
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
bool specrt_matmul_nbits_runs() { return cpu_has_vnni(); }
#else
const OrtCustomOp* specrt_matmul_nbits_op() { return nullptr; }
bool specrt_matmul_nbits_runs() { return false; }
#endif
