"""ONNX Runtime backend: CPU execution provider by default, any installed provider on request."""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import numpy as np

from .base import EngineError


# Idle ONNX Runtime pool threads spin at most this long, then sleep. ORT's own default spins ~16 ms
# here: idle workers then compete with the draft's thread and with every other process on the
# machine. docs/bench/threads.md: as fast as ORT's default idle, 1.8x for draft-model decoding, and
# 2-3x ORT's default on a busy machine.
DEFAULT_SPIN_US = 20


class OrtEngine:
    """One ONNX graph in an ``onnxruntime.InferenceSession``.

    providers: ORT execution providers in priority order (default: CPU); short names "cpu",
    "cuda", "tensorrt" are accepted. ``CUDAExecutionProvider`` / ``TensorrtExecutionProvider``
    need onnxruntime-gpu (and TensorRT for the latter). provider_options: {provider: {key: value}}.
    threads: intra-op threads (default: ORT's choice, one per physical core).
    device: "cpu" (the default) or "cuda" (= providers ["cuda"]), as for the torch backend.
    spinning: how idle intra-op pool threads wait for work: an integer N (default
    ``DEFAULT_SPIN_US``): spin at most N microseconds, then sleep (``session.intra_op.spin_duration_us``);
    True or None: ORT's own default (spin ~1M pause instructions, ~16 ms on this CPU); False: never
    spin; "run": spin during a run, stop when it returns.
    profile_prefix: turn on ORT's profiler, writing its trace to ``<prefix>_<date>.json``.
    attention: who computes the graph's GroupQueryAttention nodes, in this graph and the sibling graphs opened
    through ``open``: "ort" (ONNX Runtime's; the default here, and export's), "specrt" (specrt's CPU kernel,
    specrt/custom_ops: built on first use; EngineError saying what is missing when it cannot be) or "auto"
    (the runtime's default: specrt's kernel on the CPU execution provider of a CPU with AVX-512 or AVX2 where the
    kernel builds, else ONNX Runtime's; one warning says why it did not build). ``session.specrt_attention``
    counts a session's nodes on specrt's kernel (0 where the graph has none, or one the kernel does not compute:
    all or none, custom_ops/).
    matmul: who computes the int4 MatMulNBits nodes of a graph whose attention runs on specrt's kernel: "auto"
    (the default: $SPECRT_MATMUL, else specrt's int4 matmul where one of its vector variants runs: AVX2 or
    AVX-512 VNNI, custom_ops/matmul_nbits.cpp), "ort" or "specrt" (EngineError without them); with specrt's, its
    int8 matmuls with per-row activations too where the CPU has AMX (custom_ops/matmul_int8.cpp).
    ``session.specrt_matmuls`` counts both.
    io_binding: bind inputs from host arrays and outputs on the device, copied back after the run
    (default: on when the first provider is a GPU one). CUDA graphs need fixed shapes and fixed
    buffer addresses, which the numpy protocol (a new past length every call) cannot give: they
    run through ``specrt.engines.cuda_graphs.OrtCudaCore`` in a device-resident runtime
    (``load_device_runtime(..., backend="ort", cuda_graph=True)``).
    """

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None,
                 provider_options: dict | None = None, io_binding: bool | None = None, device_id: int = 0,
                 device: str | None = None, spinning: bool | str | int | None = DEFAULT_SPIN_US,
                 profile_prefix: str | None = None, attention: str | None = None, matmul: str | None = None):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise EngineError(f"graph file missing: {path}")
        if device is not None:  # the other backends' device option: "cpu", or "cuda" = the CUDA provider
            if device not in ("cpu", "cuda"):
                raise EngineError(f"device must be 'cpu' or 'cuda' for the ort backend, got {device!r}")
            providers = providers or (["cuda"] if device == "cuda" else None)
        available = ort.get_available_providers()
        providers = [PROVIDER_ALIASES.get(p, p) for p in (providers or ["CPUExecutionProvider"])]
        missing = [p for p in providers if p not in available]
        if missing:
            raise EngineError(f"execution provider(s) {missing} not available in this onnxruntime "
                              f"(available: {available}); install onnxruntime-gpu for CUDA/TensorRT")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        if profile_prefix:  # ORT's profiler: a Chrome trace per session (``session.end_profiling()``)
            opts.enable_profiling = True
            opts.profile_file_prefix = profile_prefix
        if spinning == "run":  # spin while a run is going, stop when it returns (nothing spins between runs)
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        elif isinstance(spinning, int) and not isinstance(spinning, bool):  # spin at most N µs, then sleep
            if spinning < 0:
                raise EngineError(f"spinning: a spin duration in microseconds must be >= 0, got {spinning}")
            opts.add_session_config_entry("session.intra_op.spin_duration_us", str(spinning))
        elif spinning is not None:  # idle pool threads busy-wait for work (ORT's default: on)
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        attention = attention or "ort"
        if attention not in ATTENTION:
            raise EngineError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        on_cpu = providers == ["CPUExecutionProvider"]
        if attention == "specrt" and not on_cpu:
            raise EngineError("attention 'specrt' is a CPU kernel: it runs with the CPU execution provider only")
        self.attention_asked = attention
        if attention == "auto":
            attention = "specrt" if on_cpu and kernel_pays() else "ort"
        if attention == "specrt":  # graphs load from bytes (custom_ops/): their weights are beside the file
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        self.matmul = resolve_matmul(matmul, on_cpu)
        self.options = opts
        self.providers = [(p, dict((provider_options or {}).get(p, {}))) for p in providers]
        self.attention = attention
        self._registered: set = set()  # custom op libraries registered in self.options
        self.session = self.open(path)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.path = path
        gpu = providers[0] in GPU_PROVIDERS
        self.io_binding = gpu if io_binding is None else bool(io_binding)
        self.device_id = device_id

    def open(self, path: Path, packed: bool = False):
        """An ``InferenceSession`` of the graph at ``path`` with this engine's options and providers (its
        sibling graphs open through it too), its attention nodes on specrt's kernel where ``attention`` says so;
        ``packed``: with the input ``token_slots`` too where that kernel runs it (custom_ops.take_token_slots;
        ``session.specrt_packed`` says whether it does)."""
        import onnxruntime as ort

        model, nodes, matmuls, packs = str(path), 0, 0, False
        if self.attention == "specrt":
            model, nodes, matmuls, packs = specrt_attention_model(path, self.options, self._registered,
                                                                  warn=self.attention_asked == "specrt",
                                                                  matmul=self.matmul == "specrt", packed=packed)
        try:
            session = ort.InferenceSession(model, sess_options=self.options, providers=self.providers)
        except Exception as e:  # ORT raises its own Fail/InvalidGraph types
            raise EngineError(f"ONNX Runtime cannot load {path.name}: {str(e).splitlines()[0]}") from None
        session.specrt_attention = nodes  # attention nodes on specrt's kernel
        session.specrt_matmuls = matmuls  # int4 MatMulNBits and int8 MatMulIntegerToFloat nodes on specrt's matmuls
        session.specrt_packed = packs  # whether it takes ``token_slots`` (custom_ops.take_token_slots)
        return session

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.io_binding:
            outs = self.session.run(None, feeds)
            return dict(zip(self.output_names, outs))
        binding = self.session.io_binding()
        for name in self.input_names:
            binding.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        for name in self.output_names:
            binding.bind_output(name, "cuda", self.device_id)
        self.session.run_with_iobinding(binding)
        return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))


ATTENTION = ("auto", "ort", "specrt")  # who computes a graph's GroupQueryAttention nodes (OrtEngine's ``attention``)


@functools.lru_cache(maxsize=None)
def kernel_pays() -> bool:
    """Whether attention "auto" runs specrt's kernel here: the CPU has AVX-512 or AVX2 with FMA (the kernel's
    vector code; its portable code is slower than ONNX Runtime's, docs/runtime.md) and the kernel builds. Where it
    does not build, one warning per process says why (no C++ compiler, ...); graphs then run ONNX Runtime's."""
    from ..custom_ops import KernelError, attention_library, vector_code

    if not vector_code():
        return False
    try:
        attention_library()
    except KernelError as e:
        warnings.warn(f"{e}; the graphs run ONNX Runtime's attention (slower on CPU: docs/runtime.md, "
                      f"\"Attention kernel\")", stacklevel=2)
        return False
    return True


def resolve_matmul(matmul: str | None, on_cpu: bool) -> str:
    """"specrt" or "ort": OrtEngine's ``matmul`` (None: $SPECRT_MATMUL, else "auto") on this machine."""
    from ..custom_ops import matmul_code

    matmul = matmul or os.environ.get("SPECRT_MATMUL") or "auto"
    if matmul not in ATTENTION:
        raise EngineError(f"matmul must be one of {', '.join(ATTENTION)}, got {matmul!r}")
    if matmul == "specrt" and not (on_cpu and matmul_code()):
        raise EngineError("matmul 'specrt' needs the CPU execution provider on a CPU with AVX2 and FMA or AVX-512 VNNI "
                          "(or SPECRT_ISA=ref)")
    return "specrt" if matmul == "specrt" or (matmul == "auto" and on_cpu and matmul_code()) else "ort"


def specrt_attention_model(path: Path, opts, registered: set, warn: bool = True, matmul: bool = False,
                           packed: bool = False) -> tuple:
    """(the graph at ``path`` as bytes with its attention nodes renamed to specrt's kernel, how many, and with
    ``matmul`` its int4 MatMulNBits nodes renamed to specrt's matmul, their SwiGLU activations and RMS norms folded
    in, how many, and with ``packed`` whether it takes packed calls: ``custom_ops.take_token_slots``), the kernel
    library registered in ``opts`` unless ``registered`` (the libraries already there, updated) has it;
    (str(path), 0, 0, False) for a
    graph without such attention nodes. Its external weights stay where they are: ``opts`` must name
    ``path``'s folder (session.model_external_initializers_file_folder_path). ``warn``: say so when the graph's
    attention uses options the kernel does not implement (attention "specrt" asked for explicitly)."""
    import onnx

    from ..custom_ops import (KernelError, attention_library, fuse_int8_matmuls, fuse_norms, fuse_row_quantize,
                              fuse_swiglu, int8_code, take_token_slots, use_specrt_attention, use_specrt_matmul)

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a corrupt file: protobuf's DecodeError, ...
        raise EngineError(f"ONNX Runtime cannot load {path.name}: not an ONNX model ({str(e).splitlines()[0]})") from None
    nodes = use_specrt_attention(proto)
    packed = packed and bool(nodes) and take_token_slots(proto)  # rows of different lengths in one call
    if not nodes:
        if warn and any(n.op_type == "GroupQueryAttention" for n in proto.graph.node):
            warnings.warn(f"{path.name}: its attention uses options specrt's kernel does not implement (a window, "
                          "a softcap, ...): it runs on ONNX Runtime's", stacklevel=4)
        return str(path), 0, 0, False
    matmuls = use_specrt_matmul(proto) if matmul else 0
    if matmuls:
        fuse_swiglu(proto)  # the MLP's activation folded into its gate/up matmul: four ops a layer fewer
        fuse_norms(proto)  # and each layer's two RMS norms into the matmuls they feed
    if matmul and int8_code():
        matmuls += fuse_int8_matmuls(proto)  # the int8 ones (an int4 graph's lm_head), their row scale folded in
        fuse_row_quantize(proto)  # and the ops quantizing their rows, where the graph computes them (a prefill graph)
    try:
        library = attention_library()
    except KernelError as e:
        raise EngineError(str(e)) from None
    if library not in registered:
        opts.register_custom_ops_library(str(library))
        registered.add(library)
    return proto.SerializeToString(), nodes, matmuls, packed


PROVIDER_ALIASES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                    "tensorrt": "TensorrtExecutionProvider", "trt": "TensorrtExecutionProvider"}
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def gpu_providers(provider: str, cuda_options: dict, device_id: int = 0, trt_options: dict | None = None) -> list:
    """ORT providers list for a GPU session: the TensorRT EP (with the CUDA EP as fallback) or the CUDA EP.

    Raises EngineError naming what is missing when this onnxruntime has no such provider.
    """
    import onnxruntime as ort

    provider = PROVIDER_ALIASES.get(provider, provider)
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise EngineError("needs onnxruntime-gpu (CUDAExecutionProvider not available; this onnxruntime has "
                          f"{available}): pip install 'specrt[gpu]'")
    if provider == "TensorrtExecutionProvider":
        if provider not in available:
            raise EngineError("needs onnxruntime-gpu built with TensorRT (TensorrtExecutionProvider not available)")
        return [(provider, {"device_id": str(device_id), **(trt_options or {})}), ("CUDAExecutionProvider", cuda_options)]
    if provider != "CUDAExecutionProvider":
        raise EngineError(f"unknown GPU provider {provider!r}; use CUDAExecutionProvider or TensorrtExecutionProvider")
    return [("CUDAExecutionProvider", cuda_options)]


class Binding:
    """Host arrays bound to one ``OrtEngine``'s session by address (ORT's IOBinding), for graphs that
    write their KV cache in place: a cache buffer bound once as both past input and present output
    stays bound for every later run; ``inputs`` rebinds the per-call arrays. Every bound array is
    referenced here, so none is freed while ORT holds its address.
    """

    def __init__(self, engine: OrtEngine, buffers: dict | None = None):
        self.session = engine.session
        self.binding = self.session.io_binding()
        self.bound: dict[str, np.ndarray] = {}  # name -> the array whose address is bound
        self.outputs: dict[str, np.ndarray] = {}  # output name -> its preallocated array
        # output name -> flat memory its arrays of every shape share (``buffers``: shared with other bindings whose
        # runs take turns with this one's, each copying out what it keeps before the next)
        self.buffers: dict[str, np.ndarray] = {} if buffers is None else buffers
        # ORT's Python wrappers check for WebGPU graph capture on every call; a decode step calls the
        # pybind objects underneath them (the same calls, without that bookkeeping) where they exist.
        c_session, c_binding = getattr(self.session, "_sess", None), getattr(self.binding, "_iobinding", None)
        if c_session is not None and c_binding is not None:
            self._run = lambda: c_session.run_with_iobinding(c_binding, None)
            self._bind = c_binding.bind_input  # (name, numpy array): bound by address
        else:
            self._run = lambda: self.session.run_with_iobinding(self.binding)
            self._bind = self.binding.bind_cpu_input

    def cache(self, past: str, present: str, buffer: np.ndarray) -> None:
        """Bind ``buffer`` (C-contiguous, never copied) as input ``past`` and output ``present``."""
        if not buffer.flags.c_contiguous:
            raise ValueError(f"cache buffer for {past} must be C-contiguous")
        for name, bind in ((past, self.binding.bind_input), (present, self.binding.bind_output)):
            bind(name, "cpu", 0, buffer.dtype, buffer.shape, buffer.ctypes.data)
            self.bound[name] = buffer

    def inputs(self, **arrays: np.ndarray) -> None:
        for name, a in arrays.items():
            self.input(name, np.ascontiguousarray(a))

    def input(self, name: str, a: np.ndarray) -> None:
        """Bind one C-contiguous host array as input ``name`` (by address, no copy)."""
        self._bind(name, a)
        self.bound[name] = a

    def output(self, name: str, shape: tuple, dtype=np.float32) -> np.ndarray:
        """The array output ``name`` is written into on every run: rebound when the shape changes, in memory
        every shape of it shares (grown to the largest seen). The next run overwrites it: copy what you keep.

        One array per shape and binding, allocated afresh whenever a batch's verify passes changed Q or rows, was
        page-faulted in by the graph's last op: SmolLM2's logits at 16 rows x 8 positions (25 MB), 31-35 ms of a
        145-150 ms pass (110 ms once its memory is mapped)."""
        out = self.outputs.get(name)
        if out is None or out.shape != tuple(shape) or out.dtype != dtype:
            size, flat = int(np.prod(shape)), self.buffers.get(name)
            if flat is None or flat.size < size or flat.dtype != dtype:
                flat = self.buffers[name] = np.empty(size, dtype=dtype)
            out = flat[:size].reshape(shape)
            self.binding.bind_output(name, "cpu", 0, out.dtype, out.shape, out.ctypes.data)
            self.bound[name] = self.outputs[name] = out
        return out

    def run(self) -> dict[str, np.ndarray]:
        """Run the graph; returns the arrays bound with ``output`` (the cache is written in place)."""
        self._run()
        return self.outputs


NBITS_ATTRIBUTES = ("bits", "block_size", "accuracy_level", "K")  # what a MatMulNBits probe is keyed by


def one_row_differs(engine: OrtEngine) -> bool:
    """Whether a one-row call of ``engine``'s graph may compute that row differently from a call of several rows:
    some of its MatMulNBits nodes run on ONNX Runtime's kernel (not specrt's int4 matmul) and that kernel's one-row
    path gives other bits than its several-row path on this CPU (``nbits_one_row_differs``: MLAS's AVX2 and ARM
    code has a one-row kernel of its own; its AVX-512 code computes a row alike either way). The runtime then runs
    decode steps as calls of two rows (runtime/in_place.py ``decode_rows``)."""
    import onnx
    from onnx import helper

    from ..custom_ops import supported_matmul

    proto = onnx.load(str(engine.path), load_external_data=False)
    names = {t.name for t in proto.graph.initializer}
    probes = set()
    on_specrt = engine.session.specrt_matmuls > 0  # what the session renamed (none where its attention is ORT's)
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits" or (on_specrt and supported_matmul(node, names)):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        probes.add((*(int(attrs.get(k, 0)) for k in NBITS_ATTRIBUTES), len(node.input) > 3 and bool(node.input[3])))
    return any(nbits_one_row_differs(*p) for p in probes)


@functools.lru_cache(maxsize=None)
def nbits_one_row_differs(bits: int, block_size: int, accuracy_level: int, k: int, zero_points: bool) -> bool:
    """Whether ONNX Runtime's MatMulNBits with these attributes (K = ``k``, 64 columns of random weights) gives a
    row of a one-row call other bits than the same row in calls of 2 and 3 rows, for any of 3 random inputs. A
    probe of this process's onnxruntime on this CPU, ~10 ms: which kernels MLAS runs is its own choice."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, blocks = 64, -(-k // block_size)
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block_size * bits // 8), dtype=np.uint8), "B"),
               numpy_helper.from_array((rng.random(n * blocks, dtype=np.float32) * 0.02).astype(np.float32), "S")]
    if zero_points:
        weights.append(numpy_helper.from_array(rng.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8), "Z"))
    node = helper.make_node("MatMulNBits", ["A", "B", "S", *(["Z"] if zero_points else [])], ["Y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block_size,
                            accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    for _ in range(3):
        a = rng.standard_normal((3, k)).astype(np.float32)
        one = session.run(None, {"A": a[:1]})[0][0]
        if any(not np.array_equal(one, session.run(None, {"A": a[:m]})[0][0]) for m in (2, 3)):
            return True
    return False
