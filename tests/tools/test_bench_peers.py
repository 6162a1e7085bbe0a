"""`specrt bench peers --smoke`: specrt's rows always; each peer run where installed, else listed with its install command."""
import json

from specrt.tools.bench import peers


def test_smoke_runs_specrt_and_lists_or_runs_every_peer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "peers.json"
    peers.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    rows = {(r["system"], r["method"]): r for r in res["rows"]}
    assert {("specrt fp32", m) for m in ("none", "draft", "ngram")} <= set(rows)
    assert all(r["same_tokens_as_specrt_fp32"] == 1.0 for (s, _), r in rows.items() if s == "specrt fp32")
    for peer, (_, install, _) in peers.PEERS.items():  # run, or listed with how to get it (or what it lacks)
        ran = any(s.startswith(peer) for s, _ in rows)
        why = [w for name, w in res["missing"].items() if name.split(" ")[0] == peer]
        assert ran or why and all(install in w or "not drive" in w or "--gguf-converter" in w for w in why)
    assert "specrt fp32" in capsys.readouterr().out
