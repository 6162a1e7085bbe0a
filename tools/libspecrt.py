"""ctypes binding of libspecrt's C ABI (runtime/cpp/include/specrt.h), and its CMake build.

What the tests and the C++ benchmark drive the C++ runtime through; also the worked example of
calling libspecrt from a language with a C FFI. ``CppEngine.generate`` answers like
``Runtime.generate`` (``token_ids``, ``finish_reason``, ``stats``), so the Python harnesses run on it.

    python -m specrt.tools.libspecrt build [--build-dir build/cpp] [--sanitize]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "runtime" / "cpp"  # the CMake project
DEFAULT_BUILD = SOURCE.parent.parent / "build" / "cpp"  # <repo>/build/cpp (ignored by git)
STATUS = {0: "ok", 1: "engine", 2: "argument", 3: "runtime"}
FINISH = {0: "stop", 1: "length", 2: "cancelled"}


class CppError(RuntimeError):
    """A failed libspecrt call: ``kind`` is "engine", "argument" or "runtime"; the message is libspecrt's."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("new_tokens", "target_passes", "draft_passes", "rounds", "proposed",
                                               "accepted", "rejections")] + \
               [(n, ctypes.c_double) for n in ("acceptance_rate", "alpha", "tokens_per_pass", "wall_seconds",
                                                "engine_seconds")]


class _Result(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_size_t), ("finish_reason", ctypes.c_int), ("stats", _Stats)]


class _OpenOptions(ctypes.Structure):
    _fields_ = [("ort_library", ctypes.c_char_p), ("intra_op_threads", ctypes.c_int), ("spin_duration_us", ctypes.c_int),
                ("attention", ctypes.c_char_p)]


class _Params(ctypes.Structure):
    _fields_ = [("method", ctypes.c_char_p), ("gamma", ctypes.c_int), ("temperature", ctypes.c_double),
                ("top_k", ctypes.c_int), ("top_p", ctypes.c_double), ("min_p", ctypes.c_double),
                ("seed", ctypes.c_uint64), ("max_new_tokens", ctypes.c_int),
                ("stop_token_ids", ctypes.POINTER(ctypes.c_int64)), ("num_stop_token_ids", ctypes.c_size_t)]


CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p)


def load_library(path: str | Path) -> ctypes.CDLL:
    """Open libspecrt.so (or a test build of it) and declare its C ABI."""
    lib = ctypes.CDLL(str(path))
    lib.specrt_last_error.restype = ctypes.c_char_p
    lib.specrt_version.restype = ctypes.c_char_p
    lib.specrt_engine_default_method.restype = ctypes.c_char_p
    lib.specrt_engine_ort_version.restype = ctypes.c_char_p
    lib.specrt_engine_attention.restype = ctypes.c_char_p
    lib.specrt_engine_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(_OpenOptions), ctypes.POINTER(ctypes.c_void_p)]
    lib.specrt_engine_close.argtypes = [ctypes.c_void_p]
    for name in ("max_len", "vocab_size", "gamma", "default_method", "ort_version", "attention"):
        getattr(lib, f"specrt_engine_{name}").argtypes = [ctypes.c_void_p]
    lib.specrt_open_options_init.argtypes = [ctypes.POINTER(_OpenOptions)]
    lib.specrt_generate_params_init.argtypes = [ctypes.POINTER(_Params)]
    lib.specrt_generate.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t,
                                    ctypes.POINTER(_Params), CALLBACK, ctypes.c_void_p,
                                    ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.POINTER(_Result)]
    return lib


@dataclass
class CppOutput:
    token_ids: list  # generated ids, prompt excluded
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: dict = field(default_factory=dict)  # specrt_stats' fields


class CppEngine:
    """An engine dir opened by libspecrt. ``library``: a loaded ``load_library`` CDLL."""

    def __init__(self, library: ctypes.CDLL, engine_dir: str | Path, threads: int = 0, ort_library: str | None = None,
                 attention: str | None = None):
        self.lib = library
        options = _OpenOptions()
        library.specrt_open_options_init(ctypes.byref(options))
        options.intra_op_threads = threads
        options.ort_library = ort_library.encode() if ort_library else None
        options.attention = attention.encode() if attention else None  # None: $SPECRT_ATTENTION, else auto
        self.handle = ctypes.c_void_p()
        self._check(library.specrt_engine_open(str(engine_dir).encode(), ctypes.byref(options), ctypes.byref(self.handle)))
        self.max_len = library.specrt_engine_max_len(self.handle)
        self.vocab_size = library.specrt_engine_vocab_size(self.handle)
        self.default_method = library.specrt_engine_default_method(self.handle).decode()
        self.attention = library.specrt_engine_attention(self.handle).decode()  # "specrt" | "ort": the target's

    def _check(self, status: int) -> None:
        if status:
            raise CppError(STATUS.get(status, "runtime"), self.lib.specrt_last_error().decode())

    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = 0, method: str | None = None,
                 gamma: int | None = None, stop_token_ids=(), on_token=None) -> CppOutput:
        """Token ids in, ``CppOutput`` out; ``on_token(id) -> bool`` (False stops) per generated token."""
        p = _Params()
        self.lib.specrt_generate_params_init(ctypes.byref(p))
        p.method = method.encode() if method else None
        p.gamma = -1 if gamma is None else gamma
        p.temperature, p.top_k, p.top_p, p.min_p = temperature, top_k, top_p, min_p
        p.seed, p.max_new_tokens = seed or 0, max_new_tokens
        stops = (ctypes.c_int64 * max(1, len(stop_token_ids)))(*stop_token_ids)
        p.stop_token_ids, p.num_stop_token_ids = stops, len(stop_token_ids)
        ids = (ctypes.c_int64 * max(1, len(prompt)))(*prompt)
        out = (ctypes.c_int64 * max(1, max_new_tokens))()
        result = _Result()
        callback = CALLBACK(lambda tok, _: 0 if on_token(int(tok)) else 1) if on_token else CALLBACK()
        self._check(self.lib.specrt_generate(self.handle, ids, len(prompt), ctypes.byref(p), callback, None, out,
                                             max(1, max_new_tokens), ctypes.byref(result)))
        stats = {name: getattr(result.stats, name) for name, _ in _Stats._fields_}
        return CppOutput(list(out[: result.num_tokens]), FINISH[result.finish_reason], stats)

    def close(self) -> None:
        if self.handle:
            self.lib.specrt_engine_close(self.handle)
            self.handle = ctypes.c_void_p()

    def __del__(self):
        self.close()


def build(build_dir: str | Path = DEFAULT_BUILD, sanitize: bool = False, jobs: int = 2, log=print) -> Path:
    """Configure and build runtime/cpp into ``build_dir`` (CMake; dependencies fetched on first configure).
    Returns the build dir; raises RuntimeError with CMake's output tail on failure."""
    build_dir = Path(build_dir)
    steps = [["cmake", "-S", str(SOURCE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=" + ("Debug" if sanitize else "Release"),
              f"-DSPECRT_SANITIZE={'ON' if sanitize else 'OFF'}", f"-DPython3_EXECUTABLE={sys.executable}"],
             ["cmake", "--build", str(build_dir), "-j", str(jobs)]]
    for cmd in steps:
        log(" ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{(res.stdout + res.stderr)[-4000:]}")
    return build_dir


def library_path(build_dir: str | Path = DEFAULT_BUILD, name: str = "specrt") -> Path:
    return Path(build_dir) / f"lib{name}.so"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specrt.tools.libspecrt", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="configure and build runtime/cpp with CMake")
    b.add_argument("--build-dir", default=str(os.environ.get("SPECRT_CPP_BUILD", DEFAULT_BUILD)))
    b.add_argument("--sanitize", action="store_true", help="AddressSanitizer + UndefinedBehaviorSanitizer")
    args = ap.parse_args(argv)
    try:
        print(build(args.build_dir, args.sanitize))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
