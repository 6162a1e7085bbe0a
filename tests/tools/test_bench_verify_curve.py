"""tools/bench/verify_curve.py on a tiny fused model: curves, the decode/verify gap, the KL, the table."""
import json

import pytest

from tiny import make_model
from specrt.tools.bench import verify_curve


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    src = make_model(tmp_path_factory.mktemp("vc") / "model", arch="llama", hidden=64, scale=20.0)
    return verify_curve.bench(src, ["fp32", "int4", "w8a8+pad", "int4|w8a8"], None, (1, 2, 5), past=8, threads=1,
                              rounds=1, calls=1, with_quality=True, clock="cpu", max_len=48, log=lambda *_: None)


def test_every_config_gets_a_curve_and_its_quality(result):
    assert list(result["curves"]) == ["fp32", "int4", "w8a8+pad", "int4|w8a8"]
    for c in result["curves"].values():
        assert c["q"] == [1, 2, 5] and c["ratio"][0] == 1.0 and min(c["min_s"]) > 0
    q = result["quality"]
    assert q["fp32"]["kl_mean"] < 1e-9 and q["fp32"]["top1"] == 1.0
    assert q["w8a8+pad"]["gap_q1"] == 0 == q["int4"]["gap_q2"]  # the pad closes it; row-independent MatMuls
    assert q["int4|w8a8"]["gap_q1"] > 0  # two graphs, two models
    assert result["settings"]["clock"] == "cpu" and json.dumps(result)


def test_the_table_has_a_row_per_config(result):
    lines = verify_curve.table(result).splitlines()
    assert lines[0].startswith("| config | T(1) ms | T(2)/T(1) | T(5)/T(1) |") and len(lines) == 2 + 4


def test_cpu_clock_needs_one_thread(tmp_path):
    with pytest.raises(ValueError, match="--threads 1"):
        verify_curve.bench(tmp_path, ["int4"], None, (1, 2), 8, 2, 1, 1, False, clock="cpu")
