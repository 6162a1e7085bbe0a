"""The `specrt` command end to end (click's runner, in-process)."""
import json

import pytest
from click.testing import CliRunner

from specrt.tools.cli import cli
from tiny import make_model


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def test_export_then_generate(runner, tmp_path):
    t = make_model(tmp_path / "t", scale=20.0)
    d = make_model(tmp_path / "d", seed=1, hidden=16, layers=1, scale=20.0)
    res = runner.invoke(cli, ["export", "--target", str(t), "--draft", str(d), "--out", str(tmp_path / "e"),
                              "--gamma", "3", "--max-len", "64", "--no-measure-default"])
    assert res.exit_code == 0, res.output
    assert "parity vs torch" in res.output and (tmp_path / "e" / "manifest.json").is_file()
    assert "measured" not in json.loads((tmp_path / "e" / "manifest.json").read_text())["defaults"]
    res = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "hello", "--max-new-tokens", "8",
                              "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out) >= {"token_ids", "text", "stats"} and out["stats"]["method"] == "draft"
    plain = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "hello", "--max-new-tokens", "8",
                                "--method", "none", "--json"])
    assert json.loads(plain.output)["token_ids"] == out["token_ids"]
    res = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "hello", "--max-new-tokens", "8"])
    assert res.exit_code == 0 and "tokens/pass" in res.output


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "2"], "top_p must be"),
    (["--method", "bogus"], "'bogus' is not one of 'none', 'draft', 'ngram', 'suffix', 'medusa', 'eagle'"),
])
def test_generate_bad_arguments(runner, llama_engine, args, message):
    res = runner.invoke(cli, ["generate", str(llama_engine), "--prompt", "hi", *args])
    assert res.exit_code != 0 and message in res.output


def test_generate_bad_engine_dir(runner, tmp_path):
    res = runner.invoke(cli, ["generate", str(tmp_path), "--prompt", "hi"])
    assert res.exit_code != 0 and "no manifest.json" in res.output and "Traceback" not in res.output


def test_export_makes_the_fastest_method_measured_here_the_default(runner, tmp_path):
    """Every method the engine dir has, plain decoding included, is timed; the fastest is the default, and the
    figures are kept (tools/profile/default_method.py)."""
    t = make_model(tmp_path / "t", scale=20.0)
    d = make_model(tmp_path / "d", seed=1, hidden=16, layers=1, scale=20.0)
    res = runner.invoke(cli, ["export", "--target", str(t), "--draft", str(d), "--out", str(tmp_path / "e"),
                              "--gamma", "3", "--max-len", "128"])
    assert res.exit_code == 0, res.output
    defaults = json.loads((tmp_path / "e" / "manifest.json").read_text())["defaults"]
    speedup = defaults["measured"]["speedup"]
    assert list(speedup) == ["none", "ngram", "suffix", "draft"] and speedup["none"] == 1.0
    assert speedup[defaults["method"]] == max(speedup.values())
    assert f"-> {defaults['method']}" in res.output and "default method, measured here" in res.output
    res = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "hello", "--max-new-tokens", "4", "--json"])
    assert json.loads(res.output)["stats"]["method"] == defaults["method"]


def test_export_unsupported_architecture(runner, tmp_path):
    import transformers as tf

    cfg = tf.BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2)
    tf.BloomForCausalLM(cfg).save_pretrained(tmp_path / "bloom")
    from tiny import make_tokenizer
    make_tokenizer(tmp_path / "bloom", 32)
    res = runner.invoke(cli, ["export", "--target", str(tmp_path / "bloom"), "--out", str(tmp_path / "e")])
    assert res.exit_code != 0 and "not supported; supported: LlamaForCausalLM" in res.output


def test_generate_with_torch_backend_equals_ort(runner, tmp_path):
    t = make_model(tmp_path / "t", scale=20.0)
    res = runner.invoke(cli, ["export", "--target", str(t), "--out", str(tmp_path / "e"), "--max-len", "64",
                              "--torch-weights"])
    assert res.exit_code == 0, res.output
    outs = {}
    for backend in ("ort", "torch"):
        res = runner.invoke(cli, ["generate", str(tmp_path / "e"), "--prompt", "abc", "--max-new-tokens", "10",
                                  "--method", "ngram", "--json", "--backend", backend])
        assert res.exit_code == 0, res.output
        outs[backend] = json.loads(res.stdout)["token_ids"]
    assert outs["ort"] == outs["torch"] and len(outs["ort"]) > 0


def test_device_threads_version_and_errors(tmp_path, llama_engine):
    """--device cpu works with the default ort backend (it was a traceback), --threads reaches the session,
    -V prints the version, and the error classes are importable from specrt."""
    import specrt

    res = CliRunner().invoke(cli, ["generate", str(llama_engine), "--prompt", "ab", "--max-new-tokens", "3",
                                   "--device", "cpu", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    rt = specrt.load(llama_engine, device="cpu", threads=1)
    assert rt.target.engine.session.get_session_options().intra_op_num_threads == 1
    with pytest.raises(specrt.EngineError, match="device must be 'cpu' or 'cuda'"):
        specrt.load(llama_engine, device="tpu")
    assert CliRunner().invoke(cli, ["-V"]).output.strip().endswith(specrt.__version__)
    for name in ("EngineError", "SamplingError", "PromptTooLongError", "TreeError", "ExportError"):
        assert issubclass(getattr(specrt, name), Exception)


def test_generate_prompt_file_stdin_and_chat(llama_engine, tmp_path):
    import specrt

    rt = specrt.load(llama_engine)
    want = rt.generate("ab c", max_new_tokens=4, method="none").token_ids
    base = ["generate", str(llama_engine), "--max-new-tokens", "4", "--method", "none", "--json"]
    res = CliRunner().invoke(cli, base + ["--prompt-file", "-"], input="ab c")
    assert res.exit_code == 0 and json.loads(res.output)["token_ids"] == want, res.output
    (tmp_path / "p.txt").write_text("ab c")
    assert json.loads(CliRunner().invoke(cli, base + ["--prompt-file", str(tmp_path / "p.txt")]).output)["token_ids"] == want
    chat = rt.generate("system: be brief\nuser: hi\nassistant:", max_new_tokens=4, method="none").token_ids
    res = CliRunner().invoke(cli, base + ["--prompt", "hi", "--chat", "--system", "be brief"])
    assert res.exit_code == 0 and json.loads(res.output)["token_ids"] == chat  # the server's default template
    for bad, message in ((["--prompt", "a", "--prompt-file", "-"], "exactly one of"), ([], "exactly one of"),
                         (["--prompt", "a", "--system", "s"], "--system needs --chat")):
        res = CliRunner().invoke(cli, ["generate", str(llama_engine), *bad])
        assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output


def test_ctrl_c_exits_130_with_a_summary(llama_engine, monkeypatch, capsys):
    """SIGINT mid-generation: what was produced so far, then exit code 130 (not a traceback, not 1)."""
    import importlib
    import sys

    import specrt
    from specrt.tools import cli as cli_package

    generate_module = importlib.import_module("specrt.tools.cli.generate")  # (the package's `generate` is the command)

    class Interrupted:
        def __init__(self, rt):
            self.rt = rt

        def __getattr__(self, name):
            return getattr(self.rt, name)

        def stream(self, *args, **kwargs):
            gen = self.rt.stream(*args, **kwargs)
            inner = iter(gen)

            def events():
                yield next(inner)
                yield next(inner)
                raise KeyboardInterrupt

            gen.events = events()
            return gen

    monkeypatch.setattr(generate_module, "load_runtime", lambda d, **kw: Interrupted(specrt.load(d)))
    monkeypatch.setattr(sys, "argv", ["specrt", "generate", str(llama_engine), "--prompt", "ab", "--method", "none"])
    with pytest.raises(SystemExit) as exit_info:
        cli_package.main()
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted after 2 tokens" in err and "Traceback" not in err


def _specrt(*args):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "from specrt.tools.cli import main; main()", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_an_export_killed_midway_leaves_no_engine_dir(tmp_path):
    """SIGKILL (no chance to clean up) while the graphs are being written: nothing at --out."""
    t = make_model(tmp_path / "t", arch="llama", vocab_size=32, hidden=64, layers=4, seed=3)
    d = make_model(tmp_path / "d", arch="llama", vocab_size=32, hidden=64, layers=4, seed=4)
    proc = _specrt("export", "--target", str(t), "--draft", str(d), "--out", str(tmp_path / "e"), "--max-len", "32")
    try:
        _wait_for(lambda: list(tmp_path.glob(".e.partial-*/target.onnx")) or proc.poll() is not None)
    finally:
        proc.kill()
        proc.wait(30)
    assert not (tmp_path / "e").exists()


def test_ctrl_c_stops_training_with_exit_130_and_a_checkpoint(tmp_path):
    import signal

    t = make_model(tmp_path / "t", arch="llama", vocab_size=32, hidden=32, layers=2, seed=3)
    (tmp_path / "data.txt").write_text("abc def ghi jkl mno pqr stu vwx yz " * 200)
    (tmp_path / "held.txt").write_text("the quick brown fox jumps over the lazy dog " * 20)
    proc = _specrt("train", "medusa", "--target", str(t), "--data", str(tmp_path / "data.txt"), "--heldout",
                   str(tmp_path / "held.txt"), "--out", str(tmp_path / "heads"), "--steps", "100000", "--batch", "2",
                   "--seq", "16", "--save-every", "5")
    try:
        _wait_for(lambda: (tmp_path / "heads" / "checkpoint.pt").exists() or proc.poll() is not None)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted: checkpoint of step" in out and "Traceback" not in out


def test_generate_and_serve_on_specrt_attention(runner, llama_fused_engine, specrt_attention, monkeypatch):
    """--attention specrt: generate runs the graphs' attention on specrt's kernel (greedy speculation still equals
    plain); serve hands it to the app it builds; the C++ runtime runs it too (libspecrt compiles the kernel in)."""
    import specrt.runtime.serve.app as app_module
    from specrt.runtime.serve.app import AppSpec, ServerConfig, build_app

    out = {}
    for method in ("none", "ngram"):
        res = runner.invoke(cli, ["generate", str(llama_fused_engine), "--prompt", "hello hello hello",
                                  "--max-new-tokens", "12", "--method", method, "--attention", specrt_attention,
                                  "--json"])
        assert res.exit_code == 0, res.output
        out[method] = json.loads(res.output)["token_ids"]
    assert out["ngram"] == out["none"]
    res = runner.invoke(cli, ["generate", str(llama_fused_engine), "--prompt", "hi", "--attention", "specrt",
                              "--backend", "torch"])
    assert res.exit_code != 0 and "--attention specrt runs with --backend ort" in res.output
    seen = {}

    def fake_build_app(spec):
        seen["spec"] = spec
        raise ValueError("stop here")  # before uvicorn starts

    monkeypatch.setattr(app_module, "build_app", fake_build_app)
    res = runner.invoke(cli, ["serve", str(llama_fused_engine), "--attention", "specrt"])
    assert "stop here" in res.output and seen["spec"].attention == "specrt", res.output
    monkeypatch.undo()
    app = build_app(AppSpec(str(llama_fused_engine), ServerConfig(model_name="m"), attention="specrt"))
    assert app.state.server.runtime.target.engine.session.specrt_attention > 0
    with pytest.raises(ValueError, match="attention 'specrt' runs with the ort backend"):
        build_app(AppSpec(str(llama_fused_engine), ServerConfig(model_name="m"), backend="torch", attention="specrt"))
