"""An application links libspecrt through CMake's find_package after `cmake --install`, as the README shows."""
import subprocess

import specrt
from specrt.tools.libspecrt import SOURCE


def run(cmd, **kw):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return res.stdout


def test_find_package_app(cpp_build, llama_engine, tmp_path):
    prefix, app = tmp_path / "prefix", tmp_path / "app"
    run(["cmake", "--install", cpp_build, "--prefix", prefix])
    run(["cmake", "-S", SOURCE / "examples" / "app", "-B", app, f"-DCMAKE_PREFIX_PATH={prefix}"])
    run(["cmake", "--build", app])
    out = run([app / "app", llama_engine]).splitlines()
    py = specrt.load(llama_engine).generate([1, 5, 9], max_new_tokens=16)  # the engine dir's default method
    assert [int(t) for t in out[0].split()] == py.token_ids
    assert out[1].startswith(py.finish_reason)
