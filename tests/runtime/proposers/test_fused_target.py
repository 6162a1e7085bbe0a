"""Medusa and EAGLE on a fused target graph (the demo target: head_dim 64, kv_layout in_place): the
InPlaceRunner's `hidden` output and tree commits give greedy output equal to plain decoding."""
import pytest

import specrt


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_tree_methods_on_a_fused_target_equal_plain_greedy(kind, tmp_path_factory, monkeypatch):
    from specrt.tools.demo_engines import tree_engine

    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path_factory.mktemp(f"cache_{kind}")))
    rt = specrt.load(tree_engine(kind))
    assert rt.manifest.target.kv_layout == "in_place" and rt.manifest.target.has_hidden
    prompt = "def fibonacci(n):\n    "
    plain = rt.generate(prompt, max_new_tokens=48, method="none")
    tree = rt.generate(prompt, max_new_tokens=48, method=kind, gamma=1)  # gamma=1: a tree every round
    assert tree.token_ids == plain.token_ids
    assert tree.stats["tokens_per_pass"] > 1.0  # trees were verified and paths accepted
