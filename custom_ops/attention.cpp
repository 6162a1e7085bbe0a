// specrt's CPU attention kernel: an ONNX Runtime custom op, ai.specrt::GroupQueryAttention, that
// computes what com.microsoft::GroupQueryAttention computes for the fused graphs specrt exports
// (packed QKV, rotary inside, K/V written in place into the shared past/present buffer, an additive
// attention bias, no window, no softcap), reading each KV head's cache ONCE per call.
//
// ONNX Runtime's CPU kernel runs one GEMM per query head: with 3 query heads per KV head it reads
// (and packs) every cached K and V entry 3 times per call, ~110 ns per cached token per layer on
// SmolLM2-135M; this kernel streams each KV head's entries once for all its query rows.
//
// Exactness: each query row is computed by the same loops whatever the call's other rows (its
// dot products, softmax and weighted sum depend only on its own causal length), so a one-token
// decode step and the same token's row in a verify pass give bit-identical outputs.
//
// Vector code for AVX-512, for AVX2 with FMA, and portable code for the rest (slower than ONNX Runtime's).
// Built by custom_ops/__init__.py (one g++ call, -O3 -march=native, cached) and registered in a session
// with SessionOptions.register_custom_ops_library; libspecrt compiles it in (runtime/cpp/CMakeLists.txt).
// Engine dirs keep the standard op: the same module (and libspecrt's src/kernel_attention.cpp) renames,
// in the session's copy of a graph, the domain of the nodes this kernel computes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"

#include "kernels.h"
#undef ORT_API_MANUAL_INIT

namespace {

constexpr int kLanes = 16;  // the head dimension must be a multiple of this

#if defined(__AVX512F__)
// 16 sums of 16 lanes each -> one vector of the 16 sums (lane i = the lanes of x[i] added up), by one
// fixed network of unpacks, shuffles and adds: every sum is added in the same order.
inline __m512 sum16(__m512 x[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: lanes (0+2, 1+3) of x[2i] and x[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per block: the 4-lane sums of x[4i..4i+3]
    const __m512d p = _mm512_castps_pd(a[2 * i]), q = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  for (int i = 0; i < 2; ++i)  // blocks 0+1 and 2+3... of two vectors
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// scores[t] = q . k(t) for the 16 entries k [16, d] (row-major): each one a 16-lane fused
// multiply-add chain over d, then sum16.
inline void dot16(const float* q, const float* k, int d, float* scores) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k + t * d));
  for (int i = kLanes; i < d; i += kLanes) {
    const __m512 qi = _mm512_loadu_ps(q + i);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(k + t * d + i), acc[t]);
  }
  _mm512_storeu_ps(scores, sum16(acc));
}

// acc_r = sum over t < len_r of w_r(t) v(t), t ascending, for n <= 16 / NC rows (NC = D / 16): the
// row sums stay in registers; each element is one fused multiply-add per t, whatever n is.
template <int NC>
inline void weighted_sum(float* const* out, const float* const* w, const int64_t* len, int n, const float* v) {
  constexpr int R = 16 / NC;
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) longest = std::max(longest, len[r]);
  for (int64_t t = 0; t < longest; ++t) {
    const float* vt = v + t * NC * kLanes;
    for (int r = 0; r < R; ++r) {
      if (r >= n) break;
      if (t >= len[r]) continue;  // past this row's causal prefix (a verify pass's earlier rows)
      const __m512 x = _mm512_set1_ps(w[r][t]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(x, _mm512_loadu_ps(vt + c * kLanes), acc[r][c]);
    }
  }
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out[r] + c * kLanes, acc[r][c]);
}
// The same sums for any NC in 1..16 (head dims other than 64, 128, 256): identical results, slower.
inline void weighted_sum_any(int nc, float* const* out, const float* const* w, const int64_t* len, int n,
                             const float* v) {
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < nc; ++c) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t t = 0; t < len[r]; ++t)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(w[r][t]), _mm512_loadu_ps(v + (t * nc + c) * kLanes), acc);
      _mm512_storeu_ps(out[r] + c * kLanes, acc);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
// 8 sums of 8 lanes each -> one vector of the 8 sums, by one fixed network of horizontal adds.
inline __m256 sum8(const __m256 x[8]) {
  const __m256 a0 = _mm256_hadd_ps(x[0], x[1]), a1 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 a2 = _mm256_hadd_ps(x[4], x[5]), a3 = _mm256_hadd_ps(x[6], x[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per 128-bit half: 4 sums each
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// scores[t] = q . k(t) for the 16 entries k [16, d], 8 at a time: each an 8-lane fused multiply-add chain over
// d, then sum8.
inline void dot16(const float* q, const float* k, int d, float* scores) {
  for (int half = 0; half < 2; ++half) {
    const float* kh = k + half * 8 * d;
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kh + t * d));
    for (int i = 8; i < d; i += 8) {
      const __m256 qi = _mm256_loadu_ps(q + i);
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(kh + t * d + i), acc[t]);
    }
    _mm256_storeu_ps(scores + half * 8, sum8(acc));
  }
}

// acc_r = sum over t < len_r of w_r(t) v(t), t ascending: per row, 64 lanes of D at a time in registers.
inline void weighted_sum_any(int nc, float* const* out, const float* const* w, const int64_t* len, int n,
                             const float* v) {
  const int d = nc * kLanes;
  for (int r = 0; r < n; ++r)
    for (int c0 = 0; c0 < d; c0 += 64) {
      const int chunks = std::min(8, (d - c0) / 8);
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t t = 0; t < len[r]; ++t) {
        const __m256 x = _mm256_set1_ps(w[r][t]);
        const float* vt = v + t * d + c0;
        for (int c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(x, _mm256_loadu_ps(vt + c * 8), acc[c]);
      }
      for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(out[r] + c0 + c * 8, acc[c]);
    }
}
#else
inline void dot16(const float* q, const float* k, int d, float* scores) {
  for (int t = 0; t < 16; ++t) {
    float acc[kLanes];
    for (int l = 0; l < kLanes; ++l) acc[l] = q[l] * k[t * d + l];
    for (int i = kLanes; i < d; i += kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(q[i + l], k[t * d + i + l], acc[l]);
    for (int w = kLanes / 2; w; w /= 2)
      for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    scores[t] = acc[0];
  }
}
inline void weighted_sum_any(int nc, float* const* out, const float* const* w, const int64_t* len, int n,
                             const float* v) {
  for (int r = 0; r < n; ++r) {
    float* o = out[r];
    std::fill(o, o + nc * kLanes, 0.0f);
    for (int64_t t = 0; t < len[r]; ++t)
      for (int i = 0; i < nc * kLanes; ++i) o[i] = std::fma(w[r][t], v[t * nc * kLanes + i], o[i]);
  }
}
#endif
#if !defined(__AVX512F__)
template <int NC>  // (the AVX-512 code has register-blocked ones for 64, 128 and 256)
inline void weighted_sum(float* const* out, const float* const* w, const int64_t* len, int n, const float* v) {
  weighted_sum_any(NC, out, w, len, n, v);
}
#endif

// e^x for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a degree-6
// polynomial, ~2 ulp. x below -87 (a masked entry) gives exactly 0.
inline float exp_neg(float x) {
  if (x < -87.0f) return 0.0f;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  float scale;
  bits = (static_cast<int32_t>(n) + 127) << 23;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Rotate x [d] at position pos in place (non-interleaved halves: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin).
inline void rotate(float* x, const float* cos, const float* sin, int d) {
  const int h = d / 2;
  for (int i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cos[i] - b * sin[i];
    x[i + h] = b * cos[i] + a * sin[i];
  }
}

#if defined(__AVX512F__)
#include "exp16.h"  // exp_neg, 16 lanes

// x[0, len) := softmax(x * scale + bias) in place, x[len, padded) := 0 (padded: a multiple of 16).
// Element-wise steps and 16-lane sums in one fixed order: a row's result depends on its len only.
inline void softmax(float* x, const float* bias, float scale, int64_t len, int64_t padded) {
  const auto valid = [&](int64_t t) {  // lanes t..t+15 below len
    return len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(len - t, 0)) - 1);
  };
  __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __mmask16 m = valid(t);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + t) : _mm512_setzero_ps();
    const __m512 v = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), _mm512_fmadd_ps(_mm512_loadu_ps(x + t), _mm512_set1_ps(scale), b));
    _mm512_storeu_ps(x + t, v);
    top = _mm512_max_ps(top, v);
  }
  const __m512 high = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t t = 0; t < padded; t += 16) {
    const __mmask16 m = valid(t);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + t), high)));
    _mm512_storeu_ps(x + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < padded; t += 16) _mm512_storeu_ps(x + t, _mm512_mul_ps(_mm512_loadu_ps(x + t), inv));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "exp16.h"  // exp_neg, 8 lanes

inline float reduce8(__m256 x, bool max) {  // one fixed order: halves, then pairs, then the last two
  __m128 h = max ? _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1))
                 : _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = max ? _mm_max_ps(h, _mm_movehl_ps(h, h)) : _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = max ? _mm_max_ss(h, _mm_shuffle_ps(h, h, 1)) : _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// x[0, len) := softmax(x * scale + bias) in place, x[len, padded) := 0, 8 lanes at a time (padded: a multiple
// of 16); a row's result depends on its len only (the lanes past it are -inf, then exactly 0).
inline void softmax(float* x, const float* bias, float scale, int64_t len, int64_t padded) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const auto valid = [&](int64_t t) {  // lanes t..t+7 below len: all ones
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(len - t, 0, 8))), lane);
  };
  __m256 top = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256i m = valid(t);
    const __m256 b = bias ? _mm256_maskload_ps(bias + t, m) : _mm256_setzero_ps();
    const __m256 scaled = _mm256_fmadd_ps(_mm256_loadu_ps(x + t), _mm256_set1_ps(scale), b);
    const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scaled, _mm256_castsi256_ps(m));
    _mm256_storeu_ps(x + t, v);
    top = _mm256_max_ps(top, v);
  }
  const __m256 high = _mm256_set1_ps(reduce8(top, true));
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256i m = valid(t);
    const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(m), exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), high)));
    _mm256_storeu_ps(x + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / reduce8(sum, false));
  for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(x + t, _mm256_mul_ps(_mm256_loadu_ps(x + t), inv));
}
#else
inline void softmax(float* x, const float* bias, float scale, int64_t len, int64_t padded) {
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    x[t] = std::fma(x[t], scale, bias ? bias[t] : 0.0f);
    top = std::max(top, x[t]);
  }
  float sum = 0;
  for (int64_t t = 0; t < len; ++t) {
    x[t] = exp_neg(x[t] - top);
    sum += x[t];
  }
  for (int64_t t = 0; t < len; ++t) x[t] /= sum;
  std::fill(x + len, x + padded, 0.0f);
}
#endif

struct Shapes {
  int64_t batch, seq, heads, kv_heads, head_dim, capacity;  // B, S, H, Hkv, D, cache entries per row
};

// A run of query tokens that share one cache row: tokens [first, first + count) of qkv's row ``batch`` (axis 1),
// the last ``count`` of cache row ``slot``'s seqlens_k + 1 entries. A call without token_slots has one per row b,
// {b, 0, S, b}; a packed call (qkv [1, N], token_slots [N]) one per run of equal slots.
struct Segment {
  int64_t batch, first, count, slot;
};

// One call's inputs and outputs. Its work: per (segment, KV head g) the new K/V written into the cache
// (write_entries), then per (segment, g, a range of the group's query heads) those heads' query rows attended
// over their causal prefixes (attend), in parallel.
struct GroupJob {
  const Shapes* shape;
  const float* qkv;       // [B, S, (H + 2 Hkv) D]
  float* k_cache;         // [slots, Hkv, capacity, D]
  float* v_cache;
  const int32_t* seqlens; // [slots] total entries - 1
  const float* cos;       // [positions, D / 2]
  const float* sin;
  const int64_t* pos;     // [B, S]
  const float* bias;      // [bias_batch, bias_heads, S, bias_len] or null
  int64_t bias_batch, bias_heads, bias_len;
  float scale;
  float* out;             // [B, S, H D]
  std::vector<Segment> segments;
};

void write_entries(const GroupJob& j, const Segment& seg, int64_t g) {  // the new K (rotated) and V at [past, total)
  const Shapes& sh = *j.shape;
  const int64_t D = sh.head_dim, W = (sh.heads + 2 * sh.kv_heads) * D, half = D / 2;
  const int64_t past = j.seqlens[seg.slot] + 1 - seg.count, token0 = seg.batch * sh.seq + seg.first;
  float* kc = j.k_cache + (seg.slot * sh.kv_heads + g) * sh.capacity * D;
  float* vc = j.v_cache + (seg.slot * sh.kv_heads + g) * sh.capacity * D;
  for (int64_t s = 0; s < seg.count; ++s) {
    const float* row = j.qkv + (token0 + s) * W;
    const int64_t p = j.pos[token0 + s];
    float* k = kc + (past + s) * D;
    std::memcpy(k, row + (sh.heads + g) * D, D * sizeof(float));
    rotate(k, j.cos + p * half, j.sin + p * half, static_cast<int>(D));
    std::memcpy(vc + (past + s) * D, row + (sh.heads + sh.kv_heads + g) * D, D * sizeof(float));
  }
}

// The query rows of heads g * G + [h0, h1) of a segment: rotated, scored against the group's cache in blocks of
// 16 entries, softmax, weighted sum of V. Row (h, s) never depends on the other rows.
void attend(const GroupJob& j, const Segment& seg, int64_t g, int64_t h0, int64_t h1, std::vector<float>& scratch) {
  const Shapes& sh = *j.shape;
  const int64_t S = seg.count, D = sh.head_dim, G = sh.heads / sh.kv_heads, W = (sh.heads + 2 * sh.kv_heads) * D;
  const int64_t total = j.seqlens[seg.slot] + 1, past = total - S, half = D / 2;
  const int64_t token0 = seg.batch * sh.seq + seg.first;
  const float* kc = j.k_cache + (seg.slot * sh.kv_heads + g) * sh.capacity * D;
  const float* vc = j.v_cache + (seg.slot * sh.kv_heads + g) * sh.capacity * D;
  const int64_t rows = (h1 - h0) * S;
  const int64_t padded = (total + 15) / 16 * 16;  // scores in blocks of 16 entries, the last one zero-padded
  scratch.resize(rows * D + rows * padded + rows * D + 16 * D);
  float* q = scratch.data();             // [rows, D]
  float* score = q + rows * D;           // [rows, padded]
  float* acc = score + rows * padded;    // [rows, D]
  float* tail = acc + rows * D;          // [16, D] the last block's entries, zeros after the cache's
  const auto causal = [&](int64_t r) { return past + r % S + 1; };  // entries row r = (head, token s) sees
  for (int64_t h = 0; h < h1 - h0; ++h)
    for (int64_t s = 0; s < S; ++s) {
      float* qr = q + (h * S + s) * D;
      const int64_t p = j.pos[token0 + s];
      std::memcpy(qr, j.qkv + (token0 + s) * W + (g * G + h0 + h) * D, D * sizeof(float));
      rotate(qr, j.cos + p * half, j.sin + p * half, static_cast<int>(D));
    }
  for (int64_t t0 = 0; t0 < padded; t0 += 16) {  // one pass over K: every row's scores of 16 entries
    const float* k = kc + t0 * D;
    if (t0 + 16 > total) {
      std::fill(tail, tail + 16 * D, 0.0f);
      std::memcpy(tail, k, (total - t0) * D * sizeof(float));
      k = tail;
    }
    for (int64_t r = 0; r < rows; ++r) dot16(q + r * D, k, static_cast<int>(D), score + r * padded + t0);
  }
  for (int64_t r = 0; r < rows; ++r) {  // scale, bias, causal softmax per row
    const int64_t h = r / S, s = r % S;
    float* x = score + r * padded;
    const float* bias = nullptr;
    if (j.bias) {
      const int64_t bb = j.bias_batch == 1 ? 0 : seg.batch, bh = j.bias_heads == 1 ? 0 : g * G + h0 + h;
      bias = j.bias + ((bb * j.bias_heads + bh) * sh.seq + seg.first + s) * j.bias_len;
    }
    softmax(x, bias, j.scale, causal(r), padded);
  }
  const int chunk = static_cast<int>(std::max<int64_t>(1, kLanes / (D / kLanes)));  // rows per pass over V
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int n = static_cast<int>(std::min<int64_t>(chunk, rows - r0));
    float* out[kLanes];
    const float* w[kLanes];
    int64_t len[kLanes];
    for (int i = 0; i < n; ++i) {
      out[i] = acc + (r0 + i) * D;
      w[i] = score + (r0 + i) * padded;
      len[i] = causal(r0 + i);
    }
    switch (D / kLanes) {
      case 4: weighted_sum<4>(out, w, len, n, vc); break;
      case 8: weighted_sum<8>(out, w, len, n, vc); break;
      case 16: weighted_sum<16>(out, w, len, n, vc); break;
      default: weighted_sum_any(static_cast<int>(D / kLanes), out, w, len, n, vc);
    }
  }
  for (int64_t h = 0; h < h1 - h0; ++h)
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(j.out + ((token0 + s) * sh.heads + g * G + h0 + h) * D, acc + (h * S + s) * D, D * sizeof(float));
}

struct ParallelArgs {
  const GroupJob* job;
  int64_t kv_heads, parts, group;  // task i = (segment, g, part): part p of the group's query heads
};

void run_task(void* data, size_t i) {
  const auto* a = static_cast<const ParallelArgs*>(data);
  thread_local std::vector<float> scratch;
  const int64_t task = static_cast<int64_t>(i), part = task % a->parts, sg = task / a->parts;
  const int64_t h0 = a->group * part / a->parts, h1 = a->group * (part + 1) / a->parts;
  attend(*a->job, a->job->segments[sg / a->kv_heads], sg % a->kv_heads, h0, h1, scratch);
}

// The call's segments: one per row b without token_slots (every cache row its own, cache rows = B); with them
// (qkv [1, N], token_slots [N]) one per run of equal slots, each slot in one run at most. Throws on anything else.
std::vector<Segment> segments(const Shapes& sh, int64_t slots, const int64_t* token_slots) {
  std::vector<Segment> out;
  if (!token_slots) {
    if (slots != sh.batch)
      ORT_CXX_API_THROW("specrt GroupQueryAttention: the cache's rows differ from qkv's", ORT_INVALID_ARGUMENT);
    for (int64_t b = 0; b < sh.batch; ++b) out.push_back({b, 0, sh.seq, b});
    return out;
  }
  if (sh.batch != 1)
    ORT_CXX_API_THROW("specrt GroupQueryAttention: token_slots needs qkv [1, N]", ORT_INVALID_ARGUMENT);
  std::vector<bool> seen(static_cast<size_t>(slots), false);
  for (int64_t t = 0; t < sh.seq; ++t) {
    const int64_t slot = token_slots[t];
    if (slot < 0 || slot >= slots)
      ORT_CXX_API_THROW("specrt GroupQueryAttention: token_slots outside the cache", ORT_INVALID_ARGUMENT);
    if (!out.empty() && out.back().slot == slot) {
      ++out.back().count;
      continue;
    }
    if (seen[slot])
      ORT_CXX_API_THROW("specrt GroupQueryAttention: a slot's tokens must be consecutive", ORT_INVALID_ARGUMENT);
    seen[slot] = true;
    out.push_back({0, t, 1, slot});
  }
  return out;
}

struct AttentionKernel {
  int64_t heads, kv_heads;
  float scale;

  AttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo k(info);
    heads = k.GetAttribute<int64_t>("num_heads");
    kv_heads = k.GetAttribute<int64_t>("kv_num_heads");
    scale = k.GetAttribute<float>("scale");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto qkv = ctx.GetInput(0), past_k = ctx.GetInput(3), past_v = ctx.GetInput(4);
    auto seqlens = ctx.GetInput(5), cos = ctx.GetInput(7), sin = ctx.GetInput(8), pos = ctx.GetInput(9);
    auto qs = qkv.GetTensorTypeAndShapeInfo().GetShape(), cs = past_k.GetTensorTypeAndShapeInfo().GetShape();
    Shapes sh{qs[0], qs[1], heads, kv_heads, cs[3], cs[2]};
    if (qs[2] != (heads + 2 * kv_heads) * sh.head_dim || sh.head_dim % kLanes || heads % kv_heads)
      ORT_CXX_API_THROW("specrt GroupQueryAttention: unsupported shapes", ORT_INVALID_ARGUMENT);
    const int64_t* token_slots = nullptr;  // input 11, optional: a packed call's cache row per token
    if (ctx.GetInputCount() > 11) {
      auto packed = ctx.GetInput(11);
      if (packed && packed.GetTensorTypeAndShapeInfo().GetElementCount() > 0) {
        if (packed.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(sh.batch * sh.seq))
          ORT_CXX_API_THROW("specrt GroupQueryAttention: token_slots must hold one slot per token", ORT_INVALID_ARGUMENT);
        token_slots = packed.GetTensorData<int64_t>();
      }
    }
    GroupJob job{&sh, qkv.GetTensorData<float>(), nullptr, nullptr, seqlens.GetTensorData<int32_t>(),
                 cos.GetTensorData<float>(), sin.GetTensorData<float>(), pos.GetTensorData<int64_t>(), nullptr, 1, 1,
                 0, scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(sh.head_dim)) : scale, nullptr,
                 segments(sh, cs[0], token_slots)};
    if (static_cast<int64_t>(seqlens.GetTensorTypeAndShapeInfo().GetElementCount()) != cs[0])
      ORT_CXX_API_THROW("specrt GroupQueryAttention: seqlens_k must hold one length per cache row", ORT_INVALID_ARGUMENT);
    const int64_t positions = cos.GetTensorTypeAndShapeInfo().GetShape()[0];
    int64_t longest = 0;
    for (const Segment& seg : job.segments) {
      const int64_t total = job.seqlens[seg.slot] + 1;
      if (total > sh.capacity || total < seg.count)
        ORT_CXX_API_THROW("specrt GroupQueryAttention: seqlens_k out of the cache", ORT_INVALID_ARGUMENT);
      longest = std::max(longest, total);
      for (int64_t s = 0; s < seg.count; ++s) {
        const int64_t p = job.pos[seg.batch * sh.seq + seg.first + s];
        if (p < 0 || p >= positions)
          ORT_CXX_API_THROW("specrt GroupQueryAttention: position_ids out of the rotary caches", ORT_INVALID_ARGUMENT);
      }
    }
    auto out = ctx.GetOutput(0, {sh.batch, sh.seq, heads * sh.head_dim});
    auto present_k = ctx.GetOutput(1, cs), present_v = ctx.GetOutput(2, cs);
    job.k_cache = present_k.GetTensorMutableData<float>();
    job.v_cache = present_v.GetTensorMutableData<float>();
    job.out = out.GetTensorMutableData<float>();
    const size_t cache_bytes = cs[0] * kv_heads * sh.capacity * sh.head_dim * sizeof(float);
    const float* pasts[2] = {past_k.GetTensorData<float>(), past_v.GetTensorData<float>()};
    float* presents[2] = {job.k_cache, job.v_cache};
    for (int i = 0; i < 2; ++i)  // (bound in place, as the runtime binds them: the same memory, nothing to copy)
      if (presents[i] != pasts[i]) std::memcpy(presents[i], pasts[i], cache_bytes);
    if (ctx.GetInputCount() > 10) {
      auto bias = ctx.GetInput(10);
      if (bias) {
        auto bs = bias.GetTensorTypeAndShapeInfo().GetShape();
        if (bs.size() != 4 || (bs[0] != 1 && bs[0] != sh.batch) || (bs[1] != 1 && bs[1] != heads) || bs[2] != sh.seq ||
            bs[3] < longest)
          ORT_CXX_API_THROW("specrt GroupQueryAttention: attention_bias is not [B|1, H|1, S, >= total]", ORT_INVALID_ARGUMENT);
        job.bias = bias.GetTensorData<float>();
        job.bias_batch = bs[0];
        job.bias_heads = bs[1];
        job.bias_len = bs[3];
      }
    }
    for (const Segment& seg : job.segments)
      for (int64_t g = 0; g < kv_heads; ++g) write_entries(job, seg, g);
    // a task per (segment, KV head); with few of them and many query rows (a verify pass), one per query head too,
    // to fill the pool (a decode step's few rows run faster together: they share each K block's loads)
    const int64_t group = heads / kv_heads, count = static_cast<int64_t>(job.segments.size());
    ParallelArgs args{&job, kv_heads, count * kv_heads < 8 && group * sh.batch * sh.seq > 6 * count ? group : 1, group};
    ctx.ParallelFor(run_task, static_cast<size_t>(count * kv_heads * args.parts), 0, &args);
  }
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new AttentionKernel(api, info); }
  const char* GetName() const { return "GroupQueryAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 12; }  // GroupQueryAttention's 11, then token_slots (packed calls)
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 5 || i == 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    if (i == 9 || i == 11) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return (i == 1 || i == 2 || i == 10 || i == 11) ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                                         : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

  // What ONNX Runtime's kernel declares, so the ops after it keep their shapes: output [B, S, H * D] (D the
  // cache's head dim), present_key / present_value the past's shapes.
  static OrtStatusPtr InferOutputShape(Ort::ShapeInferContext& ctx) {
    try {
      const auto& qkv = ctx.GetInputShape(0);
      const auto& cache = ctx.GetInputShape(3);
      if (qkv.size() != 3 || cache.size() != 4)
        ORT_CXX_API_THROW("specrt GroupQueryAttention: qkv must be 3-D and the cache 4-D", ORT_INVALID_ARGUMENT);
      Ort::ShapeInferContext::Shape out{qkv[0], qkv[1], qkv[2]};
      if (cache[3].IsInt()) out[2] = Ort::ShapeInferContext::SymbolicInteger(ctx.GetAttrInt("num_heads") * cache[3].AsInt());
      for (auto [i, shape] : {std::pair<size_t, const Ort::ShapeInferContext::Shape*>{0, &out}, {1, &cache},
                              {2, &ctx.GetInputShape(4)}}) {
        Ort::Status status = ctx.SetOutputShape(i, *shape);
        if (!status.IsOK()) return status.release();
      }
    } catch (const Ort::Exception& e) {
      return Ort::Status(e).release();
    }
    return nullptr;
  }
};

AttentionOp attention_op;

}  // namespace

#ifndef SPECRT_KERNEL_EXPORT  // libspecrt compiles this file in and keeps the symbol to itself (runtime/cpp)
#define SPECRT_KERNEL_EXPORT __attribute__((visibility("default")))
#endif
extern "C" SPECRT_KERNEL_EXPORT OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    static Ort::CustomOpDomain domain{"ai.specrt"};
    static bool added = false;
    if (!added) {
      domain.Add(&attention_op);
      if (const OrtCustomOp* matmul = specrt_matmul_nbits_op()) domain.Add(matmul);
      if (const OrtCustomOp* int8 = specrt_matmul_int8_op()) domain.Add(int8);
      if (const OrtCustomOp* dynamic = specrt_dynamic_matmul_int8_op()) domain.Add(dynamic);
      added = true;
    }
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
