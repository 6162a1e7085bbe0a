"""libspecrt for the tests: built once per session with CMake (incremental: a no-op when up to date)."""
from __future__ import annotations

import os
import shutil

import pytest

from specrt.tools import libspecrt


@pytest.fixture(scope="session")
def cpp_build():
    """The CMake build dir of runtime/cpp ($SPECRT_CPP_BUILD, else <repo>/build/cpp), built now."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.fail("the C++ runtime's tests need cmake and a C++17 compiler (apt-get install cmake g++)")
    return libspecrt.build(os.environ.get("SPECRT_CPP_BUILD", libspecrt.DEFAULT_BUILD), log=lambda *_: None)


@pytest.fixture(scope="session")
def lib(cpp_build):
    return libspecrt.load_library(libspecrt.library_path(cpp_build))


@pytest.fixture(scope="session")
def demo_engine(tmp_path_factory):
    """The demo pair (committed weights) exported into a fresh cache: fused graphs, max_len 256."""
    from specrt.tools import demo_engines

    cache = tmp_path_factory.mktemp("demo_cache")
    old = os.environ.get("SPECRT_CACHE")
    os.environ["SPECRT_CACHE"] = str(cache)
    try:
        return demo_engines.demo_engine_dir(gamma=4, max_len=256, log=lambda *_: None)
    finally:
        if old is None:
            os.environ.pop("SPECRT_CACHE")
        else:
            os.environ["SPECRT_CACHE"] = old
