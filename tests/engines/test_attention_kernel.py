"""specrt's attention kernel (custom_ops/attention.cpp, ai.specrt::GroupQueryAttention) against ONNX Runtime's
GroupQueryAttention on the same inputs, and the property the runtime relies on: a query row's output does not
depend on the call's other rows (a decode step equals the same token's row of a verify pass, bit for bit).
Three builds are checked: -march=native (AVX-512 here where the CPU has it), x86-64-v3 (the AVX2 code) and
x86-64-v2 (the portable code)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from specrt.custom_ops import KernelBuildError, KernelError, attention_library, use_specrt_attention, vector_code


def library(arch: str):
    try:
        return attention_library(arch)
    except KernelBuildError:
        raise  # the compiler is there and our source does not compile: a failure, not a skip
    except KernelError as e:
        pytest.skip(str(e).splitlines()[0])


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64-v2"])
def arch(request):
    if request.param != "native":
        import platform
        if platform.machine() != "x86_64":
            pytest.skip(f"{request.param} is an x86-64 target")
    return request.param


def gqa_session(domain: str, heads: int, kv_heads: int, head_dim: int, capacity: int, arch: str = "native",
                attrs: dict | None = None, packed: bool = False):
    """One attention node in a session (``packed``: with the kernel's 12th input, ``token_slots``)."""
    import onnxruntime as ort

    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "seqlens_k", "total", "cos", "sin",
                                                    "pos", "bias"] + ["token_slots"] * packed, ["out", "prk", "prv"],
                            domain=domain,
                            num_heads=heads, kv_num_heads=kv_heads, scale=head_dim ** -0.5, do_rotary=1,
                            rotary_interleaved=0, local_window_size=-1, **(attrs or {}))
    f, w = TP.FLOAT, (heads + 2 * kv_heads) * head_dim
    cache = ["B", kv_heads, capacity, head_dim]
    inputs = [helper.make_tensor_value_info("qkv", f, ["B", "S", w]), helper.make_tensor_value_info("pk", f, cache),
              helper.make_tensor_value_info("pv", f, cache), helper.make_tensor_value_info("seqlens_k", TP.INT32, ["B"]),
              helper.make_tensor_value_info("total", TP.INT32, []),
              helper.make_tensor_value_info("cos", f, [capacity, head_dim // 2]),
              helper.make_tensor_value_info("sin", f, [capacity, head_dim // 2]),
              helper.make_tensor_value_info("pos", TP.INT64, ["B", "S"]),
              helper.make_tensor_value_info("bias", f, ["BB", 1, "S", "T"])] + \
        [helper.make_tensor_value_info("token_slots", TP.INT64, ["S"])] * packed
    outputs = [helper.make_tensor_value_info("out", f, ["B", "S", heads * head_dim]),
               helper.make_tensor_value_info("prk", f, cache), helper.make_tensor_value_info("prv", f, cache)]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    if domain != "com.microsoft":
        opts.register_custom_ops_library(str(library(arch)))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run(session, qkv, k, v, lengths, cos, sin, positions, bias, token_slots=None):
    """One call with the cache bound in place (past = present, as the runtime binds it); returns
    (output, the cache after it). ``lengths``: per cache row its entries once the call's are in."""
    k, v = k.copy(), v.copy()
    b = session.io_binding()
    feeds = dict(qkv=qkv, seqlens_k=np.asarray(lengths, np.int32) - 1, total=np.array(max(lengths), np.int32),
                 cos=cos, sin=sin, pos=positions, bias=bias)
    if token_slots is not None:
        feeds["token_slots"] = np.asarray(token_slots, np.int64)
    for name, a in feeds.items():
        b.bind_cpu_input(name, np.ascontiguousarray(a))
    for names, buf in ((("pk", "prk"), k), (("pv", "prv"), v)):
        b.bind_input(names[0], "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
        b.bind_output(names[1], "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
    out = np.empty((qkv.shape[0], qkv.shape[1], session.get_outputs()[0].shape[2]), np.float32)
    b.bind_output("out", "cpu", 0, np.float32, out.shape, out.ctypes.data)
    session.run_with_iobinding(b)
    return out, k, v


def inputs(rng, batch, seq, past, heads, kv_heads, head_dim, capacity, masked=False):
    w = (heads + 2 * kv_heads) * head_dim
    qkv = rng.standard_normal((batch, seq, w)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(np.float32)
    angles = np.arange(capacity)[:, None] / 10000 ** (np.arange(head_dim // 2) / (head_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    lengths = [past + seq] * batch
    positions = np.tile(np.arange(past, past + seq), (batch, 1)).astype(np.int64)
    bias = np.zeros((batch, 1, seq, past + seq), np.float32)
    if masked:  # a tree-like mask: some earlier entries hidden from some rows
        bias[rng.random(bias.shape) < 0.2] = -3.0e38
        bias[..., :1] = 0  # every row sees entry 0
    return qkv, k, v, lengths, cos, sin, positions, bias


SHAPES = [  # (batch, seq, past, heads, kv_heads, head_dim)
    (1, 1, 0, 9, 3, 64), (1, 1, 200, 9, 3, 64), (1, 2, 37, 9, 3, 64), (1, 9, 100, 9, 3, 64),
    (3, 1, 50, 4, 2, 16), (1, 5, 17, 4, 4, 128), (2, 1, 40, 8, 1, 256), (1, 3, 30, 6, 2, 48),
]


@pytest.mark.parametrize("batch,seq,past,heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_computes_what_onnx_runtime_computes(arch, batch, seq, past, heads, kv_heads, head_dim, masked):
    capacity = past + seq + 5
    rng = np.random.default_rng(past * 31 + seq)
    args = inputs(rng, batch, seq, past, heads, kv_heads, head_dim, capacity, masked)
    ref = run(gqa_session("com.microsoft", heads, kv_heads, head_dim, capacity), *args)
    got = run(gqa_session("ai.specrt", heads, kv_heads, head_dim, capacity, arch), *args)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=2e-5)  # the attention output
    for g, r in zip(got[1:], ref[1:]):  # the cache: the new entries written (K rotated), the rest untouched
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 64, 256])
def test_a_row_does_not_depend_on_the_other_rows_of_its_call(arch, head_dim):
    """The same 6 tokens as 6 one-token decode steps and as one verify pass (with a tree-like mask row
    too): every output row and cache entry equal bit for bit."""
    heads, kv_heads, past, seq, capacity = 6, 2, 45, 6, 64
    session = gqa_session("ai.specrt", heads, kv_heads, head_dim, capacity, arch)
    rng = np.random.default_rng(head_dim)
    qkv, k, v, _, cos, sin, _, _ = inputs(rng, 1, seq, past, heads, kv_heads, head_dim, capacity)
    bias = np.zeros((1, 1, seq, past + seq), np.float32)
    bias[0, 0, 4, past + 1] = -3.0e38  # row 4 does not see token 1 (a tree branch)
    verify = run(session, qkv, k, v, [past + seq], cos, sin, np.arange(past, past + seq)[None], bias)
    for s in range(seq):
        step = run(session, qkv[:, s:s + 1], k, v, [past + s + 1], cos, sin, np.array([[past + s]]),
                   bias[:, :, s:s + 1, :past + s + 1])
        k, v = step[1], step[2]
        assert np.array_equal(step[0][0, 0], verify[0][0, s]), f"row {s}"
    assert np.array_equal(k, verify[1]) and np.array_equal(v, verify[2])


def test_a_packed_call_computes_each_row_as_a_call_of_its_own(arch):
    """token_slots: tokens of three cache rows (3, 1 and 2 of them, one row left out, in any row order) in one
    call of qkv [1, 6] over the whole cache: each row's outputs and cache entries equal a call of that row alone,
    bit for bit, and the row left out is untouched."""
    heads, kv_heads, head_dim, capacity = 6, 2, 64, 64
    packed = gqa_session("ai.specrt", heads, kv_heads, head_dim, capacity, arch, packed=True)
    alone = gqa_session("ai.specrt", heads, kv_heads, head_dim, capacity, arch)
    rng = np.random.default_rng(7)
    qkv, k, v, _, cos, sin, _, _ = inputs(rng, 4, 6, 0, heads, kv_heads, head_dim, capacity)
    past, counts, order = [20, 33, 7, 11], {0: 3, 2: 1, 1: 2}, [0, 2, 1]  # row 3: not in the call
    slots = np.repeat(order, [counts[r] for r in order])
    tokens = qkv[0, :6][None]  # [1, 6]
    positions = np.concatenate([np.arange(past[r], past[r] + counts[r]) for r in order])[None]
    lengths = [past[r] + counts.get(r, 0) for r in range(4)]
    out, pk, pv = run(packed, tokens, k, v, lengths, cos, sin, positions, np.zeros((1, 1, 6, max(lengths)), np.float32),
                      slots)
    start = 0
    for r in order:
        n = counts[r]
        ref = run(alone, tokens[:, start:start + n], k[r:r + 1], v[r:r + 1], [past[r] + n], cos, sin,
                  positions[:, start:start + n], np.zeros((1, 1, n, past[r] + n), np.float32))
        assert np.array_equal(out[:, start:start + n], ref[0]), r
        assert np.array_equal(pk[r], ref[1][0]) and np.array_equal(pv[r], ref[2][0]), r
        start += n
    assert np.array_equal(pk[3], k[3]) and np.array_equal(pv[3], v[3])


@pytest.mark.parametrize("slots,error", [([0, 1, 0], "consecutive"), ([0, 4, 4], "outside the cache"),
                                         ([0, 1], "one slot per token")])
def test_a_packed_call_with_bad_token_slots_is_refused(slots, error):
    session = gqa_session("ai.specrt", 4, 2, 16, 16, packed=True)
    rng = np.random.default_rng(0)
    qkv, k, v, _, cos, sin, _, _ = inputs(rng, 4, 3, 0, 4, 2, 16, 16)
    with pytest.raises(RuntimeError, match=error):
        run(session, qkv[:1], k, v, [5] * 4, cos, sin, np.array([[1, 2, 3]]), np.zeros((1, 1, 3, 5), np.float32),
            slots)


def test_a_graph_goes_to_the_kernel_only_when_it_computes_every_attention_node():
    def node(**attrs):
        base = dict(num_heads=4, kv_num_heads=2, scale=0.25, do_rotary=1, rotary_interleaved=0, local_window_size=-1)
        base.update(attrs)
        ins = ["qkv", "", "", "pk", "pv", "sl", "tot", "cos", "sin", "pos", "bias"]
        return helper.make_node("GroupQueryAttention", ins, ["o", "k", "v"], domain="com.microsoft", **base)

    kept = [node(do_rotary=0), node(local_window_size=8), node(softcap=30.0), node(rotary_interleaved=1),
            helper.make_node("GroupQueryAttention", ["q", "k1", "v1", "pk", "pv", "sl", "tot"], ["o", "k", "v"],
                             domain="com.microsoft", num_heads=4, kv_num_heads=2)]
    model = helper.make_model(helper.make_graph([node(), node(softcap=0.0)], "g", [], []))
    assert use_specrt_attention(model) == 2
    assert [n.domain for n in model.graph.node] == ["ai.specrt"] * 2
    assert any(o.domain == "ai.specrt" for o in model.opset_import)
    for other in kept:  # one node the kernel does not compute keeps the whole graph on ONNX Runtime's
        model = helper.make_model(helper.make_graph([node(), other], "g", [], []))
        assert use_specrt_attention(model) == 0
        assert {n.domain for n in model.graph.node} == {"com.microsoft"}


def test_a_machine_without_a_compiler_gets_a_clear_error(monkeypatch, tmp_path):
    from specrt.engines import EngineError, OrtEngine

    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path))
    with pytest.raises(KernelError, match="needs a C\\+\\+17 compiler"):
        attention_library()
    model = helper.make_model(helper.make_graph(
        [helper.make_node(
            "GroupQueryAttention", ["qkv", "", "", "pk", "pv", "sl", "tot", "cos", "sin", "pos"], ["o", "k", "v"],
            domain="com.microsoft", num_heads=2, kv_num_heads=2, do_rotary=1)], "g", [], []),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "g.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(EngineError, match="needs a C\\+\\+17 compiler"):
        OrtEngine(path, attention="specrt")
    with pytest.raises(EngineError, match="attention must be one of auto, ort, specrt"):
        OrtEngine(path, attention="fast")


def test_auto_attention_is_the_kernel_where_it_builds_else_ort_with_one_warning(monkeypatch, tmp_path,
                                                                                 llama_fused_engine):
    """The runtime's default, "auto": specrt's kernel on a CPU with AVX-512 or AVX2 where it builds; without a
    compiler, ONNX Runtime's attention and one warning per process naming what is missing, and the engine still
    runs; on a CPU with neither, ONNX Runtime's (the kernel's portable code is slower)."""
    import warnings

    import specrt
    import specrt.custom_ops as custom_ops
    from specrt.engines import ort as ort_engine

    monkeypatch.delenv("SPECRT_ATTENTION", raising=False)
    library("native")  # skips, saying why, where the kernel cannot be built here at all
    if not vector_code():
        pytest.skip("attention auto runs specrt's kernel on CPUs with AVX-512 or AVX2; this one has neither")
    ort_engine.kernel_pays.cache_clear()
    assert specrt.load(llama_fused_engine).target.engine.session.specrt_attention > 0
    assert specrt.load(llama_fused_engine, device="cpu", attention="ort").target.engine.session.specrt_attention == 0
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path))
    ort_engine.kernel_pays.cache_clear()
    try:
        with pytest.warns(UserWarning, match="needs a C\\+\\+17 compiler.*ONNX Runtime's attention"):
            rt = specrt.load(llama_fused_engine)
        assert rt.target.engine.session.specrt_attention == 0 and rt.target.engine.attention == "ort"
        assert len(rt.generate([1, 2, 3], max_new_tokens=4).token_ids) == 4
        monkeypatch.setattr(custom_ops, "cpu_flags", lambda: "flags\t: fpu sse4_2 avx")  # neither AVX-512 nor AVX2
        ort_engine.kernel_pays.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # ORT's attention, and nothing to warn about
            assert specrt.load(llama_fused_engine).target.engine.session.specrt_attention == 0
    finally:
        ort_engine.kernel_pays.cache_clear()
