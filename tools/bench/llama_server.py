"""llama.cpp's binaries for `specrt bench peers --serve`: found, or listed with the recipe that builds them.

A binary is looked up as ``--llama-server PATH`` says, else on ``$PATH``, else in a known build dir (where
the recipe below builds: ``$SPECRT_CACHE/llama.cpp/llama_cpp_python-*/vendor/llama.cpp/build/bin``).
``llama-quantize`` is looked up beside ``llama-server`` first. GGUF files are requantized once into
``$SPECRT_CACHE/llama-gguf/`` (``llama-quantize --allow-requantize``: the comparison's Q4_0 / Q8_0 / F32 of
the same weights specrt exports).

    find_binary("llama-server")          # -> Path or None
    server_argv(binary, gguf, port=8080, threads=2, clients=4, ctx=8192, spec_type="ngram-mod")
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..demo_engines import cache_dir

# specrt precision -> the llama.cpp type of the same bits per weight
LLAMA_TYPES = {"int4": "Q4_0", "int8": "Q8_0", "fp32": "F32"}
SPEC_TYPES = ("none", "ngram-simple", "ngram-mod")  # llama-server --spec-type values run by default
DRAFT_TYPE = "draft-simple"  # with --draft-gguf


# /proc/cpuinfo flag -> the ggml CMake option that compiles its kernels (AMX left out: llama-server built with
# GGML_NATIVE=ON, which enables AMX, died with SIGSEGV loading a Q4_0 model on this project's VMs)
X86_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
               "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
               "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}


def cpu_cmake_options(cpuinfo: str | None = None) -> list[str]:
    """The ggml options for every x86 extension this CPU reports (``cpuinfo``: /proc/cpuinfo's text), so the
    peer runs its fastest kernels that run here, e.g. ``-DGGML_AVX512_VNNI=ON`` on an AVX-512 VNNI CPU."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return ["-DGGML_NATIVE=OFF"] + [f"-D{option}=ON" for flag, option in X86_OPTIONS.items() if flag in flags]


def build_recipe() -> str:
    """How to build llama-server and llama-quantize from llama.cpp's sources (the llama-cpp-python sdist)."""
    root = cache_dir() / "llama.cpp"
    return (f"build them (~10 min on 2 cores; needs cmake and a C++ compiler):\n"
            f"  mkdir -p {root} && cd {root} && pip download --no-binary :all: --no-deps llama-cpp-python\n"
            f"  tar xzf llama_cpp_python-*.tar.gz && S=$(ls -d llama_cpp_python-*/vendor/llama.cpp | tail -1)\n"
            f"  cmake -S $S -B $S/build {' '.join(cpu_cmake_options())} -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF\n"
            f"  cmake --build $S/build -j 2 --target llama-server llama-quantize\n"
            f"or pass --llama-server PATH / put llama-server on $PATH")


def known_build_dirs() -> list[Path]:
    """Where the recipe (and the project's earlier sessions) built llama.cpp; newest source first."""
    dirs = []
    for root in (cache_dir() / "llama.cpp", Path("/tmp/llamacpp")):
        dirs += sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin"), reverse=True)
    return dirs


def find_binary(name: str, explicit: str | None = None, beside: Path | None = None) -> Path | None:
    """``explicit`` if given (None when it is not an executable file), else beside ``beside``, $PATH, build dirs."""
    if explicit:
        path = Path(explicit)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    candidates = [beside.parent / name] if beside else []
    on_path = shutil.which(name)
    candidates += [Path(on_path)] if on_path else []
    candidates += [d / name for d in known_build_dirs()]
    return next((c for c in candidates if c.is_file()), None)


def version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown"


def build_options(binary: Path) -> list[str]:
    """The x86 GGML_* options a CMake build of ``binary`` was configured with (its build dir's CMakeCache.txt),
    e.g. ["GGML_AVX2=ON", "GGML_AVX512=ON", "GGML_NATIVE=OFF"]; [] when that file is not found."""
    x86 = {*X86_OPTIONS.values(), "GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"}
    for cache in (binary.parent.parent / "CMakeCache.txt", binary.parent / "CMakeCache.txt"):
        if cache.is_file():
            entries = (line.split(":", 1) for line in cache.read_text().splitlines() if line.startswith("GGML_"))
            options = {name: value.removeprefix("BOOL=") for name, value in entries
                       if name in x86 and value.startswith("BOOL=")}  # GGML_AVX2:BOOL=ON -> {"GGML_AVX2": "ON"}
            return sorted(f"{name}={value}" for name, value in options.items() if value == "ON" or name == "GGML_NATIVE")
    return []


def requantize(quantize_bin: Path, gguf: Path, llama_type: str, sha256: str) -> Path:
    """``gguf`` as ``llama_type`` (Q4_0 / Q8_0 / F32), made once in the cache; CalledProcessError if it fails."""
    out = cache_dir() / "llama-gguf" / f"{gguf.stem}-{sha256[:12]}-{llama_type}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        subprocess.run([str(quantize_bin), "--allow-requantize", str(gguf), str(tmp), llama_type], check=True,
                       capture_output=True)
        tmp.rename(out)
    return out


def server_argv(binary: Path, gguf: Path, port: int, threads: int, clients: int, ctx: int, spec_type: str,
                draft: Path | None = None, extra: tuple = ()) -> list[str]:
    """llama-server on loopback: ``clients`` slots sharing ``ctx`` tokens of context, one speculative type."""
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-np", str(clients), "-c", str(ctx), "--spec-type", spec_type, "--no-webui"]
    if spec_type == DRAFT_TYPE:
        argv += ["-md", str(draft)]
    return argv + list(extra)
