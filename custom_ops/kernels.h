// The ops of libspecrt_kernels.so beside the attention kernel, added to the ai.specrt domain by
// RegisterCustomOps (attention.cpp).
#pragma once

#include <cstdint>

struct OrtCustomOp;

// ai.specrt::MatMulNBits (matmul_nbits.cpp), the int4 matmul: its variants (reference, AVX2, AVX-512 VNNI) chosen when
// a session opens, from the CPU and $SPECRT_ISA
const OrtCustomOp* specrt_matmul_nbits_op();

// Whether the graphs' int4 matmuls go to it: a vector variant runs here, or $SPECRT_ISA=ref asks for the reference
bool specrt_matmul_nbits_runs();

// The variant that runs ("ref", "avx2", "avx512"), "ort" where the int4 matmuls stay ONNX Runtime's (no vector variant
// runs here), "" where $SPECRT_ISA names none (exported from libspecrt_kernels.so: Python asks it)
extern "C" const char* specrt_matmul_nbits_isa();

// Whether this CPU has AVX-512 F, BW, DQ, VL and VNNI (the int8 matmul's VNNI code needs them)
bool specrt_avx512_vnni();

// ai.specrt::MatMulInt8 (matmul_int8.cpp): the int8 lm_head with its row scale folded in; nullptr where the compiler
// cannot build it (not x86-64); the op refuses to run on a CPU without AVX-512 VNNI (AMX where there is one).
const OrtCustomOp* specrt_matmul_int8_op();

// ai.specrt::DynamicMatMulInt8 (matmul_int8.cpp): the same, with the per-row quantization of its float activations folded
// in (a prefill graph's matmuls, custom_ops/__init__.py fuse_row_quantize); nullptr where MatMulInt8 is.
const OrtCustomOp* specrt_dynamic_matmul_int8_op();

// Whether the graphs' int8 matmuls go to it (custom_ops/__init__.py int8_code): AVX-512 VNNI and AMX's int8 tiles.
bool specrt_matmul_int8_runs();

// Whether AMX's int8 tiles run in this process: the CPU has them, Linux granted them (asked once), and SPECRT_NO_AMX is
// not 1 (the tests compare the paths). Both matmuls take them for calls of many rows (matmul_int8.cpp).
bool specrt_amx_enabled();

// AMX's ldtilecfg operand, 64 bytes: palette 1, then each tile register's bytes a row and rows (both matmuls' AMX paths)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
