// The ops of libspecrt_kernels.so beside the attention kernel, added to the ai.specrt domain by
// RegisterCustomOps (attention.cpp).
#pragma once

struct OrtCustomOp;

// ai.specrt::MatMulNBits (matmul_nbits.cpp): nullptr where the compiler cannot build its AVX-512 VNNI code
// (not x86-64); the op itself refuses to run on a CPU without it.
const OrtCustomOp* specrt_matmul_nbits_op();

// Whether this CPU runs it (x86-64 with AVX-512 F, BW and VNNI).
bool specrt_matmul_nbits_runs();
