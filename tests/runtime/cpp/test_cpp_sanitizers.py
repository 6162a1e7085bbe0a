"""libspecrt built with AddressSanitizer and UndefinedBehaviorSanitizer runs its C++ tests clean,
end to end on a traced and a fused engine dir (greedy and sampled, every method)."""
import os
import subprocess

import pytest

from specrt.tools import libspecrt


@pytest.fixture(scope="module")
def asan_build(cpp_build):
    return libspecrt.build(cpp_build.parent / f"{cpp_build.name}-asan", sanitize=True, log=lambda *_: None)


@pytest.mark.parametrize("kind", ["llama_engine", "llama_fused_engine"])
def test_ctest_under_sanitizers(asan_build, kind, request):
    engine = request.getfixturevalue(kind)
    env = {**os.environ, "SPECRT_TEST_ENGINE": str(engine),
           "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    res = subprocess.run(["ctest", "--test-dir", str(asan_build), "--output-on-failure"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "100% tests passed" in res.stdout
