"""`specrt export` of a real model with no flags (beyond --quantize) succeeds: SmolLM2-135M in fp32, int8, int4.

The export checks its graphs against PyTorch before it writes an engine dir; on a real model that check must
pass at its defaults (no tolerance option), or a user's first command fails. The exports are the session's
shared engines (conftest.py); one cached from an earlier run of the same sources counts, as the export
writes an engine dir only when every check passed.
"""
import json

import pytest

pytestmark = pytest.mark.real


@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
def test_export_with_no_flags_succeeds(smollm2_export, kind):
    e = smollm2_export(kind)
    assert e.engine_dir is not None, f"`specrt export` ({kind}) failed:\n{e.output[-3000:]}"
    target = json.loads((e.engine_dir / "manifest.json").read_text())["models"]["target"]
    assert target["quantize"] == (None if kind == "fp32" else kind)
    assert target["vocab_size"] == 49152 and target["num_layers"] == 30
    # the padded graph of single-row calls, checked by the export: decode steps equal the verify pass's rows
    assert target["decode_file"] == "target_decode.onnx" and target["decode_parity"]["steps_vs_verify"] == 0.0
