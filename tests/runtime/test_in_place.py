"""InPlaceRunner (the fused graph's cache, written by the graph) against HostRunner (the traced graph's
cache, appended by numpy): the same logits through batches, rollbacks, tree compaction and slot moves;
batches of several tokens per row in one call of the batched twin."""
import dataclasses
import json
import platform
import resource

import numpy as np
import pytest

from specrt.engines.ort import Binding
from specrt.export.onnx_export import example_tree_mask
from specrt.runtime.in_place import InPlaceRunner, consecutive_runs
from specrt.runtime.runner import CacheFullError, HostRunner, keep_freed_memory
from specrt.runtime.api import Runtime

TOL = 1e-4
TARGET = dict(arch="llama", hidden=64, scale=20.0)  # head_dim 16: the fused graph


@pytest.fixture(scope="module")
def runners(build_engine):
    """(in-place, host) runners of 3 slots over the same model, the in-place cache's stale part all NaN."""
    fused = Runtime.load(build_engine("inplace_fused", TARGET, max_len=48, graph="fused"), attention="ort")
    traced = Runtime.load(build_engine("inplace_traced", TARGET, max_len=48, graph="traced"))

    def make(stale=np.nan):
        a, b = fused.runner("target", 3)[0], traced.runner("target", 3)[0]
        assert isinstance(a, InPlaceRunner) and isinstance(b, HostRunner)
        a.data[:] = stale  # a stale entry that leaked into a result would show
        return a, b

    make.fused = fused
    make.build = build_engine

    return make


def both(pair, *args, **kw):
    """forward on both runners; asserts equal logits; returns both passes."""
    a, b = (r.forward(*args, **kw) for r in pair)
    np.testing.assert_allclose(a.logits, b.logits, atol=TOL, rtol=0)
    assert np.isfinite(a.logits).all()
    return a, b


def test_batches_rollbacks_trees_and_moves_match_the_host_runner(runners):
    pair = runners()
    prompts = [[3, 5, 7, 9, 11, 13, 15], list(range(1, 13)), [2, 4, 6]]
    for slot, p in enumerate(prompts):
        for r in pair:
            r.prefill(slot, p)
    passes = both(pair, [0, 1, 2], [[1], [2], [3]])  # Q = 1 over rows of lengths 7, 12, 3
    for r, p in zip(pair, passes):
        r.commit(p)
    passes = both(pair, [0, 2], [[4, 5, 6, 7], [8, 9, 10, 11]])  # chains over non-consecutive slots
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 1], [0]])  # keep 2 and 1: the rest rolled back
    mask = example_tree_mask().numpy()
    depths = mask.sum(-1) - 1
    passes = both(pair, [1], [np.arange(20, 28)], blocks=[mask], depths=[depths])
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 2, 5, 7]])  # the root and the path 2 -> 5 -> 7: compacted
    both(pair, [0, 1, 2], [[5], [6], [7]])
    for r in pair:
        r.move(2, 0)
        r.release(1)
    assert pair[0].lengths.tolist() == pair[1].lengths.tolist() == [5, 0, 0]  # slot 2: 3 + 1 + 1
    both(pair, [0], [[1, 2, 3]])


def test_padding_past_the_cache_is_cut_and_a_full_cache_refused(runners):
    pair = runners()
    a = pair[0]
    for r in pair:
        r.prefill(0, [i % 31 + 1 for i in range(46)])  # max_len 48: room for 2
    p = a.forward([0], [[1, 2, 3, 4, 5]])
    ref = pair[1].forward([0], [[1, 2, 3, 4, 5]])
    np.testing.assert_allclose(p.logits[0, :2], ref.logits[0, :2], atol=TOL, rtol=0)
    with pytest.raises(CacheFullError):
        a.commit(p)
    a.commit(p, [[0, 1]])
    assert a.room(0) == 0


def test_consecutive_runs():
    assert [r.tolist() for r in consecutive_runs(np.array([3, 4, 7, 8, 9, 1]))] == [[0, 1], [2, 3, 4], [5]]


def test_chain_calls_through_bound_arrays_interleaved_with_tree_calls(runners):
    """Decode steps and chain verifies (arrays bound once per Q, only the mask rebound) stay equal to the host
    runner when tree calls and rollbacks on the same slot rebind the graph in between."""
    pair = runners()
    for r in pair:
        r.prefill(0, [3, 5, 7])
    mask = example_tree_mask().numpy()
    depths = mask.sum(-1) - 1
    for step, ids in enumerate([[1], [2, 3, 4, 5], [6], [7, 8, 9, 10], [11, 12], [13]]):
        passes = both(pair, [0], [ids])
        for r, p in zip(pair, passes):
            r.commit(p, [list(range(min(len(ids), 1 + step % 2)))])  # keep 1 or 2: the rest rolled back
        if step % 3 == 2:
            passes = both(pair, [0], [np.arange(20, 28)], blocks=[mask], depths=[depths])
            for r, p in zip(pair, passes):
                r.commit(p, [[0, 2]])
    assert pair[0].lengths.tolist() == pair[1].lengths.tolist()


def graph_runs(monkeypatch) -> list:
    """The sessions of every in-place graph call from now on (``Binding.run`` counted)."""
    runs, run = [], Binding.run

    def counted(self):
        runs.append(self.session)
        return run(self)

    monkeypatch.setattr(Binding, "run", counted)
    return runs


def test_a_batch_of_chains_and_trees_is_one_call_equal_to_the_host_runner(runners, monkeypatch):
    """Several rows of Q > 1 tokens (chains of different lengths padded to Q, trees of different shapes beside
    a chain) run in ONE call of the batched twin, equal to the host runner; the stale cache holds large finite
    garbage, which the twin reads for shorter rows (masked) and must not leak."""
    pair = runners(stale=1e4)
    a = pair[0]
    assert a.batched is not None
    for slot, p in enumerate([[3, 5, 7, 9, 11, 13, 15], list(range(1, 13)), [2, 4, 6]]):
        for r in pair:
            r.prefill(slot, p)
    runs = graph_runs(monkeypatch)
    passes = both(pair, [0, 1, 2], [[4, 5, 6, 7], [8, 9, 0, 0], [10, 11, 12, 0]])  # chains of 4, 2, 3 tokens
    assert runs == [a.batched.session]
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 1, 2, 3], [0], [0, 1]])
    big = example_tree_mask().numpy()  # 8 nodes
    small = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # a root and two children
    blocks, depths = [big, None, small], [big.sum(-1) - 1, None, small.sum(-1) - 1]
    ids = [np.arange(20, 28), np.arange(1, 9), [5, 6, 7, 0, 0, 0, 0, 0]]
    passes = both(pair, [0, 1, 2], ids, blocks=blocks, depths=depths)
    assert len(runs) == 2 and runs[-1] is a.batched.session
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 2, 5, 7], [0, 1, 2], [0, 2]])  # tree paths compacted, the chain's prefix kept
    both(pair, [0, 1, 2], [[1], [2], [3]])  # a decode step: the fused graph, one call
    assert len(runs) == 3 and runs[-1] is a.engine.session
    assert pair[0].lengths.tolist() == pair[1].lengths.tolist()


def test_on_specrt_attention_a_batch_of_chains_and_trees_is_one_fused_call(runners, monkeypatch, specrt_attention):
    """On specrt's attention kernel the fused graph itself takes several rows of Q > 1 tokens (no twin, no
    padded graph): decode steps, chains and trees of different rows in one call each, equal to the host
    runner, with every stale cache entry NaN (none is read)."""
    fused = Runtime.load(runners.build("inplace_fused", TARGET, max_len=48, graph="fused"), attention=specrt_attention)
    a, host = fused.runner("target", 3)[0], runners()[1]
    a.data[:] = np.nan
    assert a.batched.session is a.engine.session and a.single is a.engine
    pair = (a, host)
    for slot, p in enumerate([[3, 5, 7, 9, 11, 13, 15], list(range(1, 13)), [2, 4, 6]]):
        for r in pair:
            r.prefill(slot, p)
    runs = graph_runs(monkeypatch)
    passes = both(pair, [0, 1, 2], [[4, 5, 6, 7], [8, 9, 0, 0], [10, 11, 12, 0]])
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 1, 2, 3], [0], [0, 1]])
    big, small = example_tree_mask().numpy(), np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    passes = both(pair, [0, 1, 2], [np.arange(20, 28), np.arange(1, 9), [5, 6, 7, 0, 0, 0, 0, 0]],
                  blocks=[big, None, small], depths=[big.sum(-1) - 1, None, small.sum(-1) - 1])
    for r, p in zip(pair, passes):
        r.commit(p, [[0, 2, 5, 7], [0, 1, 2], [0, 2]])
    both(pair, [0, 1, 2], [[1], [2], [3]])
    assert runs == [a.engine.session] * 3
    both(pair, [1], [[4, 5, 6]])  # one row: a chain call, the same graph
    assert runs[-1] is a.engine.session


def test_on_specrt_attention_chains_of_different_lengths_run_packed_without_padding(runners, monkeypatch,
                                                                                  specrt_attention):
    """``counts``: each row's own tokens (the rest padding). On specrt's attention kernel a batch of chains runs
    as ONE call of the packed graph (custom_ops.take_token_slots) over sum(counts) positions: each row's logits
    equal the host runner's padded pass's, and committing (a kept prefix, or every own position) leaves both caches
    alike. On ONNX Runtime's attention the runner does not pack and runs the padding; nor does a runner not made to
    pack (a draft's)."""
    fused = Runtime.load(runners.build("inplace_fused", TARGET, max_len=48, graph="fused"), attention=specrt_attention)
    a, host = fused.runner("target", 3)[0], runners()[1]
    assert a.packs and not runners()[0].packs
    assert not InPlaceRunner.for_graph(a.engine, fused.target.spec, 48, 3).packs  # (a draft's runner: no packed graph)
    a.data[:] = np.nan
    for slot, p in enumerate([[3, 5, 7, 9, 11, 13, 15], list(range(1, 13)), [2, 4, 6]]):
        for r in (a, host):
            r.prefill(slot, p)
    runs = graph_runs(monkeypatch)
    ids, counts = [[4, 5, 6, 7], [8, 0, 0, 0], [10, 11, 0, 0]], [4, 1, 2]
    packed, padded = a.forward([0, 1, 2], ids, counts=counts), host.forward([0, 1, 2], ids)
    assert runs == [a.packed_graph.session] and packed.logits.shape == (1, 7, a.vocab_size) and packed.positions == 7
    for row, n in enumerate(counts):
        np.testing.assert_allclose(packed.row(row), padded.logits[row, :n], atol=TOL, rtol=0)
    a.commit(packed, [[0, 1], [0], [0, 1]])
    host.commit(padded, [[0, 1], [0], [0, 1]])
    ids = [[1, 2], [3, 0], [5, 0]]
    packed, padded = a.forward([0, 1, 2], ids, counts=[2, 1, 1]), host.forward([0, 1, 2], ids)
    a.commit(packed)  # every own position: 2, 1, 1
    host.commit(padded, [[0, 1], [0], [0]])
    assert a.lengths.tolist() == host.lengths.tolist() == [11, 14, 6]
    both((a, host), [0, 1, 2], [[1], [2], [3]])  # a decode step: the fused graph, the same logits
    full = a.forward([0, 1, 2], [[1, 2], [3, 4], [5, 6]], counts=[2, 2, 2])  # no padding: the fused graph, [R, Q]
    assert full.offsets is None and runs[-1] is a.engine.session


def test_without_a_twin_rows_run_one_by_one_with_the_same_logits(runners, monkeypatch):
    """A runner without the twin (an engine dir from before it, or one slot) runs Q > 1 batches row by row."""
    pair = runners(stale=0.0)
    spec = dataclasses.replace(runners.fused.target.spec, batched_file=None)
    alone = InPlaceRunner.for_graph(pair[0].engine, spec, 48, 3)
    one_slot = InPlaceRunner.for_graph(pair[0].engine, runners.fused.target.spec, 48, 1)
    assert alone.batched is None and one_slot.batched is None
    for slot, p in enumerate([[3, 5, 7], [9, 11], [2, 4, 6, 8]]):
        for r in (*pair, alone):
            r.prefill(slot, p)
    runs = graph_runs(monkeypatch)
    want = both(pair, [0, 1, 2], [[1, 2, 3], [4, 5, 0], [6, 0, 0]])[0]
    got = alone.forward([0, 1, 2], [[1, 2, 3], [4, 5, 0], [6, 0, 0]])
    assert len(runs) == 1 + 3
    np.testing.assert_allclose(got.logits, want.logits, atol=TOL, rtol=0)


def test_a_row_whose_padding_runs_past_the_cache_runs_alone(runners, monkeypatch):
    pair = runners(stale=0.0)
    for slot, n in enumerate([5, 9, 46]):  # max_len 48: slot 2 has room for 2
        for r in pair:
            r.prefill(slot, [i % 31 + 1 for i in range(n)])
    runs = graph_runs(monkeypatch)
    ids = [[1, 2, 3, 4], [7, 8, 9, 0], [5, 6, 0, 0]]
    p, ref = pair[0].forward([0, 1, 2], ids), pair[1].forward([0, 1, 2], ids)
    assert runs == [pair[0].batched.session, pair[0].single.session]  # slots 0 and 1 together, slot 2 alone (padded)
    for row, n in enumerate([4, 4, 2]):
        np.testing.assert_allclose(p.logits[row, :n], ref.logits[row, :n], atol=TOL, rtol=0)
    assert not p.logits[2, 2:].any()  # the cut padding's logits are zeros, not what the memory held


def test_calls_of_every_shape_write_one_memory_and_a_pass_of_several_calls_keeps_its_logits(runners):
    """The bindings' outputs are views into the runner's ``output_memory`` (one flat array per output, grown to the
    largest call), not an array per binding and shape: its pages are mapped once. A pass that is one call returns its
    outputs there, not copied (valid until the runner's next call: the core reads them within its step); a pass of
    several calls copies each call's out, so a later call of another shape leaves it as it was."""
    pair = runners(stale=1e4)  # (the twin reads shorter rows' stale entries, masked: finite garbage, not NaN)
    for slot, p in enumerate([[3, 5, 7, 9], list(range(1, 13)), [2, 4, 6]]):
        for r in pair:
            r.prefill(slot, p)
    a = pair[0]
    one_call = both(pair, [0, 1, 2], [[4, 5], [6, 7], [8, 9]])[0]  # 3 rows x 2: the twin, one call
    assert np.shares_memory(one_call.logits, a.output_memory["logits"])
    two_calls = both(pair, [0, 2], [[4, 5], [8, 9]])[0]  # slots 0 and 2: not consecutive, a call each
    assert not np.shares_memory(two_calls.logits, a.output_memory["logits"])
    kept = two_calls.logits.copy()
    both(pair, [0, 1, 2], [[4, 5, 6, 7]] * 3)  # 3 x 4: the memory grows
    both(pair, [0, 1], [[1], [2]])  # 2 x 1: the fused graph
    np.testing.assert_array_equal(two_calls.logits, kept)
    memory = a.output_memory["logits"]
    assert memory.size == 3 * 4 * a.vocab_size
    assert all(np.shares_memory(b.outputs["logits"], memory) for b in a.bindings.values())


def test_the_export_writes_the_twin_beside_the_fused_graph_on_one_weights_file(runners):
    """The twin reads the fused graph's weights from their shared external data file; the export checked it."""
    root = runners.fused.manifest.root
    entry = json.loads((root / "manifest.json").read_text())["models"]["target"]
    assert entry["batched_file"] == "target_batched.onnx" and entry["batched_parity"]["rel"] < 1e-3
    data = (root / "target.onnx.data").stat().st_size
    assert (root / "target_batched.onnx").stat().st_size < data / 4 and (root / "target.onnx").stat().st_size < data / 4


def test_a_missing_or_unloadable_twin(runners, tmp_path):
    """A manifest naming a twin that is not there is refused at load; a twin ONNX Runtime cannot load (e.g. an
    onnxruntime before TensorScatter) leaves the runner row by row, with a warning saying so."""
    import shutil

    from specrt.engines import EngineError

    engine = shutil.copytree(runners.fused.manifest.root, tmp_path / "engine")
    (engine / "target_batched.onnx").write_bytes(b"not a graph")
    with pytest.warns(UserWarning, match="target_batched.onnx.*row by row"):
        assert Runtime.load(engine, attention="ort").runner("target", 3)[0].batched is None
    (engine / "target_batched.onnx").unlink()
    with pytest.raises(EngineError, match="target graph file 'target_batched.onnx' is missing"):
        Runtime.load(engine)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keeping freed memory is glibc's mallopt: not this C library")
def test_freed_memory_is_kept_for_the_next_call():
    """After ``keep_freed_memory`` (a runner's load calls it) a freed 16 MB block is still mapped when the next one
    is allocated: that one costs no page faults (glibc's defaults unmapped it, 4,096 faults to map it again)."""
    assert keep_freed_memory()
    np.ones(4 << 20, np.float32)  # 16 MB, freed at once
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(4 << 20, np.float32)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 100
