// The int4 matmul's portable reference (matmul_nbits.h): plain C++, one value at a time, written to be read. It is the
// oracle the vector variants are tested against bit for bit (tests/engines/test_matmul_kernel.py) and runs on any CPU
// with SPECRT_ISA=ref. Compiled with -ffp-contract=off: every FMA here is a std::fma, as the vector code's are.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "matmul_nbits.h"

namespace specrt_nbits {
namespace {

void quantize(const float* a, int64_t m, int64_t k, Rows& rows) {
  const int64_t blocks = k / kBlock;
  rows.resize(m, k);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* x = a + r * k + blk * kBlock;
      float amax = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
      int8_t* out = rows.q.data() + (blk * m + r) * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float q = std::nearbyint(x[j] * inverse);  // the default rounding: to nearest, ties to even
        out[j] = static_cast<int8_t>(std::isnan(q) ? -128.0f : std::clamp(q, -128.0f, 127.0f));  // as x86's cvtps
        sum += out[j];
      }
      rows.scale[blk * m + r] = scale;
      rows.bias[blk * m + r] = -8 * sum;
    }
}

void rms_norm(const float* x, const float* skip, const float* gamma, float epsilon, int64_t m, int64_t k, float* sum,
              float* out) {
  for (int64_t r = 0; r < m; ++r) {
    float* o = out + r * k;
    float lanes[16] = {};
    for (int64_t t = 0; t < k; ++t) {
      const float v = skip ? x[r * k + t] + skip[r * k + t] : x[r * k + t];
      if (sum) sum[r * k + t] = v;
      o[t] = v;
      lanes[t % 16] = std::fma(v, v, lanes[t % 16]);
    }
    const float inverse = 1.0f / std::sqrt(sum16(lanes) / static_cast<float>(k) + epsilon);
    for (int64_t t = 0; t < k; ++t) o[t] = o[t] * inverse * gamma[t];
  }
}

// Weight (column c, K-value kk) of the packed node, q + 8 in [0, 15]
int weight(const Packed& p, int64_t c, int64_t kk) {
  const int64_t g = c / kCols, blk = kk / kBlock, i = kk % kBlock / 8, j = kk % 4;
  const uint8_t byte = p.data.get()[(g * p.blocks + blk) * kTileBytes + i * 64 + c % kCols * 4 + j];
  return kk % 8 < 4 ? byte & 15 : byte >> 4;
}

float column_scale(const Packed& p, int64_t c, int64_t blk) {
  float s;
  std::memcpy(&s, p.data.get() + (c / kCols * p.blocks + blk) * kTileBytes + 256 + c % kCols * 4, sizeof s);
  return s;
}

// e^x for x <= 0, exp16.h's steps one lane at a time
float exp_lane(float x) {
  const bool kept = x >= -87.0f;
  x = std::max(x, -87.0f);
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  const float r = std::fma(n, 2.12194440e-4f, std::fma(-n, 0.693359375f, x));
  float p = 1.0f / 720;
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = std::fma(p, r, c);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float e;
  std::memcpy(&e, &bits, sizeof e);
  return kept ? p * e : 0.0f;
}

// silu(gate) * up, the sigmoid from e = e^-|gate|: 1 / (1 + e) where gate >= 0, else e / (1 + e)
float swiglu_lane(float gate, float up) {
  const float e = exp_lane(-std::fabs(gate));
  return gate * ((gate < 0.0f ? e : 1.0f) / (1.0f + e)) * up;
}

void run_task(void* data, size_t i) {
  const auto* job = static_cast<const Job*>(data);
  const Packed& p = *job->p;
  const Rows& a = *job->a;
  const int64_t g0 = static_cast<int64_t>(i) * job->span, g_end = std::min<int64_t>(p.groups, g0 + job->span);
  for (int64_t r = 0; r < job->m; ++r)
    for (int64_t c = g0 * kCols; c < g_end * kCols; ++c) {
      float acc = 0.0f;
      for (int64_t blk = 0; blk < p.blocks; ++blk) {
        const int8_t* q = a.q.data() + (blk * a.m + r) * kBlock;
        int32_t dot = a.bias[blk * a.m + r];
        for (int64_t j = 0; j < kBlock; ++j) dot += weight(p, c, blk * kBlock + j) * q[j];
        acc = std::fma(static_cast<float>(dot), column_scale(p, c, blk) * a.scale[blk * a.m + r], acc);
      }
      job->y[r * p.n + c] = acc;
    }
  if (!job->act) return;
  for (int64_t r = 0; r < job->m; ++r)  // packed pairs 2g, 2g + 1: output columns 16g..16g+15
    for (int64_t g = g0; g < g_end; g += 2)
      for (int64_t c = 0; c < kCols; ++c) {
        const float* y = job->y + r * p.n + g * kCols;
        job->act[r * (p.n / 2) + g / 2 * kCols + c] = swiglu_lane(y[c], y[kCols + c]);
      }
}

const Variant kRef{"ref", quantize, rms_norm, run_task};

}  // namespace

const Variant* ref_variant() { return &kRef; }

}  // namespace specrt_nbits
