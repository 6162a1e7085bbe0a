// The int4 matmul's AVX-512 VNNI variant (matmul_nbits.h), compiled with -march=x86-64-v4 -mavx512vnni and AMX's
// flags (custom_ops/__init__.py KERNEL_VARIANTS): Ice Lake and AMD Zen 4 on.
//
// Each weight block is unpacked ONCE per call for all the call's rows (up to 8 rows in registers; one 512-bit
// register holds 16 columns x 4 K-values of the packed layout), and each row costs one VNNI dot product per 64
// weights plus 3 instructions per block: an extra row costs a fraction of the unpacking the first one pays.
//
// With AMX (Sapphire Rapids on; matmul_int8.cpp's amx_enabled, SPECRT_NO_AMX=1 turns it off), a call's rows in tiles of
// 16 (a last one of at least 9) take AMX's int8 tiles instead: a group's weights unpacked once to signed bytes for all
// the tiles, one tile multiply for a tile's int32 sums of a block, then the same float operations (amx_groups).
// Measured on SmolLM2 int4 (2 threads, one process, paths alternating): a plain step of 16 rows 11.0 vs 12.9 ms at 32
// cached tokens, 30.4 vs 31.6 at 512; a decode step (< 9 rows) as before. Unpacking a whole group ahead and reading a
// block's sums back two blocks late (no store-to-load stall): 16 rows x 3 and x 5 positions 5% and 11% faster again.
#include "matmul_nbits.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"

// GCC 12 flags the _mm512_undefined_ps() inside _mm512_cvtepi32_ps where amx_tile is inlined: a false positive
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace specrt_nbits {
namespace {

#include "exp16.h"

constexpr int kMaxRows = 8;                   // rows a register tile holds
constexpr int kTileRows = 16;                 // rows an AMX tile holds
constexpr int64_t kAmxRows = 9;               // AMX from this many rows (SmolLM2 int4 passes of 9-16 rows: 2-15% faster)
constexpr int64_t kPrefetch = 32 * kTileBytes;  // how far ahead a tile asks for its group's next weights (10 KB)

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

void quantize(const float* a, int64_t m, int64_t k, Rows& rows) {
  const int64_t blocks = k / kBlock;
  rows.resize(m, k);
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
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, squares);
    const __m512 inverse = _mm512_set1_ps(1.0f / std::sqrt(sum16(lanes) / static_cast<float>(k) + epsilon));
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

// Rows a call of m rows takes through AMX: its whole tiles of 16 and a last one of at least kAmxRows (the rest, and every
// call of fewer rows: the register tiles)
constexpr int64_t amx_rows_of(int64_t m) { return m % kTileRows >= kAmxRows ? m : m / kTileRows * kTileRows; }

// task i: groups [i * span, (i + 1) * span) for every row: tiles of 16 rows through AMX where the job says (the last one
// of at least kAmxRows), the other rows in register tiles; then SwiGLU's activation
void run_task(void* data, size_t i) {
  const auto* job = static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(i) * job->span, g_end = std::min<int64_t>(job->p->groups, g0 + job->span);
  const int64_t amx_rows = job->amx ? amx_rows_of(job->m) : 0;
  if (amx_rows) amx_groups(*job->p, *job->a, amx_rows, g0, g_end, job->y);
  register_tiles(job, amx_rows, g0, g_end);
  if (job->act) swiglu_groups(job, g0, g_end);
}

const Variant kAvx512{"avx512", quantize, rms_norm, run_task};

}  // namespace

const Variant* avx512_variant() { return &kAvx512; }

}  // namespace specrt_nbits
#else
const specrt_nbits::Variant* specrt_nbits::avx512_variant() { return nullptr; }
#endif
