"""An ``InPlaceRunner`` runs a fused graph (kv_layout "in_place") whose attention writes the KV cache itself.

The cache is head-major, ``data`` [2 * layers, slots, Hkv, max_len + 1, D], one plane per layer K or V,
and each plane's rows are bound ONCE to the graph as both ``past_*`` and ``present_*`` (ORT's
shared past/present buffer): a call writes row r's Q new entries at [lengths[r], lengths[r] + Q)
and copies no past. ``lengths`` [slots] counts the valid entries; everything after is stale and
never read (mask column t of a row is its entry t).

The same protocol as ``HostRunner``: ``forward`` returns a ``Pass`` and changes no length;
``commit(pass, keep)`` makes row r's kept new positions valid: a chain keeps a prefix (rollback
= set the length, no copy), a tree keeps the root and the accepted path, moved down over the
rejected nodes (a few rows per layer). Commit a slot's pass before the next forward on that slot.

A one-row chain call (a decode step, a chain's verify pass: Q <= ``CHAIN_Q``) runs through arrays
bound once per (slot, Q) (``ChainArrays``): it writes the tokens and positions in place and rebinds
only the mask.

A pass whose rows run in one call (the core's batch, in slot order) returns that call's bound outputs, not a copy
(16 rows of SmolLM2's logits: 3.1 MB a position, 0.23 ms a copy): they hold until the runner's next call (every
binding writes one memory), so a caller copies what it keeps past its next ``forward``; a pass of several calls
copies each call's out.

Several rows run in ONE call per run of consecutive slots (the core's batch: slots 0..B-1): with Q = 1
through the fused graph, with Q > 1 (a batch's verify pass: chains of any lengths, trees) through its
batched twin (``batched_file``, export/batched_graph.py), the same model and cache binding with
GroupQueryAttention replaced by ops that take several rows of Q > 1 tokens, which ONNX Runtime's CPU
GroupQueryAttention refuses. Each row's mask is its own (``contract.in_place_mask``). An engine dir without
a twin (exported before it), a runner of one slot, or an onnxruntime that cannot load it runs such calls
row by row. A row whose padding would run past the cache runs alone (its padding cut).

A pass of chains whose rows verify different lengths (``forward(..., counts=)``) runs packed where the fused graph's
attention is specrt's kernel (``open_packed``: the graph with the input ``token_slots``, custom_ops.take_token_slots):
every row's own tokens one run after the other, [1, N], in ONE call with the whole cache bound, no padding computed;
its ``Pass`` keeps the rows' offsets (``Pass.row``).

Every single-row call (decode steps, chain verify passes, a tree, prefill chunks) runs through the target's
padded graph where the engine dir has one (``decode_file``, export/decode_pad.py): each attention call gets
one padding query row, so a decode step takes GroupQueryAttention's Q >= 2 path and its logits equal the
verify pass's row bit for bit (in int8/int4/w8a8 graphs the Q = 1 path's last bits became whole quantization
steps: greedy speculation departed from plain greedy). The padding row writes its K/V one entry past the
call's, hence the cache's spare entry per slot (``max_len`` stays the usable length). Several-row calls of
Q = 1 keep the fused graph (GroupQueryAttention refuses Q > 1 after a past at batch > 1). An engine whose
attention runs on specrt's kernel (``OrtEngine(attention="specrt")``, custom_ops/) opens neither the padded
graph nor the twin: that kernel computes each row the same whatever the call's other rows, so the fused
graph's decode steps already equal the verify passes' rows, and it takes several rows of Q > 1 tokens.

Decode rows: the MatMulNBits nodes that ONNX Runtime's kernel computes (every int4 matmul where specrt's does not
run: AVX2, ARM, SPECRT_MATMUL=ort) may have a one-row path of their own, whose bits differ from the same row in a
call of several rows (MLAS on AVX2: a separate M = 1 kernel; rows of calls of 2 rows or more agree). Padding the
attention does not reach them. Where ``engines.ort.one_row_differs`` finds such a kernel (a probe of this process's
onnxruntime, at load), ``decode_rows`` is 2: every one-token call runs as two rows, the token and a dummy copy of it
after it (causal-last: no real row sees it; its K/V land in the entry after, never valid), through the fused graph,
so MatMulNBits and GroupQueryAttention both take their several-row paths and a decode step equals the verify
pass's row bit for bit. It costs one row per decode step; the padded graph is then not opened. Calls of
several rows (a batch's step) need nothing.

Prompt chunks run through the prefill graph where the engine dir has one (``prefill_file``,
export/prefill_graph.py: the padded graph with its MatMulNBits layers on the integer kernel, ~3x faster
per prompt token); the prompt's entries then come from that graph, the generated tokens' from the others.
"""
from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import numpy as np

from ..contract import batch_mask, chain_inputs, chain_mask, in_place_mask, past_names, present_names
from ..engines import EngineError, OrtEngine
from ..engines.ort import Binding, one_row_differs
from .runner import CacheFullError, Pass, Runner, cache_zeros, keep_freed_memory


CHAIN_Q = 16  # chain calls of at most this many tokens (decode steps, verify passes) run through bound-once arrays


class ChainArrays:
    """The inputs and outputs of one slot's Q-token chain calls, in a binding of their own (bound once,
    the slot's cache included) and written in place: per call only the mask, whose past grows, is
    rebound (``chain_mask`` written into the slot's mask buffer). A binding per (slot, Q), not one
    rebound whenever Q changes: on the int4 demo target at 1 thread, rebinding on every switch
    between decode steps and verify passes cost 100-200 µs of the next call (host time outside the run)."""

    def __init__(self, binding: Binding, q: int, mask_buffer: np.ndarray, outputs: dict[str, int]):
        self.binding = binding  # the slot's cache bound as past and present, and the arrays below
        self.ids = np.zeros((1, q), np.int64)  # [1, Q] the tokens
        self.offsets = np.arange(q, dtype=np.int64)  # [Q]
        self.position = np.zeros((1, q), np.int64)  # [1, Q] their positions: the slot's length + offsets
        self.seqlens_k = np.zeros(1, np.int32)  # [1] GroupQueryAttention's "total - 1"
        self.total = np.zeros((), np.int32)  # [] entries once the chain is in
        self.mask_buffer = mask_buffer  # float32 [CHAIN_Q * max_len], shared by the slot's chain calls
        binding.inputs(input_ids=self.ids, position_ids=self.position, seqlens_k=self.seqlens_k,
                       total_sequence_length=self.total)
        self.outputs = {name: binding.output(name, (1, q, width)) for name, width in outputs.items()}  # [1, Q, width]


class InPlaceRunner(Runner):
    """One fused graph on ONNX Runtime's CPU provider and the in-place cache of ``max_batch`` slots."""

    def __init__(self, engine, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, vocab_size: int,
                 hidden_size: int | None = None, max_batch: int = 1, prefill_chunk: int = 128, on_call=None,
                 aux_size: int | None = None, batched: "Sibling | None" = None, decode: "Sibling | None" = None,
                 prefill: "Sibling | None" = None, packed: "Sibling | None" = None, decode_rows: int = 1):
        if not isinstance(engine, OrtEngine) or engine.io_binding:
            raise EngineError("a fused graph (kv_layout in_place) runs on ONNX Runtime's CPU provider only; "
                              "export with --graph traced for the torch backend, CUDA or TensorRT")
        self.engine = engine
        self.batched = batched  # the batched twin: calls of R > 1 rows with Q > 1 (None: row by row)
        self.single = decode or engine  # single-row calls: the padded graph (None: the fused graph)
        self.decode_rows = decode_rows  # 2: a one-token call runs with a dummy second row (see "Decode rows" above)
        self.prefill_graph = prefill  # prompt chunks: the padded graph on the integer kernel (None: ``single``)
        self.dtype = np.float32
        self.max_len, self.max_batch, self.prefill_chunk = max_len, max_batch, prefill_chunk
        self.vocab_size, self.hidden_size = vocab_size, hidden_size  # hidden_size: None = no `hidden` output
        self.features = {n: w for n, w in (("hidden", hidden_size), ("aux_hidden", aux_size)) if w}  # output -> width
        keep_freed_memory()  # a pass's logits and ORT's buffers reuse the heap, not fresh pages each call
        # + 1: the padded graph's padding row writes one entry past a call's new ones (never valid, never read)
        self.data = cache_zeros((2 * num_layers, max_batch, num_kv_heads, max_len + 1, head_dim))
        self.lengths = np.zeros(max_batch, dtype=np.int64)  # [slots] valid entries per slot
        self.names = list(zip(past_names(num_layers), present_names(num_layers)))  # per plane (past, present)
        self.bindings: dict[tuple[int, int, bool], Binding] = {}  # (first slot, rows, twin?) -> those cache rows bound
        # (one row: through ``single``)
        self.prefill_bindings: dict[int, Binding] = {}  # slot -> the prefill graph with that slot's cache bound
        self.packed_graph = packed  # rows' chains in one call without padding (``_packed``; None: padded)
        self.packs = packed is not None
        self.packed_binding: Binding | None = None  # the packed graph with every slot's cache bound (on first use)
        self.zero_mask = np.zeros(0, np.float32)  # a packed call's attention_mask (chains: the kernel's causal rule)
        self.chain_arrays: dict[tuple[int, int], ChainArrays] = {}  # (slot, Q) -> what its chain calls run through
        self.mask_buffers: dict[int, np.ndarray] = {}  # slot -> float32 [CHAIN_Q * max_len]
        self.output_memory: dict[str, np.ndarray] = {}  # output name -> the memory every binding's calls write it
        # into (one call at a time, copied out after each), grown to the largest call: mapped in once, not per shape
        self.on_call = on_call
        self.engine_seconds = 0.0
        self.calls = 0

    @classmethod
    def for_graph(cls, engine, spec, max_len: int, max_batch: int = 1, on_call=None,
                  packs: bool = False, decode_rows: int | None = None) -> "InPlaceRunner":
        """The runner of ``spec``'s graph with its siblings opened; ``packs``: with the packed graph too (several
        slots: passes of chains without padding); ``decode_rows``: 1 or 2 rows a one-token call runs with (None:
        2 where ``engines.ort.one_row_differs`` says a one-row call's bits may differ, else 1)."""
        g = spec.geometry
        aux = len(spec.aux_hidden_layers) * g.hidden_size if spec.aux_hidden_layers else None
        if decode_rows is None:
            decode_rows = 2 if one_row_differs(engine) else 1
        return cls(engine, g.num_layers, g.num_kv_heads, g.head_dim, max_len, g.vocab_size,
                   g.hidden_size if spec.has_hidden else None, max_batch, int(spec.shapes.get("prefill", 128)), on_call,
                   aux, open_twin(engine, spec) if max_batch > 1 else None,
                   open_decode(engine, spec) if decode_rows == 1 else None,
                   open_prefill(engine, spec), open_packed(engine) if packs and max_batch > 1 else None, decode_rows)

    def binding(self, first: int, rows: int, twin: bool = False) -> Binding:
        """The binding of the fused graph (``twin``: of the batched twin; one row: of ``single``) whose cache
        inputs/outputs are slots [first, first + rows) (made once)."""
        key = (first, rows, twin)
        if key not in self.bindings:
            graph = self.batched if twin else (self.single if rows == 1 else self.engine)
            self.bindings[key] = self._cache_binding(first, rows, graph)
        return self.bindings[key]

    def _cache_binding(self, first: int, rows: int, engine=None) -> Binding:
        """A new binding of ``engine`` (default: the fused graph) with slots [first, first + rows) of the
        cache as every past input and present output."""
        b = Binding(engine or self.engine, self.output_memory)
        for j, (past, present) in enumerate(self.names):
            b.cache(past, present, self.data[j, first : first + rows])
        return b

    # ---- running ----------------------------------------------------------------------------
    def forward(self, slots, ids, blocks=None, depths=None, record: bool = True, counts=None) -> Pass:
        """Run ``ids`` [R, Q] after each slot's valid entries (see ``HostRunner.forward``); the new
        K/V land in the stale part of each slot, valid only once committed. ``counts`` [R]: row r's first counts[r]
        tokens are its own, the rest padding (None: all Q): a runner that ``packs`` runs chains without the padding."""
        slots = np.asarray(slots, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        r, q = ids.shape
        if r == 1 and q <= CHAIN_Q and (blocks is None or q == 1) and self.lengths[slots[0]] + q <= self.max_len:
            return self._timed(self._chain, 1, q, record, int(slots[0]), ids[0])  # a decode step or a chain's verify
        lengths = self.lengths[slots].copy()  # [R]
        if counts is not None and self.packs and blocks is None and r > 1:
            counts = np.asarray(counts, dtype=np.int64)
            n = int(counts.sum())
            if n < r * q and (lengths + counts <= self.max_len).all():
                return self._timed(self._packed, r, n, record, slots, ids, lengths, counts)
        positions = self.positions(lengths, q, depths)
        groups = self._groups(slots, lengths, q)
        if r > 1 and len(groups) == 1 and np.array_equal(groups[0], np.arange(r)):  # one call, rows in slot order:
            outputs = self._timed(self._run, r, r * q, record, groups[0], slots, ids, lengths, positions, blocks)
            return Pass(slots, outputs["logits"], outputs, lengths)  # its bound outputs, not copied
        logits = np.empty((r, q, self.vocab_size), dtype=np.float32)  # every row's Q positions written by its call
        feats = {n: np.empty((r, q, w), dtype=np.float32) for n, w in self.features.items()}  # [R, Q, width] each

        def run_groups():
            for rows in groups:
                outputs = self._run(rows, slots, ids, lengths, positions, blocks)
                n = outputs["logits"].shape[1]
                at = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else rows  # a block copy
                for whole, part in ((logits, outputs["logits"]), *((f, outputs[name]) for name, f in feats.items())):
                    whole[at, :n] = part  # copied out: the runner's next call rewrites the bound buffers
                    whole[at, n:] = 0  # (a row alone at the cache's end: its cut padding)

        self._timed(run_groups, r, r * q, record)
        return Pass(slots, logits, {"logits": logits, **feats}, lengths)

    def _packed(self, slots: np.ndarray, ids: np.ndarray, lengths: np.ndarray, counts: np.ndarray) -> Pass:
        """Row r's first ``counts[r]`` tokens of ``ids`` [R, Q], every row's one run after the other, in ONE call of N =
        sum(counts) positions (custom_ops.take_token_slots): no padding computed. Its outputs are the call's bound
        ones, [1, N, width], row r's at ``offsets[r]:offsets[r + 1]`` (``Pass.row``)."""
        q = ids.shape[1]
        own = np.arange(q) < counts[:, None]  # [R, Q] a row's own tokens
        n, total = int(counts.sum()), int((lengths + counts).max())
        seqlens = np.zeros(self.max_batch, np.int32)  # [slots] total - 1 of the slots in the call (others unread)
        seqlens[slots] = lengths + counts - 1
        if self.zero_mask.size < n * total:
            self.zero_mask = np.zeros(n * total, np.float32)
        if self.packed_binding is None:
            self.packed_binding = self._cache_binding(0, self.max_batch, self.packed_graph)
        b = self.packed_binding
        b.inputs(input_ids=ids[own][None], position_ids=(lengths[:, None] + np.arange(q))[own][None],
                 attention_mask=self.zero_mask[: n * total].reshape(1, 1, n, total), seqlens_k=seqlens,
                 total_sequence_length=np.array(total, dtype=np.int32), token_slots=np.repeat(slots, counts))
        widths = {"logits": self.vocab_size, **self.features}
        outputs = {name: b.output(name, (1, n, width)) for name, width in widths.items()}
        b.run()
        return Pass(slots, outputs["logits"], outputs, lengths, np.concatenate([[0], np.cumsum(counts)]))

    def prefill_pass(self, slot: int, ids: list) -> Pass:
        """A prompt chunk ``ids`` [Q] through the prefill graph where the engine dir has one
        (export/prefill_graph.py): logits [1, 1, V] of the chunk's last position (the graph computes no
        other), the features of every position."""
        if self.prefill_graph is None:
            return super().prefill_pass(slot, ids)
        n, q = int(self.lengths[slot]), len(ids)
        if n + q > self.max_len:
            raise CacheFullError(f"KV cache full: {n} + {q} tokens > max_len {self.max_len}")
        if slot not in self.prefill_bindings:
            self.prefill_bindings[slot] = self._cache_binding(slot, 1, self.prefill_graph)
        b = self.prefill_bindings[slot]
        b.inputs(**chain_inputs(ids, n))
        outputs = {"logits": b.output("logits", (1, 1, self.vocab_size)),
                   **{name: b.output(name, (1, q, w)) for name, w in self.features.items()}}
        self._timed(b.run, 1, q, False)
        outputs = {name: out.copy() for name, out in outputs.items()}  # the next call rewrites the bound buffers
        return Pass(np.array([slot]), outputs["logits"], outputs, np.array([n]))

    def _groups(self, slots: np.ndarray, lengths: np.ndarray, q: int) -> list[np.ndarray]:
        """The calls of a pass, as row indices: one per run of consecutive slots (Q = 1, or Q > 1 with the
        twin), a row whose Q tokens would run past the cache alone; without the twin, Q > 1 row by row."""
        if len(slots) == 1 or (q > 1 and self.batched is None):
            return [np.array([b]) for b in range(len(slots))]
        fits = np.flatnonzero(lengths + q <= self.max_len)
        alone = np.flatnonzero(lengths + q > self.max_len)
        return [fits[run] for run in consecutive_runs(slots[fits])] + [np.array([b]) for b in alone]

    def _chain(self, slot: int, ids: np.ndarray) -> Pass:
        """Q <= CHAIN_Q tokens ``ids`` [Q] after slot ``slot``'s entries, causal, through ``ChainArrays``; with
        ``decode_rows`` 2, one token runs as a call of two: the token, then a dummy copy of it, writing the entry
        after it (never valid). Row 0 cannot see it. Not for a call writing the cache's last entry
        (ONNX Runtime's attention refuses a total past its rotary cache), which the core never makes: its cache holds
        every token but the pending one, so a sequence of max_len tokens writes max_len - 1 entries."""
        q, n = len(ids), int(self.lengths[slot])
        calls = max(q, self.decode_rows) if n + self.decode_rows <= self.max_len else q  # the call's rows
        a = self.chain_arrays.get((slot, calls))
        if a is None:
            buffer = self.mask_buffers.setdefault(slot, np.zeros(CHAIN_Q * self.max_len, np.float32))
            a = self.chain_arrays[slot, calls] = ChainArrays(self._cache_binding(slot, 1, self.single), calls, buffer,
                                                             {"logits": self.vocab_size, **self.features})
        a.ids[0, :q] = ids
        np.add(a.offsets, n, out=a.position[0])
        if calls > q:
            a.ids[0, q:] = ids[-1]
        a.seqlens_k[0], a.total[()] = n + calls - 1, n + calls
        a.binding.input("attention_mask", chain_mask(n, calls, out=a.mask_buffer))
        a.binding.run()
        # copied: the next call rewrites the bound buffers (a dummy row's outputs are dropped)
        outputs = {name: out[:, :q].copy() for name, out in a.outputs.items()}
        return Pass(np.array([slot]), outputs["logits"], outputs, np.array([n]))

    def _run(self, rows, slots, ids, lengths, positions, blocks) -> dict[str, np.ndarray]:
        """One graph call over ``rows`` (indices into the pass; their slots are consecutive): its outputs (logits and
        features, [len(rows), n, width] each, n = Q or less for a row alone at the cache's end) as bound, rewritten
        by the runner's next call (every binding writes one memory)."""
        q = ids.shape[1]
        lens = lengths[rows]
        n = min(q, self.max_len - int(lens.max()))  # padding that would run past the cache is cut
        if n < 1 or (len(rows) > 1 and n < q):
            raise CacheFullError(f"KV cache full: lengths {lens.tolist()} + {q} > max_len {self.max_len}")
        if len(rows) == 1 and n < self.decode_rows:  # one token alone (a slot between others' in a batch step)
            return self._chain(int(slots[rows[0]]), ids[rows[0], :n]).outputs
        total = int(lens.max()) + n
        if len(rows) == 1:
            block = None if blocks is None else blocks[rows[0]]
            mask = (chain_mask(int(lens[0]), n) if block is None
                    else batch_mask(lens, n, [block[:n, :n]]))  # [1, 1, n, L + n]: the row's own entries
        else:  # [R, 1, n, T]: row b's entries [0, length_b), then its own n new ones
            mask = in_place_mask(lens, n, None if blocks is None else [blocks[b] for b in rows])
        b = self.binding(int(slots[rows[0]]), len(rows), twin=len(rows) > 1 and n > 1)
        b.inputs(input_ids=ids[rows, :n], position_ids=positions[rows, :n], attention_mask=mask,
                 seqlens_k=(lens + n - 1).astype(np.int32), total_sequence_length=np.array(total, dtype=np.int32))
        widths = {"logits": self.vocab_size, **self.features}
        outputs = {name: b.output(name, (len(rows), n, width)) for name, width in widths.items()}
        b.run()
        return outputs

    def commit(self, p: Pass, keep=None) -> None:
        """Make row r's new positions ``keep[r]`` (ascending indices into Q; None: all Q) valid."""
        for r, s in enumerate(p.slots):
            s, start = int(s), int(p.lengths[r])
            if self.lengths[s] != start:
                raise RuntimeError(f"slot {s} changed since this pass (length {self.lengths[s]}, pass {start})")
            k = np.arange(len(p.row(r))) if keep is None else np.asarray(keep[r], dtype=np.int64)
            n = len(k)
            if start + n > self.max_len:
                raise CacheFullError(f"KV cache full: {start} + {n} tokens > max_len {self.max_len}")
            if n and k[-1] != n - 1:  # not a prefix (a tree's path): move the kept entries down
                planes = self.data[:, s]  # [2 * layers, Hkv, max_len, D]
                planes[:, :, start : start + n] = planes[:, :, start + k]
            self.lengths[s] = start + n

    # ---- slots --------------------------------------------------------------------------------
    def copy(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s valid entries into slot ``dst`` (a fork: n sequences of one prompt)."""
        n = int(self.lengths[src])
        self.data[:, dst, :, :n] = self.data[:, src, :, :n]
        self.lengths[dst] = n

    def entries(self, slot: int, n: int) -> np.ndarray:
        """A view of the first ``n`` entries of ``slot``: [2 * layers, Hkv, n, D] (written in place: the
        graph's bound planes stay the same arrays)."""
        return self.data[:, slot, :, :n]


class Sibling:
    """A graph beside the fused graph (its batched twin, its padded decode graph) in an ONNX Runtime session:
    what ``Binding`` needs of an engine."""

    def __init__(self, session):
        self.session = session


_SIBLINGS: "weakref.WeakKeyDictionary[OrtEngine, dict[str, Sibling]]" = weakref.WeakKeyDictionary()  # one session
# per (engine, file), shared by every runner of that engine (ORT sessions run concurrently; bindings are per runner)


def on_specrt_attention(engine: OrtEngine) -> bool:
    """Whether the fused graph's attention runs on specrt's kernel (``OrtEngine(attention="specrt")``, custom_ops/)."""
    return bool(engine.session.specrt_attention)


def open_twin(engine: OrtEngine, spec) -> Sibling | None:
    """The batched twin of ``spec`` (its manifest's ``batched_file``) in a session with ``engine``'s options,
    or None: none exported, or this onnxruntime cannot load it (a warning says so; Q > 1 batches then run
    row by row). On specrt's attention kernel, the fused graph itself: that kernel takes several rows of
    Q > 1 tokens after their pasts (each row its own length and mask), which ORT's refuses."""
    if on_specrt_attention(engine):
        return Sibling(engine.session)
    if spec.batched_file is None:
        return None
    return open_sibling(engine, spec.batched_file, "batched twin", "batches with several tokens per row run row by row")


def open_decode(engine: OrtEngine, spec) -> Sibling | None:
    """The padded graph of ``spec`` (its manifest's ``decode_file``), or None: none exported (engine dirs before
    it, drafts), or this onnxruntime cannot load it (a warning says so; single-row calls then run the fused graph)."""
    if spec.decode_file is None or on_specrt_attention(engine):  # its rows need no padding (custom_ops/)
        return None
    return open_sibling(engine, spec.decode_file, "padded decode graph",
                        "decode steps run the fused graph (they may differ from verify passes in the last bits)")


def open_prefill(engine: OrtEngine, spec) -> Sibling | None:
    """The prefill graph of ``spec`` (its manifest's ``prefill_file``), or None: none exported (fp32, w8a8, drafts,
    engine dirs before it), or this onnxruntime cannot load it (a warning says so)."""
    if spec.prefill_file is None:
        return None
    return open_sibling(engine, spec.prefill_file, "prefill graph", "prompts run through the decode graph")


def open_packed(engine: OrtEngine) -> Sibling | None:
    """The fused graph with the input ``token_slots`` (custom_ops.take_token_slots) in a session of its own, opened
    once per engine, or None where its attention cannot take it (a sliding window, ONNX Runtime's kernel)."""
    opened = _SIBLINGS.setdefault(engine, {})
    if "packed" not in opened:
        session = engine.open(engine.path, packed=True) if on_specrt_attention(engine) else None
        opened["packed"] = Sibling(session) if session is not None and session.specrt_packed else None
    return opened["packed"]


def open_sibling(engine: OrtEngine, file: str, what: str, otherwise: str) -> Sibling | None:
    """``file`` (engine-dir relative) in a session with ``engine``'s options, opened once per engine; None with
    a warning (saying ``otherwise``) where ONNX Runtime cannot load it. EngineError if its I/O differs."""
    import onnxruntime as ort

    opened = _SIBLINGS.setdefault(engine, {})
    if file in opened:
        return opened[file]
    path = Path(engine.path).parent / file
    try:
        session = engine.open(path)
    except EngineError as e:  # ORT's own error, e.g. an onnxruntime before 1.23 has no TensorScatter
        warnings.warn(f"{path.name}: ONNX Runtime {ort.__version__} cannot load it ({str(e).split(': ', 1)[-1]}); "
                      f"{otherwise}", stacklevel=3)
        return None
    if [i.name for i in session.get_inputs()] != engine.input_names or \
            [o.name for o in session.get_outputs()] != engine.output_names:
        raise EngineError(f"{path.name}: its inputs/outputs differ from {engine.path.name}'s (not its {what})")
    opened[file] = Sibling(session)
    return opened[file]


def consecutive_runs(slots: np.ndarray) -> list[np.ndarray]:
    """Row indices grouped into runs of consecutive slots: [3, 4, 7] -> [[0, 1], [2]]."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    return np.split(np.arange(len(slots)), breaks)
