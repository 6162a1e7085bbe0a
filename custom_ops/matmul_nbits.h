// specrt's int4 matmul (matmul_nbits.cpp): the layout every variant reads, and the interface each ISA variant
// implements. One variant a file, each compiled with its own flags (custom_ops/__init__.py KERNEL_VARIANTS,
// runtime/cpp/CMakeLists.txt):
//
//   matmul_nbits_ref.cpp     portable C++: the oracle the tests hold the others to, and what SPECRT_ISA=ref runs
//   matmul_nbits_avx2.cpp    AVX2 + FMA (x86-64-v3: Haswell, AMD Zen 1 on)
//   matmul_nbits_avx512.cpp  AVX-512 VNNI (Ice Lake, AMD Zen 4 on), and AMX's int8 tiles where Linux grants them
//
// Every variant computes the same integer sums and then the same float operations in the same order (a multiply-add
// is an FMA in all of them; the norm's sum of squares is 16 lanes added up by sum16), so they give the same bits and
// a row's bits never depend on the call's other rows or on the variant that ran.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace specrt_nbits {

constexpr int64_t kCols = 16;             // columns per group
constexpr int64_t kBlock = 32;            // K-values per quantization block
constexpr int64_t kTileBytes = 256 + 64;  // one (group, block): 16 x 32 nibbles, then 16 fp32 scales

// The weights of one node, repacked: tile (g, b) at data + (g * blocks + b) * kTileBytes. Byte c * 4 + j of its
// 64-byte chunk i holds, for column g * 16 + c, K-value b * 32 + 8 * i + j in the low nibble and b * 32 + 8 * i + 4 + j
// in the high nibble (stored unsigned: q + 8). The column scales of the block follow the 4 chunks, 64-byte aligned.
// A 512-bit register holds a chunk (16 columns x 4 K-values), a 256-bit one half of it (8 columns).
struct Packed {
  int64_t n = 0, k = 0, groups = 0, blocks = 0;
  std::unique_ptr<uint8_t, decltype(&std::free)> data{nullptr, &std::free};
};

// A call's activations quantized per row and block of 32 (scale = max|a| / 127, q = a / scale rounded to nearest
// even), block-major so that a tile reads all its rows' words at constant offsets from one pointer:
// q [blocks, M, 32] int8, scale [blocks, M], bias [blocks, M] = -8 * sum of the block's q (the weights' zero point,
// folded into the int32 sum's start).
struct Rows {
  int64_t m = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> bias;

  void resize(int64_t rows, int64_t k) {  // for rows of k values (a multiple of 32)
    m = rows, q.resize(rows * k), scale.resize(rows * k / kBlock), bias.resize(rows * k / kBlock);
  }
};

// One call's work, shared out among threads as ParallelFor tasks of `span` groups each.
struct Job {
  const Packed* p;
  const Rows* a;
  int64_t m;
  int64_t span;  // groups per task
  float* y;      // [m, n]: the matmul's output (SwiGLU: its packed column order, a scratch)
  float* act;    // SwiGLU: [m, n / 2] silu(gate) * up; nullptr: none
  bool amx;      // AVX-512 only: tiles of 16 rows (the last one: at least 9) through AMX's int8 tiles
};

// What a variant implements.
struct Variant {
  const char* isa;  // "ref", "avx2", "avx512": SPECRT_ISA's names
  // Rows from a [m, k] (k a multiple of 32)
  void (*quantize)(const float* a, int64_t m, int64_t k, Rows& rows);
  // The RMS norm folded in before the matmul: v = x (+ skip), written to sum where given, then
  // out = v * (1 / sqrt(sum16(v^2) / k + epsilon)) * gamma, a row at a time (k a multiple of 16)
  void (*rms_norm)(const float* x, const float* skip, const float* gamma, float epsilon, int64_t m, int64_t k,
                   float* sum, float* out);
  // Task i of a Job: groups [i * span, (i + 1) * span) for every row,
  // y[r, c] = sum over blocks b of float(bias + dot(q, w)) * (w_scale * a_scale) accumulated by FMAs in block order;
  // then, with act, silu(gate) * up of those groups (the pairs 2i, 2i + 1), silu's exponential as exp16 computes it.
  void (*run_task)(void* job, size_t i);
};

const Variant* ref_variant();
const Variant* avx2_variant();    // nullptr where not compiled (not x86-64)
const Variant* avx512_variant();  // the same

// The sum of 16 lanes in the order AVX-512's horizontal add takes them (halves of 8, then 4, then 2): every variant
// adds its squares' lanes with this, so the norm gives the same bits everywhere.
inline float sum16(const float* v) {
  float h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = v[i + 8] + v[i];
  for (int i = 0; i < 4; ++i) h4[i] = h8[i + 4] + h8[i];
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

}  // namespace specrt_nbits
