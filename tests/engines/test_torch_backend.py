"""The torch backend computes what the ONNX graphs compute; device-resident models decode identically.

CPU: torch == ort (logits, new K/V) on tiny models for every fixed shape; greedy generation
through either backend (and through the device-resident runtime, whose bucketed past, padded
query and on-device mask are exercised eagerly here) gives identical tokens. GPU-only paths
(CUDA graphs, ONNX Runtime CUDA EP, TensorRT) are marked and skip, naming what they need.
"""
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

import specrt
import specrt.runtime.api
from specrt.engines import EngineError, OrtEngine, open_engine
from specrt.engines.cuda_graphs import DeviceModel, default_buckets
from specrt.engines.manifest import load_manifest
from specrt.engines.torch_backend import TorchCore, TorchEngine, find_weights
from specrt.runtime.device import load_device_runtime
from specrt.export.onnx_export import ExportConfig, example_tree_mask, export_engine, random_feeds
from tiny import make_model

ATOL = 1e-4  # fp32 tiny models: torch vs ORT differ by float reassociation only (observed ~1e-6)
GAMMA, MAX_LEN, CHUNK = 3, 48, 8
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 7, 7, 2, 7, 7, 2, 7, 7, 2, 7], list(range(1, 20))]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _ort_cuda() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


MISSING = {"cuda": None if _cuda() else "needs a CUDA GPU (torch.cuda.is_available() is False)",
           "ort_gpu": None if _ort_cuda() else "needs onnxruntime-gpu (CUDAExecutionProvider not available)",
           "trt": None if importlib.util.find_spec("tensorrt") else "needs tensorrt (not installed)"}


def needs(*what):
    """skipif naming everything that is missing."""
    missing = [MISSING[w] for w in what if MISSING[w]]
    return pytest.mark.skipif(bool(missing), reason="; ".join(missing))


needs_cuda = needs("cuda")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Llama target + draft (exported through the API) and a GPT-2 target (through the CLI), with torch weights."""
    from click.testing import CliRunner

    from specrt.tools.cli import cli

    root = tmp_path_factory.mktemp("torch_backend")
    t = make_model(root / "t", arch="llama", seed=0, scale=8.0, eos_token_id=None)
    d = make_model(root / "d", arch="llama", seed=1, hidden=16, layers=1, scale=8.0, eos_token_id=None)
    llama = export_engine(t, root / "llama", draft_dir=d, log=lambda *_: None,
                          cfg=ExportConfig(gamma=GAMMA, max_len=MAX_LEN, prefill_chunk=CHUNK, torch_weights=True))
    g = make_model(root / "g", arch="gpt2", seed=2, scale=8.0, eos_token_id=None)
    res = CliRunner().invoke(cli, ["export", "--target", str(g), "--out", str(root / "gpt2"), "--gamma", str(GAMMA),
                                    "--max-len", str(MAX_LEN), "--prefill-chunk", str(CHUNK), "--torch-weights"])
    assert res.exit_code == 0, res.output
    return {"llama": llama, "gpt2": root / "gpt2", "llama_target_model": t}


@pytest.fixture(scope="module")
def twin_engine(engines, tmp_path_factory):
    """The llama target exported as its own draft: greedy decoding accepts every proposal."""
    t = engines["llama_target_model"]
    return export_engine(t, tmp_path_factory.mktemp("twin") / "e", draft_dir=t, log=lambda *_: None,
                         cfg=ExportConfig(gamma=GAMMA, max_len=MAX_LEN, prefill_chunk=CHUNK, torch_weights=True))


def test_export_records_torch_weights(engines):
    for name, roles in (("llama", ("target", "draft")), ("gpt2", ("target",))):
        raw = load_manifest(engines[name]).raw
        for role in roles:
            rel = raw["models"][role]["torch_weights"]
            assert rel == f"torch/{role}"
            assert (engines[name] / rel / "config.json").is_file()
            assert (engines[name] / rel / "model.safetensors").is_file()


def _cases():
    return {"decode": (17, 1, None), "verify": (17, GAMMA + 1, None), "prefill": (0, CHUNK, None),
            "tree": (9, 8, example_tree_mask())}


@pytest.mark.parametrize("name,role", [("llama", "target"), ("llama", "draft"), ("gpt2", "target")])
def test_torch_equals_ort_every_shape(engines, name, role):
    import torch

    m = load_manifest(engines[name])
    spec = m.graphs[role]
    ort_e = OrtEngine(m.root / spec.file)
    torch_e = open_engine(m.root / spec.file, backend="torch")
    assert isinstance(torch_e, TorchEngine)
    assert torch_e.input_names == ort_e.input_names and torch_e.output_names == ort_e.output_names
    for case, (past, q, mask) in _cases().items():
        feeds = random_feeds(spec.geometry, torch.float32, past, q, mask, seed=3)
        feeds = {n: t.numpy() for n, t in zip(ort_e.input_names, feeds)}
        want, got = ort_e.run(feeds), torch_e.run(feeds)
        assert got["logits"].shape == (1, q, spec.geometry.vocab_size)
        for out in ort_e.output_names:
            assert got[out].dtype == want[out].dtype, (case, out)
            diff = float(np.abs(got[out] - want[out]).max())
            assert diff <= ATOL, f"{name}/{role} {case} {out}: max |torch - ort| = {diff:.2e} > {ATOL}"


def _greedy(rt, prompt, method, n=20):
    gamma = None if method == "none" else GAMMA  # fixed γ: every round really proposes and verifies γ tokens
    return rt.generate(prompt, max_new_tokens=n, temperature=0.0, method=method, gamma=gamma).token_ids


@pytest.mark.parametrize("name,methods", [("llama", ("none", "draft", "ngram")), ("gpt2", ("none", "ngram"))])
def test_generation_identical_across_backends(engines, name, methods):
    ort_rt = specrt.load(engines[name])
    torch_rt = specrt.load(engines[name], backend="torch", device="cpu")
    for method in methods:
        for prompt in PROMPTS:
            want = _greedy(ort_rt, prompt, method)
            assert len(want) == 20
            assert _greedy(torch_rt, prompt, method) == want, (method, prompt)


@pytest.mark.parametrize("layout", ["bucketed_padded", "exact"])
def test_device_runtime_matches_ort(engines, layout):
    """The device-resident runtime (eager on CPU): same greedy tokens as ONNX Runtime."""
    opts = dict(buckets=[8, 16, 32], pad=True) if layout == "bucketed_padded" else dict(buckets=None, pad=False)
    ort_rt = specrt.load(engines["llama"])
    dev_rt = load_device_runtime(engines["llama"], device="cpu", cuda_graphs=False, **opts)
    for method in ("none", "draft", "ngram"):
        for prompt in PROMPTS:
            assert _greedy(dev_rt, prompt, method) == _greedy(ort_rt, prompt, method), (layout, method, prompt)
    if layout == "bucketed_padded":
        shapes = set(dev_rt.target.engine.shapes)
        assert {b for _, b in shapes} <= {8, 16, 32, MAX_LEN} and len({b for _, b in shapes}) > 1
        assert any(q == CHUNK for q, _ in shapes)  # prompt tails were padded up to the prefill shape


def test_served_on_the_torch_backend(engines):
    """`specrt serve --backend torch`: the same decode core, batched, over the torch engine."""
    import httpx

    from specrt.runtime.core import CoreConfig
    from specrt.runtime.serve.app import BackgroundServer, ServerConfig, create_app

    ort_rt = specrt.load(engines["llama"])
    torch_rt = specrt.load(engines["llama"], backend="torch", device="cpu")
    app = create_app(torch_rt, ServerConfig(model_name="t", batch=CoreConfig(max_batch=3, method="draft", gamma=GAMMA)))
    with BackgroundServer(app) as srv:
        for prompt in PROMPTS:
            got = httpx.post(srv.url + "/v1/completions", timeout=60,
                             json={"model": "t", "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
            assert got["choices"][0]["text"] == ort_rt.generate(prompt, max_new_tokens=12, method="none").text
            assert got["speculation"]["method"] == "draft" and got["speculation"]["proposed"] > 0


@pytest.fixture(scope="module")
def head_engines(tmp_path_factory, medusa_trained, eagle_trained):
    """The heads' tiny target exported with torch weights, once with Medusa heads and once with an EAGLE head."""
    from tiny import EAGLE_TREE, MEDUSA_TREE
    from specrt.trees import compile_tree

    root = tmp_path_factory.mktemp("heads-torch")
    cfg = ExportConfig(gamma=GAMMA, max_len=MAX_LEN, prefill_chunk=16, torch_weights=True)
    return {"medusa": export_engine(medusa_trained["target"], root / "medusa", cfg=cfg, log=lambda *_: None,
                                    medusa_dir=medusa_trained["heads"], tree=compile_tree(MEDUSA_TREE)),
            "eagle": export_engine(eagle_trained["target"], root / "eagle", cfg=cfg, log=lambda *_: None,
                                   eagle_dir=eagle_trained["head"], eagle_tree=EAGLE_TREE)}


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_methods_identical_across_backends(head_engines, method):
    """The same decode core over ort, the torch backend and the device runner (eager on CPU): same greedy tokens."""
    engine = head_engines[method]
    ort_rt = specrt.load(engine)
    others = {"torch": specrt.load(engine, backend="torch", device="cpu"),
              "device": load_device_runtime(engine, device="cpu", cuda_graphs=False, buckets=[16, 32], pad=True)}
    for prompt in ([3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], [5]):
        want = _greedy(ort_rt, prompt, "none")
        got = ort_rt.generate(prompt, max_new_tokens=20, method=method, gamma=1)  # a tree every round
        assert got.token_ids == want and got.stats["accepted"] > 0, prompt
        for name, rt in others.items():
            assert _greedy(rt, prompt, method) == want, (name, method, prompt)


def _device_model(engines, role="target", **kw):
    m = load_manifest(engines["llama"])
    spec = m.graphs[role]
    weights, entry = find_weights(m.root / spec.file)
    core = TorchCore(weights, "cpu", entry=entry)
    return DeviceModel(core, spec.geometry, m.max_len, q_shapes=range(1, GAMMA + 2), **kw), m, spec


def test_device_model_tree_padding_and_compact(engines):
    """Logits of a tree call padded to a bigger shape, then a compacted cache, equal the numpy engine's."""
    dm, m, spec = _device_model(engines, buckets=[16, 32], pad=True)
    ref = TorchEngine(m.root / spec.file)
    g = spec.geometry
    host = np.zeros((2 * g.num_layers, MAX_LEN, 1, g.num_kv_heads, g.head_dim), np.float32)
    length = 0

    def ref_call(ids, tree=None, depths=None):
        nonlocal length
        q = len(ids)
        block = tree if tree is not None else np.tri(q, dtype=bool)
        mask = np.zeros((1, 1, q, length + q), np.float32)
        mask[0, 0, :, length:] = np.where(block, 0, -65504.0)
        off = depths if depths is not None else np.arange(q)
        feeds = {"input_ids": np.asarray(ids, np.int64)[None], "position_ids": (length + np.asarray(off))[None],
                 "attention_mask": mask}
        feeds.update({n: host[j, :length] for j, n in enumerate(ref.input_names[3:])})
        out = ref.run(feeds)
        for j, n in enumerate(ref.output_names[1 : 1 + 2 * g.num_layers]):
            host[j, length : length + q] = out[n]
        length += q
        return out["logits"][0]

    prompt = [5, 3, 9, 2, 7, 1, 4, 4, 8, 2, 6]  # 11 tokens: bucket 16
    np.testing.assert_allclose(dm.forward(prompt)[0].numpy(), ref_call(prompt), atol=ATOL)
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # root with two children: Q=3 (a captured shape)
    depths = np.array([0, 1, 1])
    np.testing.assert_allclose(dm.forward([3, 8, 9], tree, depths)[0].numpy(), ref_call([3, 8, 9], tree, depths),
                               atol=ATOL)
    two = np.array([[1, 0], [1, 1]], bool)  # Q=2 tree-free chain, then compact keeps root + second child
    dm.compact(11, [11, 13])
    host[:, 11:13] = host[:, [11, 13]]
    length = 13
    assert dm.length == 13
    np.testing.assert_allclose(dm.forward([1, 2], two)[0].numpy(), ref_call([1, 2], two), atol=ATOL)
    dm.rollback(14)
    length = 14
    np.testing.assert_allclose(dm.forward([6, 6, 6, 6, 6, 6])[0].numpy(), ref_call([6] * 6), atol=ATOL)  # > shapes
    assert dm.eager_calls == 4 and dm.replays == 0  # CPU: never a graph


def test_device_speculative_equals_plain_greedy(engines, twin_engine):
    """The device runtime's greedy speculative decoding (fixed γ) reproduces its plain greedy decoding and ORT's."""
    ort_rt = specrt.load(engines["llama"])
    opts = dict(device="cpu", cuda_graphs=False, buckets=default_buckets(MAX_LEN, 16), pad=True)
    runtimes = {"draft": load_device_runtime(engines["llama"], **opts),
                "twin": load_device_runtime(twin_engine, **opts)}
    accepted = {}
    for prompt in PROMPTS:
        want_plain, want_spec = _greedy(ort_rt, prompt, "none", n=16), _greedy(ort_rt, prompt, "draft", n=16)
        for name, rt in runtimes.items():
            assert _greedy(rt, prompt, "none", n=16) == want_plain, (name, prompt)
            res = rt.generate(prompt, max_new_tokens=16, temperature=0.0, method="draft", gamma=GAMMA)
            assert res.token_ids == want_plain == want_spec, (name, prompt)
            stats = res.stats  # γ every round; the last rounds propose at most the tokens left
            assert stats["gamma_history"] == [GAMMA] * stats["rounds"] and stats["proposed"] <= GAMMA * stats["rounds"]
            assert 0 <= stats["accepted"] <= stats["proposed"]
            accepted.setdefault(name, []).append(stats["accepted"] / stats["proposed"])
    assert min(accepted["twin"]) == 1.0  # every proposal accepted: the draft catches up on its last proposal
    assert max(accepted["draft"]) < 1.0  # rejections happened


def test_missing_torch_weights_is_a_clear_error(engines, tmp_path):
    raw = json.loads((engines["llama"] / "manifest.json").read_text())
    del raw["models"]["target"]["torch_weights"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    (tmp_path / "target.onnx").write_bytes(b"")
    with pytest.raises(EngineError, match="--torch-weights"):
        TorchEngine(tmp_path / "target.onnx")
    with pytest.raises(EngineError, match="cuda_graphs needs a device-resident KV cache"):
        TorchEngine(engines["llama"] / "target.onnx", cuda_graphs=True)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="checks the error raised without tensorrt")
def test_export_trt_without_tensorrt_fails_first(engines, tmp_path):
    from click.testing import CliRunner

    from specrt.tools.cli import cli

    res = CliRunner().invoke(cli, ["export", "--target", str(engines["llama"] / "torch" / "target"),
                                   "--out", str(tmp_path / "e"), "--trt"])
    assert res.exit_code != 0 and "needs tensorrt (not installed)" in res.output
    assert not (tmp_path / "e").exists()  # refused before exporting anything


@pytest.mark.skipif(_cuda(), reason="checks the error raised where CUDA is absent")
def test_cuda_request_without_gpu_names_the_cause(engines):
    with pytest.raises(EngineError, match=r"torch.cuda.is_available\(\) is False"):
        TorchEngine(engines["llama"] / "target.onnx", device="cuda")


def test_engines_package_imports_without_torch():
    code = ("import sys; import specrt, specrt.engines, specrt.engines.torch_backend, specrt.engines.cuda_graphs, "
            "specrt.engines.trt_backend; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'tensorrt' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpu_check_plugin_routes_load_and_export(engines, tmp_path, monkeypatch):
    """tools/gpu_check.py runs tests/runtime/test_exactness.py through this plugin: it must really swap the runtime."""
    from specrt.engines.cuda_graphs import DeviceModel
    from specrt.export import onnx_export
    from specrt.tools import gpu_check

    monkeypatch.setattr(specrt, "load", specrt.load)  # restored after the test
    monkeypatch.setattr(onnx_export, "export_engine", onnx_export.export_engine)
    gpu_check.install_device_runtime("cpu")
    rt = specrt.load(engines["llama"])
    assert isinstance(rt.target.engine, DeviceModel) and isinstance(rt.draft.engine, DeviceModel)
    want = _greedy(specrt.runtime.api.Runtime.load(engines["llama"]), PROMPTS[0], "draft")
    assert _greedy(rt, PROMPTS[0], "draft") == want
    t = make_model(tmp_path / "t", arch="llama", seed=3, hidden=16, layers=1, eos_token_id=None)
    out = onnx_export.export_engine(t, tmp_path / "e", log=lambda *_: None, cfg=ExportConfig(max_len=16, prefill_chunk=4))
    assert load_manifest(out).raw["models"]["target"]["torch_weights"] == "torch/target"


# ---- GPU paths: skipped here, run by tools/gpu_check.py where a GPU is --------------------------


@needs_cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_cuda_device_runtime_matches_cpu(engines, graphs):
    ort_rt = specrt.load(engines["llama"])
    gpu_rt = load_device_runtime(engines["llama"], device="cuda", cuda_graphs=graphs)
    for method in ("none", "draft", "ngram"):
        for prompt in PROMPTS:
            assert _greedy(gpu_rt, prompt, method) == _greedy(ort_rt, prompt, method), (method, prompt)
    if graphs:
        assert gpu_rt.target.engine.replays > 0


@needs_cuda
def test_cuda_torch_engine_equals_ort(engines):
    import torch

    m = load_manifest(engines["llama"])
    spec = m.target
    ort_e, gpu_e = OrtEngine(m.root / spec.file), TorchEngine(m.root / spec.file, device="cuda")
    for past, q, mask in _cases().values():
        feeds = {n: t.numpy() for n, t in zip(ort_e.input_names, random_feeds(spec.geometry, torch.float32, past, q,
                                                                              mask, seed=4))}
        want, got = ort_e.run(feeds), gpu_e.run(feeds)
        for out in want:
            assert float(np.abs(got[out] - want[out]).max()) <= 1e-3  # GPU fp32 (TF32 off by default)


@needs("ort_gpu", "cuda")
def test_ort_cuda_ep_equals_cpu(engines):
    import torch

    m = load_manifest(engines["llama"])
    spec = m.target
    cpu, gpu = OrtEngine(m.root / spec.file), OrtEngine(m.root / spec.file, providers=["cuda"])
    assert gpu.io_binding
    for past, q, mask in _cases().values():
        feeds = {n: t.numpy() for n, t in zip(cpu.input_names, random_feeds(spec.geometry, torch.float32, past, q,
                                                                            mask, seed=5))}
        want, got = cpu.run(feeds), gpu.run(feeds)
        for out in want:
            assert float(np.abs(got[out] - want[out]).max()) <= 1e-3


@needs("ort_gpu", "cuda")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_ort_cuda_device_runtime_matches_cpu(engines, cuda_graph):
    ort_rt = specrt.load(engines["llama"])
    gpu_rt = load_device_runtime(engines["llama"], device="cuda", backend="ort", cuda_graph=cuda_graph)
    for prompt in PROMPTS:
        assert _greedy(gpu_rt, prompt, "draft") == _greedy(ort_rt, prompt, "draft")


@needs("trt", "cuda")
def test_trt_plans_match_ort(engines):
    import torch

    from specrt.export.trt_build import build_engine_plans

    build_engine_plans(engines["llama"], precision="fp32", log=lambda *_: None)
    m = load_manifest(engines["llama"])
    spec = m.target
    cpu, trt_e = OrtEngine(m.root / spec.file), open_engine(m.root / spec.file, backend="trt")
    for past, q, mask in _cases().values():
        feeds = {n: t.numpy() for n, t in zip(cpu.input_names, random_feeds(spec.geometry, torch.float32, past, q,
                                                                            mask, seed=6))}
        want, got = cpu.run(feeds), trt_e.run(feeds)
        for out in want:
            assert float(np.abs(got[out] - want[out]).max()) <= 1e-2  # TensorRT fp32 may use TF32 tactics
    ort_rt = specrt.load(engines["llama"])
    trt_rt = load_device_runtime(engines["llama"], device="cuda", backend="trt")
    for prompt in PROMPTS:
        assert _greedy(trt_rt, prompt, "draft") == _greedy(ort_rt, prompt, "draft")
