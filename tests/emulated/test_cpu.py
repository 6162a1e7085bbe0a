"""Run by tests/emulated/run.sh under qemu-user: the process sees the emulated CPU, not the host's (else the other
tests there would prove nothing). Skipped when run natively."""
import os

import pytest

from specrt.custom_ops import cpu_flags, matmul_isa, vector_code
from specrt.engines.ort import nbits_one_row_differs

pytestmark = pytest.mark.skipif(os.environ.get("SPECRT_KERNEL_MARCH") != "x86-64-v3",
                                reason="run under emulation by tests/emulated/run.sh")


def test_the_process_sees_an_avx2_cpu_without_avx512():
    """... and specrt's int4 matmul runs its AVX2 variant (custom_ops/matmul_nbits_avx2.cpp), capped there whatever
    SPECRT_ISA asks for above it."""
    assert set(cpu_flags().split()) == {"avx2", "fma"} and vector_code() and matmul_isa() == "avx2"
    os.environ["SPECRT_ISA"] = "avx512"
    try:
        assert matmul_isa() == "avx2"
    finally:
        del os.environ["SPECRT_ISA"]


def test_onnx_runtime_takes_its_avx2_int4_matmul_whose_one_row_path_differs():
    assert nbits_one_row_differs(4, 32, 4, 576, False)  # the probe finds what the runtime's decode rows work around
