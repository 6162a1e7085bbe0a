"""specrt's int4 matmul (custom_ops/matmul_nbits.cpp, ai.specrt::MatMulNBits) against ONNX Runtime's MatMulNBits
at accuracy level 4 on the same weights and inputs, the property the runtime relies on (a row's output does not
depend on the call's other rows, bit for bit), and which nodes it takes over; the same for what it folds in: the
SwiGLU activation after it (``fuse_swiglu``) against ONNX Runtime's Split, Sigmoid and Muls, the RMS norm before it
(``fuse_norms``) against ONNX Runtime's (Skip)SimplifiedLayerNormalization. Each test runs once per ISA variant this
CPU runs (SPECRT_ISA=ref, avx2, avx512), and every variant gives the portable reference's bits."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from specrt.custom_ops import (KernelError, fuse_norms, fuse_swiglu, int8_code, matmul_code, matmul_isa,
                               use_specrt_matmul, vnni_code)
from specrt.engines import EngineError
from specrt.engines.ort import resolve_matmul
from test_attention_kernel import library as built_library  # the kernels' library, or a skip saying what is missing


def kernel_library(kernel: str) -> str:
    """The kernels' library, or a skip naming what specrt's ``kernel`` ("int4", "int8") matmul needs."""
    if kernel == "int4" and not matmul_code():
        pytest.skip("specrt's int4 matmul needs x86-64 with AVX2 and FMA (custom_ops.matmul_isa)")
    if kernel == "int8" and not vnni_code():
        pytest.skip("specrt's int8 matmul needs AVX-512 VNNI (custom_ops.vnni_code)")
    return built_library("native")


ISAS = ["ref", "avx2", "avx512"]  # the int4 matmul's variants (matmul_nbits.h)


def use_isa(monkeypatch, isa: str) -> None:
    """Sessions opened from now on run the int4 matmul's ``isa`` variant (or a skip: this CPU lacks it)."""
    monkeypatch.setenv("SPECRT_ISA", isa)
    if matmul_isa() != isa:
        pytest.skip(f"this CPU does not run the int4 matmul's {isa} variant (it runs {matmul_isa()})")


@pytest.fixture(params=ISAS)
def library(request, monkeypatch):
    """The kernels' library, sessions opened with SPECRT_ISA = each variant in turn (read when a session opens)."""
    lib = built_library("native")
    use_isa(monkeypatch, request.param)
    return lib


def matmul_model(k: int, n: int, domain: str = "com.microsoft", seed: int = 0, weights_as_input: bool = False,
                 **attrs):
    """One MatMulNBits node Y = A @ dequant(B) over A [batch, rows, K], random 4-bit weights and scales."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    s = (rng.random(n * k // 32, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": 32, "accuracy_level": 4, **attrs}
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain=domain, **attrs)
    inputs = [helper.make_tensor_value_info("A", TP.FLOAT, ["batch", "rows", k])]
    initializers = [numpy_helper.from_array(s, "S")]
    if weights_as_input:
        inputs.append(helper.make_tensor_value_info("B", TP.UINT8, list(b.shape)))
    else:
        initializers.append(numpy_helper.from_array(b, "B"))
    graph = helper.make_graph([node], "matmul", inputs, [helper.make_tensor_value_info("Y", TP.FLOAT, None)],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    model.ir_version = 10
    return model


def session(model, library=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    if library is not None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("k,n", [(64, 16), (96, 48), (576, 192)])
def test_it_computes_what_onnx_runtime_computes(library, k, n):
    ours = session(matmul_model(k, n, "ai.specrt"), library)
    ort_ = session(matmul_model(k, n))
    rng = np.random.default_rng(1)
    for batch, rows in [(1, 1), (1, 5), (2, 8), (1, 9), (3, 21)]:
        a = rng.standard_normal((batch, rows, k)).astype(np.float32)
        a[0, 0, :32] = 0.0  # a block of zeros: scale 0, no division by it
        y, want = ours.run(None, {"A": a})[0], ort_.run(None, {"A": a})[0]
        assert y.shape == (batch, rows, n)
        np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_a_row_does_not_depend_on_the_calls_other_rows(library):
    """A decode step (1 row) equals the same row of a verify pass (up to 8 rows a register tile, more across
    tiles) bit for bit."""
    ours = session(matmul_model(96, 64, "ai.specrt"), library)
    a = np.random.default_rng(2).standard_normal((1, 19, 96)).astype(np.float32)
    whole = ours.run(None, {"A": a})[0]
    for lo, hi in [(0, 1), (3, 4), (18, 19), (2, 7), (10, 16), (5, 16)]:
        assert np.array_equal(ours.run(None, {"A": a[:, lo:hi]})[0], whole[:, lo:hi]), (lo, hi)


@pytest.mark.parametrize("swiglu", [False, True], ids=["matmul", "swiglu"])
def test_amx_tiles_give_the_register_tiles_bits(monkeypatch, swiglu):
    """Where the CPU has AMX, a call's rows in tiles of 16 (the last one of at least 9) take AMX's int8 tiles: the
    same int32 sums of each block and the same float steps as the VNNI register tiles, so the same bits, and a row's
    bits still do not depend on the call's other rows (a decode step, 1 row, always takes the register tiles)."""
    if not int8_code():
        pytest.skip("the int4 matmul's AMX path needs AMX's int8 tiles (custom_ops.int8_code)")
    library = built_library("native")
    use_isa(monkeypatch, "avx512")
    k, n = 576, 192
    model = fused(swiglu_model(k, n))[0] if swiglu else matmul_model(k, n, "ai.specrt")
    amx = session(model, library)
    monkeypatch.setenv("SPECRT_NO_AMX", "1")  # read when the session packs the weights
    vnni = session(model, library)
    a = np.random.default_rng(6).standard_normal((1, 41, k)).astype(np.float32) * 4
    a[0, 20, :32] = 0.0  # a block of zeros: scale 0
    for rows in (9, 12, 16, 17, 24, 25, 41):  # one partial tile; 16 + 1 (a register tile); 16 + 9 (two tiles); ...
        got = amx.run(None, {"A": a[:, :rows]})[0]
        assert np.array_equal(got, vnni.run(None, {"A": a[:, :rows]})[0]), rows
        for r in (0, rows - 1):
            assert np.array_equal(amx.run(None, {"A": a[:, r:r + 1]})[0][0, 0], got[0, r]), (rows, r)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_every_variant_gives_the_references_bits(monkeypatch, isa):
    """The variants compute the same int32 sums and the same float steps in the same order as the portable reference
    (matmul_nbits_ref.cpp), the folded norm and SwiGLU included: the same bits, for every row count a variant tiles
    differently (1-2 rows, 3-4, 5-8, 9+ through AMX where the CPU has it)."""
    lib = built_library("native")
    k, n = 576, 192
    models = {"matmul": matmul_model(k, n, "ai.specrt"), "swiglu": fused(swiglu_model(k, n))[0],
              "norm": folded_norm(norm_model(k, n))[0]}
    use_isa(monkeypatch, "ref")
    reference = {name: session(model, lib) for name, model in models.items()}
    use_isa(monkeypatch, isa)
    rng = np.random.default_rng(7)
    for name, model in models.items():
        ours = session(model, lib)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 25):
            feed = {i.name: rng.standard_normal((1, rows, k)).astype(np.float32) * 3 for i in model.graph.input}
            feed[next(iter(feed))][0, 0, :32] = 0.0  # a block of zeros: scale 0
            got, want = ours.run(None, feed), reference[name].run(None, feed)
            for g, w in zip(got, want):
                assert np.array_equal(g, w), (name, rows)


def test_an_unknown_isa_is_a_clear_error(monkeypatch):
    lib = built_library("native")
    monkeypatch.setenv("SPECRT_ISA", "sse9")
    with pytest.raises(KernelError, match="SPECRT_ISA must be one of auto, ref, avx2, avx512, got 'sse9'"):
        matmul_isa()
    with pytest.raises(Exception, match="SPECRT_ISA must be one of auto, ref, avx2, avx512"):
        session(matmul_model(64, 32, "ai.specrt"), lib)


def test_the_kernels_build_for_arm64(monkeypatch, tmp_path):
    """On ARM64 the library holds the attention kernel's portable code and the int4 matmul's reference (the x86 variants
    compile to nothing there): built here with a cross compiler (Debian's g++-aarch64-linux-gnu; .ci/run installs it)."""
    from specrt.custom_ops import FLAGS, KERNEL_HEADERS, KERNEL_SOURCES, build_library, ort_include, variant_flags

    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("the ARM64 build check needs aarch64-linux-gnu-g++ (Debian's g++-aarch64-linux-gnu)")
    monkeypatch.setenv("CXX", "aarch64-linux-gnu-g++")
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path))
    library = build_library("the kernels for ARM64", "libspecrt_kernels.so", KERNEL_SOURCES,
                            (*FLAGS, f"-I{ort_include()}"), headers=KERNEL_HEADERS, source_flags=variant_flags("aarch64"))
    assert library.read_bytes()[:4] == b"\x7fELF" and library.read_bytes()[18] == 183  # e_machine: EM_AARCH64


def test_only_the_nodes_it_computes_are_renamed():
    def renamed(**kw) -> int:
        return use_specrt_matmul(matmul_model(64, 32, **kw))

    assert renamed() == 1
    assert renamed(block_size=64) == 0 and renamed(accuracy_level=1) == 0 and renamed(bits=8) == 0
    assert renamed(weights_as_input=True) == 0  # its weights must be in the graph (packed when the session opens)
    assert use_specrt_matmul(matmul_model(64, 24)) == 0  # N not a multiple of 16
    model = matmul_model(64, 32)
    model.graph.node[0].input.append("zero_points")
    assert use_specrt_matmul(model) == 0


def test_who_computes_the_int4_matmuls(monkeypatch):
    monkeypatch.delenv("SPECRT_MATMUL", raising=False)
    assert resolve_matmul("ort", True) == "ort" and resolve_matmul("auto", False) == "ort"  # a GPU provider: ORT's
    assert resolve_matmul(None, True) == ("specrt" if matmul_code() else "ort")
    monkeypatch.setenv("SPECRT_MATMUL", "ort")
    assert resolve_matmul(None, True) == "ort"
    with pytest.raises(EngineError, match="matmul must be one of auto, ort, specrt, got 'fast'"):
        resolve_matmul("fast", True)
    with pytest.raises(EngineError, match="needs the CPU execution provider on a CPU with AVX2"):
        resolve_matmul("specrt", False)


def swiglu_model(k: int, n: int, sizes=None, gate_out: bool = False):
    """``matmul_model``'s node, then a SwiGLU MLP's activation as specrt's export writes it: Split(Y, sizes) ->
    (gate, up); act = gate * Sigmoid(gate) * up, [batch, rows, n / 2]. ``gate_out``: gate is a graph output too."""
    model = matmul_model(k, n)
    g = model.graph
    g.initializer.append(numpy_helper.from_array(np.array(sizes or [n // 2, n // 2], np.int64), "halves"))
    g.node.extend([helper.make_node("Split", ["Y", "halves"], ["gate", "up"], axis=-1),
                   helper.make_node("Sigmoid", ["gate"], ["sig"]),
                   helper.make_node("Mul", ["gate", "sig"], ["silu"]),
                   helper.make_node("Mul", ["silu", "up"], ["act"])])
    del g.output[:]
    g.output.extend([helper.make_tensor_value_info(name, TP.FLOAT, None) for name in ["act"] + ["gate"] * gate_out])
    return model


def fused(model):
    use_specrt_matmul(model)
    return model, fuse_swiglu(model)


@pytest.mark.parametrize("k,n", [(64, 32), (576, 192)])
def test_the_folded_swiglu_computes_what_onnx_runtime_computes(library, k, n):
    model, count = fused(swiglu_model(k, n))
    assert count == 1 and [node.op_type for node in model.graph.node] == ["MatMulNBits"]
    assert [t.name for t in model.graph.initializer] == ["S", "B"]  # the split sizes: read by nothing now
    ours, ort_ = session(model, library), session(swiglu_model(k, n))
    rng = np.random.default_rng(3)
    for batch, rows in [(1, 1), (1, 5), (2, 8), (3, 21)]:
        a = rng.standard_normal((batch, rows, k)).astype(np.float32) * 4  # gates far from 0 both ways
        y, want = ours.run(None, {"A": a})[0], ort_.run(None, {"A": a})[0]
        assert y.shape == (batch, rows, n // 2)
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())
    whole = ours.run(None, {"A": a[:1]})[0]  # a row's bits do not depend on the call's other rows
    for lo, hi in [(0, 1), (7, 8), (2, 9), (13, 21)]:
        assert np.array_equal(ours.run(None, {"A": a[:1, lo:hi]})[0], whole[:, lo:hi]), (lo, hi)


def test_only_a_swiglu_nothing_else_reads_is_folded():
    assert fused(swiglu_model(64, 32))[1] == 1
    assert fused(swiglu_model(64, 32, gate_out=True))[1] == 0  # its gate is a graph output
    assert fused(swiglu_model(64, 32, sizes=[8, 24]))[1] == 0  # not two halves
    assert fused(swiglu_model(64, 48))[1] == 0  # halves of 24 columns: not whole groups of 16
    model = swiglu_model(64, 32)
    model.graph.node[0].domain = "com.microsoft"
    assert fuse_swiglu(model) == 0  # the matmul stays ONNX Runtime's (use_specrt_matmul did not take it)


def norm_model(k: int, n: int, skip: bool = True, norm_out: bool = False, **norm_attrs):
    """An RMS norm as specrt's export writes it, then ``matmul_model``'s node on its output: with ``skip``,
    SkipSimplifiedLayerNormalization(X, R, gamma) -> (N, sum); else SimplifiedLayerNormalization(X, gamma).
    ``norm_out``: N is a graph output too."""
    model = matmul_model(k, n)
    g = model.graph
    g.node[0].input[0] = "N"
    gamma = (np.random.default_rng(4).random(k, dtype=np.float32) + 0.5).astype(np.float32)
    g.initializer.append(numpy_helper.from_array(gamma, "gamma"))
    attrs = {"epsilon": 1e-5, **norm_attrs}
    if skip:
        norm = helper.make_node("SkipSimplifiedLayerNormalization", ["X", "R", "gamma"], ["N", "", "", "sum"],
                                domain="com.microsoft", **attrs)
    else:
        norm = helper.make_node("SimplifiedLayerNormalization", ["X", "gamma"], ["N"], axis=-1, **attrs)
    g.node.insert(0, norm)
    del g.input[:]
    g.input.extend([helper.make_tensor_value_info(name, TP.FLOAT, ["batch", "rows", k]) for name in ["X", "R"][:1 + skip]])
    g.output.extend([helper.make_tensor_value_info(name, TP.FLOAT, None) for name in ["sum"] * skip + ["N"] * norm_out])
    return model


def folded_norm(model):
    use_specrt_matmul(model)
    return model, fuse_norms(model)


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "no skip"])
def test_the_folded_norm_computes_what_onnx_runtime_computes(library, skip):
    k, n = 576, 192
    model, count = folded_norm(norm_model(k, n, skip))
    assert count == 1 and [node.op_type for node in model.graph.node] == ["MatMulNBits"]
    ours, ort_ = session(model, library), session(norm_model(k, n, skip))
    rng = np.random.default_rng(5)
    for batch, rows in [(1, 1), (1, 5), (2, 8), (3, 21)]:
        feed = {"X": rng.standard_normal((batch, rows, k)).astype(np.float32) * 3}
        if skip:
            feed["R"] = rng.standard_normal((batch, rows, k)).astype(np.float32)
        got, want = ours.run(None, feed), ort_.run(None, feed)
        assert got[0].shape == (batch, rows, n)
        # the norm's last bits differ from ONNX Runtime's; the int8 activations can turn that into a quantization step
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=2e-3 * np.abs(want[0]).max())
        if skip:
            assert np.array_equal(got[1], want[1])  # x + skip, the next layer's residual
    whole = ours.run(None, {name: x[:1] for name, x in feed.items()})[0]  # a row's bits: its own
    for lo, hi in [(0, 1), (7, 8), (2, 9), (13, 21)]:
        part = ours.run(None, {name: x[:1, lo:hi] for name, x in feed.items()})[0]
        assert np.array_equal(part, whole[:, lo:hi]), (lo, hi)


def test_only_a_norm_nothing_else_reads_is_folded():
    assert folded_norm(norm_model(64, 32))[1] == 1 and folded_norm(norm_model(64, 32, skip=False))[1] == 1
    assert folded_norm(norm_model(64, 32, norm_out=True))[1] == 0  # its output is a graph output
    model = norm_model(64, 32)
    model.graph.node[0].input.append("gamma")  # a beta: not an RMS norm
    assert folded_norm(model)[1] == 0
    model = norm_model(64, 32)
    del model.graph.node[0].attribute[:]  # no explicit epsilon (ONNX Runtime's default differs between the two ops)
    assert folded_norm(model)[1] == 0
    model = norm_model(64, 32)
    assert fuse_norms(model) == 0  # the matmul stays ONNX Runtime's (use_specrt_matmul did not take it)
