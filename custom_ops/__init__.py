"""specrt's own native code, in shared libraries built from source on first use: CPU kernels for ONNX Runtime
(custom ops) and suffix decoding's index.

    attention_library()        libspecrt_kernels.so (built once per source and CPU, cached): the custom ops
                               ai.specrt::GroupQueryAttention (attention.cpp), ai.specrt::MatMulNBits
                               (matmul_nbits.cpp, int4 weights) and ai.specrt::MatMulInt8 (matmul_int8.cpp)
    suffix_library()           libspecrt_suffix.so: suffix decoding's index (suffix_index.cpp, which libspecrt
                               compiles too), for the Python runtime through custom_ops/suffix.py
    vector_code()              whether this CPU runs the kernel's vector code (AVX-512 or AVX2)
    use_specrt_attention(m)    renames, in an ``onnx.ModelProto``, the domain of the GroupQueryAttention nodes
                               that kernel computes; returns how many
    take_token_slots(m)        gives those nodes a new graph input, ``token_slots``: calls of rows without padding
    matmul_isa()               the int4 matmul's variant that runs here (avx512, avx2, ref) or "ort": $SPECRT_ISA
    matmul_code()              whether the int4 matmul takes the graphs' int4 matmuls here
    use_specrt_matmul(m)       the same for the MatMulNBits nodes the int4 matmul computes
    fuse_swiglu(m)             folds each SwiGLU activation (Split, Sigmoid, two Muls) into the int4 matmul before it
    fuse_norms(m)              folds each RMS norm ((Skip)SimplifiedLayerNormalization) into the int4 matmul after it
    int8_code()                whether the int8 matmul takes a graph's int8 matmuls here (AVX-512 VNNI and AMX)
    vnni_code()                whether this CPU has AVX-512 VNNI (the int8 matmul's kernels run)
    fuse_int8_matmuls(m)       makes each int8 matmul with per-row activations, and its row-scale Mul, one MatMulInt8
    fuse_row_quantize(m)       folds the ops quantizing a MatMulInt8's activations per row into it (DynamicMatMulInt8)

Engine dirs keep ONNX Runtime's standard op (com.microsoft::GroupQueryAttention): a session opened with
``OrtEngine(..., attention="specrt")`` loads the graph, renames those nodes in its own copy and registers the
library. Why: ONNX Runtime's CPU kernel reads every cached K/V entry once per query head (3x per KV head on
SmolLM2-135M) and packs it for a GEMM; this one streams each KV head's entries once for all its query rows:
~2.5x faster at 200 cached tokens, ~3x at 1000 (docs/runtime.md, "Attention kernel"). Every query row is
computed by the same loops whatever else the call holds, so a decode step equals the same token's row of a
verify pass bit for bit and the padded decode graph (export/decode_pad.py) is not needed.

Building needs a C++17 compiler (``$CXX`` or g++) and ONNX Runtime's C++ API headers, shipped here
(include/onnxruntime: ONNX Runtime 1.21's, MIT; ``$SPECRT_ORT_INCLUDE`` points elsewhere). The library lands in
``$SPECRT_CACHE/kernels/<key>/`` (default ~/.cache/specrt), keyed by the source, the compiler and this CPU's
flags (it is built with -march=native). The runtime's default attention, "auto" (engines/ort.py), is this
kernel wherever it builds.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("attention.cpp")
HERE = Path(__file__).parent
KERNEL_SOURCES = [SOURCE, HERE / "matmul_nbits.cpp", HERE / "matmul_int8.cpp", HERE / "matmul_nbits_ref.cpp",
                  HERE / "matmul_nbits_avx2.cpp", HERE / "matmul_nbits_avx512.cpp"]
KERNEL_HEADERS = [HERE / "kernels.h", HERE / "exp16.h", HERE / "matmul_nbits.h"]
# Flags of the files of one ISA variant each, after the library's own (a later -march wins), on x86-64: each is
# compiled for its ISA whatever this CPU is, and runs only where the CPU has it (matmul_nbits.cpp chooses at run time).
# The reference takes no contractions: its FMAs are spelled out, as the vector variants' are.
KERNEL_VARIANTS = {"matmul_nbits_ref.cpp": ("-ffp-contract=off",),
                   "matmul_nbits_avx2.cpp": ("-march=x86-64-v3", "-mtune=generic"),
                   "matmul_nbits_avx512.cpp": ("-march=x86-64-v4", "-mtune=generic", "-mavx512vnni", "-mamx-tile",
                                               "-mamx-int8")}
INCLUDE = Path(__file__).with_name("include") / "onnxruntime"  # ONNX Runtime's C/C++ API headers, vendored
DOMAIN = "ai.specrt"
LIBRARY = "libspecrt_kernels.so"
SUFFIX_SOURCES = [Path(__file__).with_name("suffix_index.cpp"), Path(__file__).with_name("suffix_capi.cpp")]
SUFFIX_HEADERS = [Path(__file__).with_name("suffix_index.h")]
SUFFIX_LIBRARY = "libspecrt_suffix.so"
SUFFIX_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
# -ffp-contract=fast: GCC's default here, spelled out because libspecrt compiles the same file (runtime/cpp) and the
# two builds must contract the same multiply-adds into FMAs to give the same bits
FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
# GroupQueryAttention attributes the kernel computes (absent = ONNX Runtime's default, the same values)
SUPPORTED_ATTRIBUTES = {"num_heads": None, "kv_num_heads": None, "scale": None, "do_rotary": (1,),
                        "rotary_interleaved": (0,), "local_window_size": (-1,), "softcap": (0.0,),
                        "smooth_softmax": (0,)}


class KernelError(RuntimeError):
    """specrt's kernels cannot be built or used here; the message says what is missing."""


class KernelBuildError(KernelError):
    """The compiler is there but specrt's source does not compile: a bug, where a missing tool is a skip (tests)."""


def ort_include() -> Path:
    """The directory holding onnxruntime_cxx_api.h: $SPECRT_ORT_INCLUDE, else the copy shipped beside the kernel
    (ONNX Runtime 1.21's API headers, include/onnxruntime/LICENSE)."""
    d = Path(os.environ.get("SPECRT_ORT_INCLUDE") or INCLUDE)
    if not (d / "onnxruntime_cxx_api.h").is_file():
        raise KernelError(f"specrt's attention kernel needs ONNX Runtime's C++ API headers: no onnxruntime_cxx_api.h "
                          f"in {d} (SPECRT_ORT_INCLUDE)")
    return d


# numpy's name of a CPU feature (its dispatcher's, detected from CPUID / the auxiliary vector) -> /proc/cpuinfo's
NUMPY_FEATURES = {"AVX2": "avx2", "FMA3": "fma", "AVX512F": "avx512f", "AVX512BW": "avx512bw",
                  "AVX512VNNI": "avx512_vnni", "ASIMD": "asimd", "ASIMDDP": "asimddp"}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> str:
    """The CPU features the kernels ask about, space-separated, named as /proc/cpuinfo's x86 ``flags`` names them:
    what this process's CPU reports (CPUID on x86, the auxiliary vector on ARM), as numpy's dispatcher detected it, so
    an emulated CPU (qemu-user, tests/emulated/) is seen as emulated and ARM or macOS are seen at all; AMX's tiles
    (which numpy does not detect) from /proc/cpuinfo, where the process sees AVX-512 too."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as features
    flags = [name for key, name in NUMPY_FEATURES.items() if features.get(key)]
    if "avx512f" in flags:
        try:
            line = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
        except OSError:
            line = ""
        flags += [f for f in ("amx_tile", "amx_int8") if f in line.split()]
    return " ".join(flags)


def vector_code() -> bool:
    """Whether this CPU runs the kernel's vector code (AVX-512, or AVX2 with FMA: attention.cpp) rather than its
    portable code, which is slower than ONNX Runtime's attention (docs/runtime.md)."""
    flags = set(cpu_flags().split())
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def attention_library(arch: str | None = None) -> Path:
    """libspecrt_kernels.so for this machine (-march=``arch``, default $SPECRT_KERNEL_MARCH, else native; the tests
    also build x86-64-v3, the AVX2 code, and x86-64-v2, the portable code; an emulated CPU needs its own, as the
    compiler runs on the host: tests/emulated/), built on first use (~1 s) and cached; KernelError if it cannot be."""
    arch = arch or os.environ.get("SPECRT_KERNEL_MARCH") or "native"
    include = ort_include()
    return build_library("specrt's attention kernel", LIBRARY, KERNEL_SOURCES, (*FLAGS, f"-march={arch}", f"-I{include}"),
                         (include / "onnxruntime_c_api.h").read_text(), headers=KERNEL_HEADERS,
                         source_flags=variant_flags(platform.machine()))


def variant_flags(machine: str) -> dict:
    """{source: its own flags} of the ISA variants' files for a CPU architecture (``platform.machine()``'s name):
    ``KERNEL_VARIANTS`` on x86-64; elsewhere the reference's only (the x86 files compile to nothing there)."""
    x86 = machine.lower() in ("x86_64", "amd64")
    return {HERE / name: flags for name, flags in KERNEL_VARIANTS.items() if x86 or name.endswith("_ref.cpp")}


def suffix_library() -> Path:
    """libspecrt_suffix.so: suffix decoding's index (suffix_index.cpp, the file libspecrt compiles too) behind a C
    ABI (suffix_capi.cpp), built on first use (~3 s) and cached; KernelError if it cannot be."""
    return build_library("suffix decoding's native index", SUFFIX_LIBRARY, SUFFIX_SOURCES, SUFFIX_FLAGS,
                         headers=SUFFIX_HEADERS)


def build_library(what: str, name: str, sources: list, flags: tuple, extra_key: str = "", headers: list = (),
                  source_flags: dict | None = None) -> Path:
    """The shared library ``name`` compiled from ``sources`` with ``flags`` (and ``source_flags[source]`` after them
    for that source) into ``$SPECRT_CACHE/kernels/<key>/``, unless there already (the key: sources and the
    ``headers`` they include, compiler version, flags, this CPU's flags, ``extra_key``); KernelError, naming
    ``what``, without a compiler or when compiling fails. The sources compile side by side, then link."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise KernelError(f"{what} needs a C++17 compiler ({os.environ.get('CXX', 'g++')} not found)")
    source_flags = source_flags or {}
    every_flag = (*flags, *(f"{Path(s).name}:{' '.join(f)}" for s, f in source_flags.items()))
    key = build_key(compiler, (*sources, *headers), every_flag, extra_key)
    out = Path(os.environ.get("SPECRT_CACHE", Path.home() / ".cache" / "specrt")) / "kernels" / key / name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # built aside, then renamed: never half a library
        objects = [Path(tmp) / f"{i}.o" for i in range(len(sources))]
        jobs = [subprocess.Popen([compiler, *flags, *source_flags.get(Path(s), ()), "-c", str(s), "-o", str(o)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for s, o in zip(sources, objects)]
        stderr = [job.communicate()[1] for job in jobs]
        errors = [err for job, err in zip(jobs, stderr) if job.returncode]
        built = Path(tmp) / name
        if not errors:
            r = subprocess.run([compiler, *flags, *map(str, objects), "-o", str(built)], capture_output=True, text=True)
            errors = [r.stderr] if r.returncode else []
        if errors:
            raise KernelBuildError(f"building {what} failed:\n{errors[0][-2000:]}")
        os.replace(built, out)
    return out


@functools.lru_cache(maxsize=None)
def build_key(compiler: str, files: tuple, flags: tuple, extra_key: str) -> str:
    """A library's cache key: its source and header ``files``, the compiler's version, the flags, this CPU's flags
    and ``extra_key``, hashed once per process (every session of every graph asks)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    texts = [Path(p).read_text() for p in files]
    return hashlib.sha256("\0".join([*texts, version, " ".join(flags), cpu_flags(), extra_key]).encode()).hexdigest()[:12]


def supported(node) -> bool:
    """Whether the kernel computes this GroupQueryAttention node: packed QKV (no separate key/value inputs),
    rotary inside from cos/sin caches and position_ids, and only the attributes it implements."""
    inputs = list(node.input) + [""] * (11 - len(node.input))
    if inputs[1] or inputs[2] or not all(inputs[i] for i in (0, 3, 4, 5, 6, 7, 8, 9)) or len(node.input) > 11:
        return False
    if len(node.output) != 3:
        return False
    from onnx import helper

    for a in node.attribute:
        allowed = SUPPORTED_ATTRIBUTES.get(a.name, ())
        if allowed is not None and helper.get_attribute_value(a) not in allowed:
            return False
    return True


def use_specrt_attention(model) -> int:
    """Rename the domain of ``model``'s GroupQueryAttention nodes to ai.specrt (in place) when the kernel computes
    every one of them (all or none: a graph's attention rows then all follow the kernel's rule); returns how
    many were renamed. Example: SmolLM2-135M's fused graph -> 30; a graph with a softcapped one -> 0."""
    from onnx import helper

    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not nodes or not all(supported(n) for n in nodes):
        return 0
    for node in nodes:
        node.domain = DOMAIN
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(nodes)


TOKEN_SLOTS = "token_slots"  # the graph input of packed calls (``take_token_slots``)


def take_token_slots(model) -> bool:
    """Give every ai.specrt GroupQueryAttention node of ``model`` (already renamed) the kernel's 12th input, a new
    graph input ``token_slots`` int64 [N]: the graph then runs packed calls. ``input_ids`` / ``position_ids`` [1, N]
    hold every row's tokens one run after the other, ``token_slots`` [N] the cache row of each token, the cache is
    bound whole (``seqlens_k``: one per cache row) and ``attention_mask`` is [1, 1, N, T]: rows of different lengths
    in one call, no padding. False (nothing changed) where no node is renamed or the nodes take a mask the graph
    derives (a sliding window), which a packed call's tokens could not follow.

        >>> take_token_slots(fused_model)  # SmolLM2-135M's fused graph, after use_specrt_attention  # doctest: +SKIP
        True
    """
    from onnx import TensorProto, helper

    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention" and n.domain == DOMAIN]
    if not nodes or any(len(n.input) != 11 or n.input[10] != "attention_mask" for n in nodes):
        return False
    for node in nodes:
        node.input.append(TOKEN_SLOTS)
    model.graph.input.append(helper.make_tensor_value_info(TOKEN_SLOTS, TensorProto.INT64, ["tokens"]))
    return True


MATMUL_ATTRIBUTES = {"bits": 4, "block_size": 32, "accuracy_level": 4}  # what the int4 matmul computes (and K, N)


ISA_NAMES = ("auto", "ref", "avx2", "avx512")  # $SPECRT_ISA's values (matmul_nbits.cpp chosen_variant)


def matmul_isa() -> str:
    """The int4 matmul's variant a session opened now runs, as the kernel library chooses it (matmul_nbits.cpp): the
    best this CPU runs, or $SPECRT_ISA capped at what it runs: "avx512" (AVX-512 VNNI), "avx2", "ref" (the portable
    reference, only where $SPECRT_ISA=ref asks for it); "ort" where the int4 matmuls stay ONNX Runtime's (no vector
    variant runs here, or the library cannot be built). KernelError for a $SPECRT_ISA it does not know.

        >>> matmul_isa()  # an AMD Zen 4; with SPECRT_ISA=avx2: "avx2"; an ARM machine: "ort"  # doctest: +SKIP
        'avx512'
    """
    try:
        isa = kernel_library_handle(attention_library()).specrt_matmul_nbits_isa().decode()
    except KernelError:  # no compiler, or the build failed (attention_library's callers say so)
        return "ort"
    if not isa:
        raise KernelError(f"SPECRT_ISA must be one of {', '.join(ISA_NAMES)}, got {os.environ.get('SPECRT_ISA')!r}")
    return isa


@functools.lru_cache(maxsize=None)
def kernel_library_handle(path: Path):
    """The kernel library loaded into this process (ctypes), to ask it which variants it runs."""
    import ctypes

    lib = ctypes.CDLL(str(path))
    lib.specrt_matmul_nbits_isa.restype = ctypes.c_char_p
    return lib


def matmul_code() -> bool:
    """Whether specrt's int4 matmul (matmul_nbits.cpp) takes the graphs' int4 matmuls here (``matmul_isa``)."""
    return matmul_isa() != "ort"


def supported_matmul(node, initializers: set) -> bool:
    """Whether the int4 matmul computes this MatMulNBits node: 4-bit symmetric weights in blocks of 32 (no zero
    points, no bias), int8 activations (accuracy level 4), K a multiple of 32 and N of 16, weights and scales
    stored in the graph."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if any(attrs.get(name) != value for name, value in MATMUL_ATTRIBUTES.items()):
        return False
    if attrs.get("K", 1) % 32 or attrs.get("N", 1) % 16 or len(node.input) != 3 or len(node.output) != 1:
        return False
    return node.input[1] in initializers and node.input[2] in initializers


def use_specrt_matmul(model) -> int:
    """Rename the domain of ``model``'s MatMulNBits nodes the int4 matmul computes to ai.specrt (in place; each
    node on its own: every row of either kernel is computed alike whatever the call's other rows); returns how
    many. Example: SmolLM2-135M's int4 fused graph -> 120 (its lm_head is int8: it stays)."""
    from onnx import helper

    initializers = {t.name for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"
             and supported_matmul(n, initializers)]
    for node in nodes:
        node.domain = DOMAIN
    if nodes and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(nodes)


def links(graph) -> tuple[dict, dict]:
    """(tensor -> the nodes reading it, tensor -> the node writing it) of ``graph``."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers, {out: node for node in graph.node for out in node.output if out}


def replace_nodes(graph, replaced: dict) -> None:
    """``graph``'s nodes in order, each node whose id is in ``replaced`` written as its value there (None: dropped)."""
    from onnx import NodeProto

    order = []
    for node in graph.node:
        new = replaced.get(id(node), node)
        if new is not None:  # copies: the nodes themselves go with the field's old contents
            order.append(NodeProto())
            order[-1].CopyFrom(new)
    del graph.node[:]
    graph.node.extend(order)


def fuse_swiglu(model) -> int:
    """Fold each SwiGLU activation after an int4 matmul the kernel computes (already renamed by
    ``use_specrt_matmul``) into that matmul (in place): MatMulNBits -> Split in two halves -> Sigmoid(gate) ->
    Mul(gate, sigmoid) -> Mul(silu, up) becomes one ai.specrt::MatMulNBits with ``swiglu=1`` whose output is the
    last Mul's. Returns how many. Example: SmolLM2-135M's int4 fused graph -> 30 (four ONNX Runtime ops a layer
    fewer). Only where nothing else reads the intermediate tensors."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}
    constants = {t.name: t for t in graph.initializer if t.data_location != TensorProto.EXTERNAL}  # small ones: inline

    def only(name, op_type):  # the single node reading ``name``, if it is an ``op_type`` and no graph output
        readers = consumers.get(name, [])
        if len(readers) != 1 or readers[0].op_type != op_type or readers[0].domain not in ("", "ai.onnx") \
                or name in graph_outputs:
            return None
        return readers[0]

    fused, removed = 0, []
    for mm in [n for n in graph.node if n.op_type == "MatMulNBits" and n.domain == DOMAIN]:
        attrs = {a.name: helper.get_attribute_value(a) for a in mm.attribute}
        n_out = attrs.get("N", 0)
        split = only(mm.output[0], "Split")
        if split is None or n_out % 32 or len(split.output) != 2:
            continue
        split_attrs = {a.name: helper.get_attribute_value(a) for a in split.attribute}
        if split_attrs.get("axis", 0) != -1 or "split" in split_attrs:
            continue
        if len(split.input) > 1 and split.input[1]:  # the sizes: an initializer [N/2, N/2]
            sizes = constants.get(split.input[1])
            if sizes is None or sizes.data_type != TensorProto.INT64 or \
                    list(numpy_helper.to_array(sizes)) != [n_out // 2] * 2:
                continue
        gate, up = split.output
        readers = consumers.get(gate, [])
        sigmoid = next((r for r in readers if r.op_type == "Sigmoid" and r.domain in ("", "ai.onnx")), None)
        silu = next((r for r in readers if r.op_type == "Mul" and r.domain in ("", "ai.onnx")), None)
        if len(readers) != 2 or sigmoid is None or silu is None or gate in graph_outputs \
                or sorted(silu.input) != sorted([gate, sigmoid.output[0]]) or only(sigmoid.output[0], "Mul") is not silu:
            continue
        act = only(silu.output[0], "Mul")
        if act is None or sorted(act.input) != sorted([silu.output[0], up]) or only(up, "Mul") is not act:
            continue
        mm.output[0] = act.output[0]
        mm.attribute.append(helper.make_attribute("swiglu", 1))
        removed += [split, sigmoid, silu, act]
        fused += 1
    for node in removed:
        graph.node.remove(node)
    gone = {id(node) for node in removed}  # split sizes only the removed nodes read (one tensor for every layer's)
    for tensor in [t for t in constants.values() if t.name in consumers
                   and all(id(node) in gone for node in consumers[t.name])]:
        graph.initializer.remove(tensor)
    return fused


NORMS = {"SimplifiedLayerNormalization": ("", "ai.onnx"), "SkipSimplifiedLayerNormalization": ("com.microsoft",)}


def fuse_norms(model) -> int:
    """Fold each RMS norm whose output only an int4 matmul the kernel computes reads (already renamed by
    ``use_specrt_matmul``) into that matmul (in place): SimplifiedLayerNormalization(x, gamma) or
    SkipSimplifiedLayerNormalization(x, skip, gamma) -> MatMulNBits becomes one ai.specrt::MatMulNBits with inputs
    (x, B, scales, gamma[, skip]), attribute ``norm_epsilon`` and outputs (Y[, x + skip]), where the norm stood.
    Returns how many. Example: SmolLM2-135M's int4 fused graph -> 60 (every layer's two norms; the final one feeds
    the int8 lm_head and stays). Only norms with an explicit epsilon, no beta or bias, no statistics read, over the
    last axis."""
    from onnx import helper

    graph = model.graph
    consumers, producer = links(graph)
    graph_outputs = {o.name for o in graph.output}
    fused, moved = 0, {}  # id(norm) -> its folded matmul, id(matmul) -> None (gone from its own place)
    for mm in [n for n in graph.node if n.op_type == "MatMulNBits" and n.domain == DOMAIN]:
        norm = producer.get(mm.input[0])
        if norm is None or NORMS.get(norm.op_type) is None or norm.domain not in NORMS[norm.op_type]:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
        skip = norm.op_type.startswith("Skip")
        inputs = list(norm.input) + [""] * 5
        outputs = list(norm.output) + [""] * 4
        if "epsilon" not in attrs or attrs.get("axis", -1) != -1 or any(inputs[3 if skip else 2:5]) \
                or any(outputs[1:3]) or norm.output[0] in graph_outputs or len(consumers[norm.output[0]]) != 1:
            continue
        x, gamma = inputs[0], inputs[2 if skip else 1]
        weights = list(mm.input[1:3])
        del mm.input[:]
        mm.input.extend([x, *weights, gamma] + ([inputs[1]] if skip else []))
        if skip and outputs[3]:
            mm.output.append(outputs[3])
        mm.attribute.append(helper.make_attribute("norm_epsilon", float(attrs["epsilon"])))
        moved[id(norm)], moved[id(mm)] = mm, None
        fused += 1
    if fused:  # each folded matmul where its norm stood: its inputs are ready there, its readers come after
        replace_nodes(graph, moved)
    return fused


def int8_code() -> bool:
    """Whether specrt's int8 matmul (matmul_int8.cpp) takes a graph's int8 matmuls here: AMX's int8 tiles beside AVX-512
    VNNI (its VNNI path alone is slower than ONNX Runtime's kernel past one row)."""
    return vnni_code() and {"amx_tile", "amx_int8"} <= set(cpu_flags().split())


def vnni_code() -> bool:
    """Whether this CPU has AVX-512 with VNNI, what the int8 matmul's kernels need (matmul_int8.cpp)."""
    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(cpu_flags().split())


def fuse_int8_matmuls(model) -> int:
    """Fold each int8 matmul whose activations are quantized per row, and the row-scale Mul after it, into specrt's
    int8 matmul (in place): QuantizeLinear(x, s, z) per row (block_size K) -> com.microsoft::MatMulIntegerToFloat(q, B,
    a_scale, b_scale, a_zero_point) -> Mul(y, s) becomes ai.specrt::MatMulInt8(q, B, a_scale, b_scale, a_zero_point, s)
    where the matmul stood, writing the Mul's output (custom_ops/matmul_int8.cpp: the same float operations, so the
    same bits). Returns how many. Example: SmolLM2-135M's int4 graph -> 1 (its lm_head); its w8a8 graph -> 121. Only
    with B int8 [K, N], N a multiple of 16, per-column fp32 b_scale, and the scales and zero point stored in the
    graph."""
    from onnx import NodeProto, helper

    graph = model.graph
    consumers, producer = links(graph)
    initializers, graph_outputs = {t.name: t for t in graph.initializer}, {o.name for o in graph.output}
    replaced = {}  # id(matmul) -> its MatMulInt8, id(mul) -> None
    for mm in [n for n in graph.node if n.op_type == "MatMulIntegerToFloat" and n.domain == "com.microsoft"]:
        found = int8_fold(mm, initializers, graph_outputs, producer, consumers)
        if found is None:
            continue
        scale, mul = found
        new = NodeProto()
        new.CopyFrom(mm)
        new.op_type, new.domain = "MatMulInt8", DOMAIN
        new.input.append(scale)
        new.output[0] = mul.output[0]
        replaced[id(mm)], replaced[id(mul)] = new, None
    if replaced:
        replace_nodes(graph, replaced)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(replaced) // 2


def int8_fold(mm, initializers: dict, graph_outputs: set, producer: dict, consumers: dict):
    """(s, the Mul) where ``fuse_int8_matmuls`` folds the MatMulIntegerToFloat node ``mm``, else None."""
    from onnx import TensorProto, helper

    inputs = list(mm.input)
    if len(inputs) != 5 or not all(inputs) or any(i not in initializers for i in inputs[1:]):
        return None
    b, a_scale, b_scale, zero = (initializers[i] for i in inputs[1:])
    if b.data_type != TensorProto.INT8 or len(b.dims) != 2 or b.dims[1] % 16 or list(b_scale.dims) != [b.dims[1]] \
            or {a_scale.data_type, b_scale.data_type} != {TensorProto.FLOAT} or zero.data_type != TensorProto.UINT8 \
            or any(d != 1 for d in [*a_scale.dims, *zero.dims]):
        return None
    quantize = producer.get(inputs[0])
    if quantize is None or quantize.op_type != "QuantizeLinear" or quantize.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in quantize.attribute}
    if attrs.get("axis", 1) != -1 or attrs.get("block_size") != b.dims[0]:  # one scale a row
        return None
    scale, readers = quantize.input[1], consumers.get(mm.output[0], [])
    if len(readers) != 1 or mm.output[0] in graph_outputs:
        return None
    mul = readers[0]
    if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or sorted(mul.input) != sorted([mm.output[0], scale]):
        return None
    return scale, mul


def fuse_row_quantize(model) -> int:
    """Fold the ops that quantize each MatMulInt8's activations per row into it (in place):

        s = Mul(Max(ReduceMax(Abs(x), last axis), tiny), inv127), QuantizeLinear(x, s, z) = q
        -> ai.specrt::MatMulInt8(q, B, a_scale, b_scale, z, s)
        becomes ai.specrt::DynamicMatMulInt8(x, B, a_scale, b_scale, z, tiny, inv127)

    (custom_ops/matmul_int8.cpp: the same operations, so the same bits). Five ONNX Runtime ops and their tensors gone a
    matmul: what a prefill graph (export/prefill_graph.py) runs around each of its int8 matmuls. Returns how many.
    Only where q feeds nothing else, tiny and inv127 are fp32 scalars stored in the graph and both zero points are
    stored there and equal; where s (or a step to it) is read elsewhere too (the Shape of a shared zero point), its
    four ops stay and QuantizeLinear alone goes."""
    from onnx import NodeProto, numpy_helper

    graph = model.graph
    consumers, producer = links(graph)
    scalars = {t.name: numpy_helper.to_array(t) for t in graph.initializer if len(t.dims) <= 1 and not t.external_data}
    replaced = {}
    for mm in [n for n in graph.node if n.op_type == "MatMulInt8" and n.domain == DOMAIN]:
        found = row_quantize_ops(mm, scalars, producer, consumers)
        if found is None:
            continue
        x, tiny, inv127, ops = found
        new = NodeProto()
        new.CopyFrom(mm)
        new.op_type = "DynamicMatMulInt8"
        new.input[0] = x
        del new.input[5:]
        new.input.extend([tiny, inv127])
        replaced[id(mm)] = new
        replaced.update({id(op): None for op in ops})
    if replaced:
        replace_nodes(graph, replaced)
    return sum(1 for v in replaced.values() if v is not None)


def row_quantize_ops(mm, scalars: dict, producer: dict, consumers: dict):
    """(x, tiny, inv127, the five nodes) that ``fuse_row_quantize`` folds into the MatMulInt8 node ``mm``, else None."""
    from onnx import helper

    def only(tensor: str, *readers) -> bool:  # ``tensor`` is read by exactly these nodes
        return sorted(map(id, consumers.get(tensor, []))) == sorted(map(id, readers))

    def op(tensor: str, op_type: str):
        node = producer.get(tensor)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    quantize = op(mm.input[0], "QuantizeLinear")
    if quantize is None or len(quantize.input) != 3 or quantize.input[1] != mm.input[5]:
        return None
    x, s, zero = quantize.input
    mul = op(s, "Mul")
    maximum = next((op(t, "Max") for t in mul.input if op(t, "Max")), None) if mul else None
    reduce = next((op(t, "ReduceMax") for t in maximum.input if op(t, "ReduceMax")), None) if maximum else None
    absolute = op(reduce.input[0], "Abs") if reduce else None
    if absolute is None or absolute.input[0] != x:
        return None
    inv127 = next((t for t in mul.input if t != maximum.output[0]), "")
    tiny = next((t for t in maximum.input if t != reduce.output[0]), "")
    attrs = {a.name: helper.get_attribute_value(a) for a in reduce.attribute}
    axes = list(attrs.get("axes", [])) or (list(scalars.get(reduce.input[1], [])) if len(reduce.input) > 1 else [])
    if axes != [-1] or attrs.get("keepdims", 1) != 1:
        return None
    if any(t not in scalars or scalars[t].size != 1 or scalars[t].dtype != "float32" for t in (inv127, tiny)):
        return None
    z = zero_point(zero, scalars, producer)
    if z is None or z != zero_point(mm.input[4], scalars, producer):
        return None
    if not only(quantize.output[0], mm):
        return None
    scale_ops = (absolute, reduce, maximum, mul)  # dropped too unless s (or a step to it) is read elsewhere
    alone = only(absolute.output[0], reduce) and only(reduce.output[0], maximum) and only(maximum.output[0], mul) \
        and only(s, quantize, mm)
    return x, tiny, inv127, (*scale_ops, quantize) if alone else (quantize,)


def zero_point(tensor: str, scalars: dict, producer: dict) -> int | None:
    """The uint8 value of a zero point stored in the graph: an initializer, or ConstantOfShape's value; else None."""
    import numpy as np
    from onnx import helper, numpy_helper

    if tensor in scalars and scalars[tensor].size == 1 and scalars[tensor].dtype == np.uint8:
        return int(scalars[tensor].reshape(-1)[0])
    node = producer.get(tensor)
    if node is not None and node.op_type == "ConstantOfShape":
        value = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "value"), None)
        array = numpy_helper.to_array(value) if value is not None else None
        if array is not None and array.size == 1 and array.dtype == np.uint8:
            return int(array.reshape(-1)[0])
    return None
