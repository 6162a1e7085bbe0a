// The int4 matmul's AVX2 variant (matmul_nbits.h), compiled with -march=x86-64-v3 (AVX2, FMA; custom_ops/__init__.py
// KERNEL_VARIANTS): Intel Haswell and AMD Zen 1 on, most laptops and cloud VMs without AVX-512.
//
// A 256-bit register holds half a packed chunk: 8 columns x 4 K-values. AVX2 has no VNNI dot product: vpmaddubsw
// multiplies the unsigned weight nibbles by the signed int8 activations and adds pairs into int16 (at most
// 2 x 15 x 128 = 3840), the 8 products of a block's 4 chunks and both nibbles add up in int16 (at most 30720, no
// overflow), and one vpmaddwd by 1 widens the block's sums to int32: the exact integer sums VNNI computes. Then the
// same float steps (int32 to float, scale, FMA into the row's sum), so the same bits as every variant. A register tile
// holds up to 4 rows of one half group (16 registers: each row's int16 and float sums, the weights and broadcasts);
// 1-2 rows take both halves at once, for more independent sums in flight. Each weight block is unpacked once per tile.
#include "matmul_nbits.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace specrt_nbits {
namespace {

#include "exp16.h"

constexpr int kMaxRows = 4;                     // rows a register tile holds
constexpr int64_t kPrefetch = 32 * kTileBytes;  // how far ahead a tile asks for its group's next weights

inline __m256 abs8(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

void quantize(const float* a, int64_t m, int64_t k, Rows& rows) {
  const int64_t blocks = k / kBlock;
  rows.resize(m, k);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* x = a + r * k + blk * kBlock;
      __m256 v[4], most = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i), most = _mm256_max_ps(most, abs8(v[i]));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, most);
      const float amax = *std::max_element(lanes, lanes + 8);
      const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
      alignas(32) int32_t q[kBlock];
      for (int i = 0; i < 4; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i),
                           _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse))));
      int8_t* out = rows.q.data() + (blk * m + r) * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) out[j] = static_cast<int8_t>(std::clamp(q[j], -128, 127)), sum += out[j];
      rows.scale[blk * m + r] = scale;
      rows.bias[blk * m + r] = -8 * sum;
    }
}

void rms_norm(const float* x, const float* skip, const float* gamma, float epsilon, int64_t m, int64_t k, float* sum,
              float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float* o = out + r * k;
    __m256 squares[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0-7 and 8-15 of AVX-512's 16
    for (int64_t t = 0; t < k; t += 8) {
      __m256 v = _mm256_loadu_ps(xr + t);
      if (skip) v = _mm256_add_ps(v, _mm256_loadu_ps(skip + r * k + t));
      if (sum) _mm256_storeu_ps(sum + r * k + t, v);
      _mm256_storeu_ps(o + t, v);
      squares[t / 8 % 2] = _mm256_fmadd_ps(v, v, squares[t / 8 % 2]);
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, squares[0]), _mm256_store_ps(lanes + 8, squares[1]);
    const __m256 inverse = _mm256_set1_ps(1.0f / std::sqrt(sum16(lanes) / static_cast<float>(k) + epsilon));
    for (int64_t t = 0; t < k; t += 8)
      _mm256_storeu_ps(o + t, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(o + t), inverse), _mm256_loadu_ps(gamma + t)));
  }
}

// Y rows row0..row0+R-1, the columns of H halves of group g from half h0 (8 columns a half)
template <int R, int H>
void tile(const Packed& p, const Rows& a, int64_t row0, int64_t g, int h0, float* y) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  const uint8_t* last = p.data.get() + (p.groups * p.blocks - 1) * kTileBytes;  // the packed weights' last tile
  const uint8_t* t = p.data.get() + g * p.blocks * kTileBytes;
  const int8_t* q = a.q.data() + row0 * kBlock;  // the block's words: row row0 + r's at q + 32 r
  const float* sa = a.scale.data() + row0;
  const int32_t* bias = a.bias.data() + row0;
  for (int64_t blk = 0; blk < p.blocks; ++blk, t += kTileBytes, q += a.m * kBlock, sa += a.m, bias += a.m) {
    const uint8_t* ahead = std::min(t + kPrefetch, last);
    for (int64_t line = 0; line < kTileBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    __m256i sums[R][H];  // int16 sums of pairs of products
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) sums[r][h] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      __m256i lo[H], hi[H];
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(t + 64 * i + 32 * (h0 + h)));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t q_lo, q_hi;
        std::memcpy(&q_lo, q + kBlock * r + 8 * i, 4), std::memcpy(&q_hi, q + kBlock * r + 8 * i + 4, 4);
        const __m256i x_lo = _mm256_set1_epi32(q_lo), x_hi = _mm256_set1_epi32(q_hi);
        for (int h = 0; h < H; ++h)
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x_lo),
                                                                     _mm256_maddubs_epi16(hi[h], x_hi)));
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 s_col = _mm256_load_ps(reinterpret_cast<const float*>(t + 256 + 32 * (h0 + h)));
      for (int r = 0; r < R; ++r) {
        const __m256i dot = _mm256_add_epi32(_mm256_set1_epi32(bias[r]), _mm256_madd_epi16(sums[r][h], ones));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s_col, _mm256_set1_ps(sa[r])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(y + (row0 + r) * p.n + g * kCols + 8 * (h0 + h), acc[r][h]);
}

using TileFn = void (*)(const Packed&, const Rows&, int64_t, int64_t, int, float*);
constexpr TileFn kWhole[3] = {nullptr, &tile<1, 2>, &tile<2, 2>};                        // 1-2 rows: both halves
constexpr TileFn kHalf[kMaxRows + 1] = {nullptr, nullptr, nullptr, &tile<3, 1>, &tile<4, 1>};  // 3-4 rows: a half

// silu(gate) * up, the sigmoid from e = e^-|gate|: 1 / (1 + e) where gate >= 0, else e / (1 + e)
inline __m256 swiglu8(__m256 gate, __m256 up) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), abs8(gate)));
  const __m256 negative = _mm256_cmp_ps(gate, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 top = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, negative);
  const __m256 sigmoid = _mm256_div_ps(top, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(_mm256_mul_ps(gate, sigmoid), up);
}

// task i: groups [i * span, (i + 1) * span) for every row, in register tiles of up to 4 rows; then SwiGLU's activation
void run_task(void* data, size_t i) {
  const auto* job = static_cast<const Job*>(data);
  const Packed& p = *job->p;
  const int64_t g0 = static_cast<int64_t>(i) * job->span, g_end = std::min<int64_t>(p.groups, g0 + job->span);
  for (int64_t row0 = 0; row0 < job->m; row0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, job->m - row0));
    for (int64_t g = g0; g < g_end; ++g)
      if (rows <= 2)
        kWhole[rows](p, *job->a, row0, g, 0, job->y);
      else
        for (int h = 0; h < 2; ++h) kHalf[rows](p, *job->a, row0, g, h, job->y);
  }
  if (!job->act) return;
  for (int64_t r = 0; r < job->m; ++r)  // packed pairs 2g, 2g + 1: output columns 16g..16g+15
    for (int64_t g = g0; g < g_end; g += 2)
      for (int h = 0; h < 2; ++h) {
        const float* y = job->y + r * p.n + g * kCols + 8 * h;
        _mm256_storeu_ps(job->act + r * (p.n / 2) + g / 2 * kCols + 8 * h,
                         swiglu8(_mm256_loadu_ps(y), _mm256_loadu_ps(y + kCols)));
      }
}

const Variant kAvx2{"avx2", quantize, rms_norm, run_task};

}  // namespace

const Variant* avx2_variant() { return &kAvx2; }

}  // namespace specrt_nbits
#else
const specrt_nbits::Variant* specrt_nbits::avx2_variant() { return nullptr; }
#endif
