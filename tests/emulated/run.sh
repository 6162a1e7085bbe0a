#!/usr/bin/env bash
# The tests whose outcome depends on which kernels the CPU runs, on an emulated AVX2-only CPU: qemu-user's x86-64
# emulator with an AMD EPYC Zen 3 model (AVX2 and FMA, no AVX-512, VNNI or AMX), so ONNX Runtime takes its AVX2 code
# (MLAS picks its kernels from CPUID) and specrt its AVX2 attention and its AVX2 int4 matmul, as on such a
# machine; on any x86-64 host. ~10x slower than native: only the decode-vs-verify and the int4 greedy == plain tests
# run here (the real model's engine is exported natively first, by the main run, and found in $SPECRT_CACHE).
#   bash tests/emulated/run.sh              # in the venv that runs the tests (.ci/run calls it)
#   bash tests/emulated/run.sh -k int4      # extra pytest arguments
# Needs qemu-user (Debian's package; installed here if missing and apt-get works). docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v qemu-x86_64 >/dev/null; then
  apt-get update -q && apt-get install -y -q qemu-user
fi
cpu="${SPECRT_EMULATED_CPU:-EPYC-Milan}"
# the kernel library is compiled by the host's compiler: -march=native would be the host's ISA, not the emulated one's
export SPECRT_KERNEL_MARCH=x86-64-v3
python=$(python -c 'import sys; print(sys.executable)')
echo "emulated CPU: $cpu ($(qemu-x86_64 --version | head -1))"
# qemu names the CPU model's features its emulator lacks (none the kernels use) once per process: not shown
# the real int4 engine's greedy == plain on the attention an AVX2 CPU runs by default (specrt's), ~5 min a method
real=tests/real/test_real_methods.py::test_method_greedy_equals_plain_on_specrt_attention
qemu-x86_64 -cpu "$cpu" "$python" -m pytest -p no:cacheprovider tests/emulated/test_cpu.py \
  tests/runtime/test_decode_graph.py "$real" "$@" 2> >(grep -v "TCG doesn't support requested feature" >&2)
