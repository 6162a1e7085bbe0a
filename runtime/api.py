"""``specrt.load(engine_dir)`` returns a ``Runtime``: generate / stream over an engine dir.

A ``Runtime`` holds the engine dir's graphs and tokenizer; ``generate`` / ``stream`` run the
decode core (runtime/core.py) at max_batch 1, and ``specrt serve`` runs the same core at
max_batch N over the same ``Runtime``.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..contract import NP_DTYPES, io_names
from ..engines import EngineError, open_engine
from ..engines.manifest import GraphSpec, Manifest, load_manifest
from .batch_policy import PolicyConfig, SpeculationPolicy
from .pass_cost import PassCost
from .constraints import ConstraintError, ConstraintSpec, Grammar, GrammarCompiler
from .core import CoreConfig, DecodeCore, Limits, SequenceRequest, StopRules, check_config
from .in_place import InPlaceRunner
from .methods import check_method, fixed_gamma, parse_methods, resolve_method
from .runner import HostRunner
from .sampling import SamplingError, SamplingParams, check_logit_bias
from ..trees import compile_tree, load_tree


class PromptTooLongError(ValueError):
    pass


def check_prompt_length(n: int, max_len: int) -> None:
    """PromptTooLongError unless a prompt of ``n`` tokens leaves room in a cache of ``max_len``."""
    if n >= max_len:
        raise PromptTooLongError(f"prompt has {n} tokens; the engine's cache holds max_len={max_len} tokens in all, "
                                 f"so at most {max_len - 1}")


EXTRA_SAMPLING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "logit_bias", "min_tokens")


def _keywords(extra: dict) -> dict:
    unknown = sorted(set(extra) - set(EXTRA_SAMPLING))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; besides the named ones: "
                        f"{', '.join(EXTRA_SAMPLING)}")
    return extra


@dataclass
class Graph:
    """One graph of the engine dir: the engine that runs it and its manifest entry."""

    engine: object  # an ``Engine`` (engines/): named arrays in, named arrays out
    spec: GraphSpec  # models.<role> of the manifest


@dataclass
class GenerationOutput:
    token_ids: list  # generated token ids (an EOS or stop token included; prompt excluded)
    text: str  # decoded generated text, stop string excluded
    finish_reason: str  # "stop" (EOS, stop token or stop string) | "length" (max_new_tokens or cache full)
    stats: dict = field(default_factory=dict)  # see docs/runtime.md "Stats"
    logprobs: list | None = None  # with logprobs=k: per generated token (logprob, ((id, logprob), ...) top k)


class Generation:
    """An in-progress generation: iterate it for ``StreamEvent``s; afterwards read ``token_ids``,
    ``text``, ``finish_reason``, ``stats`` (and ``logprobs`` if asked), filled in as it runs."""

    def __init__(self, logprobs: bool):
        self.token_ids: list = []  # generated ids so far
        self.text = ""  # generated text so far
        self.finish_reason: str | None = None  # set once finished
        self.stats: dict = {}  # set once finished
        self.logprobs: list | None = [] if logprobs else None  # (logprob, top alternatives) per token
        self.events = iter(())  # the StreamEvents (``Runtime.stream`` sets the generator that fills this in)

    def __iter__(self):
        return self.events

    def result(self) -> GenerationOutput:
        for _ in self.events:
            pass
        return GenerationOutput(self.token_ids, self.text, self.finish_reason, self.stats, self.logprobs)


ORT_TYPES = {"tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(float)": "float32", "tensor(float16)": "float16"}


def check_graph(engine, spec: GraphSpec) -> None:
    """The graph's inputs must be the manifest's: names in order and, where the engine reports them
    (ONNX Runtime), dtypes and fixed dimensions. The error names the first mismatch."""
    session = getattr(engine, "session", None)
    expected = [i["name"] for i in spec.inputs]
    if session is None:  # the torch / TensorRT backends run the traced graph's contract
        expected = io_names(spec.geometry.num_layers, spec.has_hidden)[0]
    if list(engine.input_names) != expected:
        raise EngineError(f"{spec.file}: graph inputs {engine.input_names[:4]}... do not match "
                          f"the manifest ({expected[:4]}...): the engine dir is inconsistent")
    for meta, want in zip(session.get_inputs() if session is not None else (), spec.inputs):
        dtype = ORT_TYPES.get(meta.type, meta.type)
        fixed = [(a, b) for a, b in zip(meta.shape, want["shape"]) if isinstance(a, int) and isinstance(b, int)]
        if dtype != want["dtype"] or len(meta.shape) != len(want["shape"]) or any(a != b for a, b in fixed):
            raise EngineError(f"{spec.file}: input {meta.name!r} is {dtype} {list(meta.shape)} in the graph but "
                              f"{want['dtype']} {want['shape']} in the manifest: the engine dir is inconsistent")


class Runtime:
    """An engine dir, loaded: tokenizer and graphs; generation through the decode core.

    One sequence at a time (batch 1); not thread-safe: a server drives the core from one worker.
    """

    def __init__(self, manifest: Manifest, target: Graph, draft: Graph | None, tokenizer, medusa=None, eagle=None,
                 runner_factory=None, eagle_fc=None):
        self.manifest = manifest
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_ids = set(manifest.eos_token_ids)
        self.gamma_max = manifest.gamma
        self.default_gamma = self._default_gamma(manifest)  # defaults.gamma: used when a caller passes None
        self.medusa = medusa  # Engine of the Medusa heads graph, if the engine dir has one
        tree = manifest.medusa.tree if manifest.medusa else None
        self.tree = compile_tree(tree["choices"], tree["name"]) if tree else None  # tree used by method "medusa"
        self.eagle = eagle  # Engine of the EAGLE head graph, if the engine dir has one
        self.eagle_fc = eagle_fc  # Engine of an EAGLE-3 head's fc graph (aux_hidden -> hidden); None: EAGLE-1
        self.eagle_tree = dict(manifest.eagle.tree) if manifest.eagle else None  # {"nodes", "depth", "topk"}
        self.runner_factory = runner_factory  # (graph, max_batch, on_call) -> runner; None: HostRunner
        self._shared: dict = {}  # role -> (runner, PassCost) at max_batch 1, shared by the batch-1 cores
        self._cores: dict = {}  # (method, acceptance) -> DecodeCore at max_batch 1
        self._corpora: dict = {}  # resolved path -> suffix decoding's index of that corpus file
        self._requests = 0  # generations started (request ids of the batch-1 cores)
        self._grammar_compiler: GrammarCompiler | None = None  # made on first use (llguidance's tokenizer: 0.1-1 s)
        self._grammar_lock = threading.Lock()  # one compiler, whichever thread asks first

    def _default_gamma(self, manifest: Manifest) -> int | None:
        """The manifest's ``defaults.gamma`` (e.g. written by `specrt profile --write-defaults`); None = adaptive."""
        g = manifest.defaults.get("gamma")
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= manifest.gamma):
            raise EngineError(f"manifest.json: defaults.gamma must be null (adaptive) or an integer in "
                              f"0..{manifest.gamma} (the exported gamma), got {g!r}")
        return g

    @classmethod
    def load(cls, engine_dir: str | Path, backend: str = "ort", **engine_options) -> "Runtime":
        """``engine_options`` go to every graph's engine (ort: threads, spinning, attention, providers, ...);
        with the ort backend, ``attention`` defaults to $SPECRT_ATTENTION where it is set, else "auto" (specrt's
        CPU kernel where it builds and pays, else ONNX Runtime's: ``OrtEngine``, engines/ort.py)."""
        from tokenizers import Tokenizer

        if backend == "ort":
            engine_options.setdefault("attention", os.environ.get("SPECRT_ATTENTION") or "auto")
        m = load_manifest(engine_dir)
        graphs = {}
        for role, spec in m.graphs.items():
            options = dict(engine_options)
            if backend == "ort" and role == "draft" and "threads" not in options:
                # one intra-op thread: a draft step is too small to gain from a pool, and a pool's
                # spinning threads compete with the target's (measured on the 2-core demo: draft
                # decoding 1.3-1.5x faster than with the default pool; plain decoding unchanged)
                options["threads"] = 1
            engine = open_engine(m.root / spec.file, backend=backend, **options)
            check_graph(engine, spec)
            graphs[role] = Graph(engine, spec)
        tok = Tokenizer.from_file(str(m.tokenizer_dir / "tokenizer.json"))
        medusa = open_engine(m.root / m.medusa.file, backend=backend, **engine_options) if m.medusa else None
        eagle = open_engine(m.root / m.eagle.file, backend=backend, **engine_options) if m.eagle else None
        fc = m.eagle.fc_file if m.eagle else None
        eagle_fc = open_engine(m.root / fc, backend=backend, **engine_options) if fc else None
        return cls(m, graphs["target"], graphs.get("draft"), tok, medusa=medusa, eagle=eagle, eagle_fc=eagle_fc)

    def use_tree(self, tree) -> None:
        """Use another candidate tree (a default name, a JSON file, a list of paths or a ``Tree``) for
        method "medusa"; it must fit the exported tree-verify shape and the heads."""
        from .proposers.medusa import check_tree_fits

        if self.manifest.medusa is None:
            raise SamplingError("this engine dir has no Medusa heads: export with --medusa")
        tree = load_tree(tree)
        check_tree_fits(tree, self.manifest.medusa)
        self.tree = tree
        self._cores = {key: core for key, core in self._cores.items() if key[0] != "medusa"}

    # ---- the pieces the decode core is built from ---------------------------------------------
    def runner(self, role: str, max_batch: int):
        """A new (runner, PassCost) pair for the "target" or "draft" graph with ``max_batch`` slots;
        the runner records the time of every decode call into the cost but the first of each shape."""
        graph = self.target if role == "target" else self.draft
        cost = PassCost()
        shapes = set()  # (rows, positions) of the calls run so far

        def on_call(rows: int, positions: int, seconds: float) -> None:
            if (rows, positions) in shapes:
                cost.record(rows, positions, seconds)
            else:  # a shape's first call also pays ONNX Runtime's one-time setup of it (memory planning, buffers):
                shapes.add((rows, positions))  # 1.2-2x a steady call here; recorded, it priced plain steps too high

        if self.runner_factory is not None:
            return self.runner_factory(graph, max_batch, on_call), cost
        return runner_for_graph(graph.engine, graph.spec, self.manifest.max_len, max_batch, on_call,
                                packs=role == "target", decode_rows=None if role == "target" else 1), cost

    def suffix_corpus(self, path: str | Path):
        """The fixed suffix index of the corpus file at ``path`` (read and tokenized once per Runtime)."""
        from .proposers.suffix import corpus_index, read_corpus

        key = str(Path(path).resolve())
        if key not in self._corpora:
            self._corpora[key] = corpus_index(self.encode_texts(read_corpus(Path(path))))
        return self._corpora[key]

    def proposer(self, method: str, max_batch: int, draft=None, corpus: str | None = None):
        """The proposer of ``method`` for ``max_batch`` slots (draft: the draft's (runner, PassCost) pair;
        corpus: suffix decoding's corpus file)."""
        from . import proposers

        if method == "draft":
            from .proposers.draft import DraftProposer

            return DraftProposer(draft[0], self.gamma_max)
        if method == "ngram":
            from .proposers.ngram import NGramProposer

            return NGramProposer(max_gamma=self.gamma_max)
        if method == "suffix":
            from .proposers.suffix import SuffixProposer

            return SuffixProposer(self.gamma_max, corpus=self.suffix_corpus(corpus) if corpus else None)
        if method == "medusa":
            from .proposers.medusa import MedusaProposer

            return MedusaProposer(self.medusa, self.manifest.medusa, self.tree)
        if method == "eagle":
            from .proposers.eagle import EagleProposer, head_runner

            spec, t = self.manifest.eagle, self.eagle_tree
            head = head_runner(self.eagle, spec, self.manifest.max_len, t, max_batch)
            return EagleProposer(head, t["topk"], t["depth"], t["nodes"], self.eagle_fc)
        return proposers.NoProposer()

    def new_core(self, config: CoreConfig, proposer=None, runners: dict | None = None) -> DecodeCore:
        """A decode core of ``config.max_batch`` slots built from this engine dir's parts: the target's
        runner, a proposer and a policy per method of ``config.method`` (``proposer`` replaces the first
        method's: tests), the stop rules and limits. ``runners`` maps a role to a (runner, PassCost)
        pair to reuse; the rest are made here (what ``specrt serve`` runs: runners of its own)."""
        methods = parse_methods(config.method)
        for method in methods:
            check_method(self.manifest, method)
        check_config(config, self.gamma_max)
        runners = dict(runners or {})
        for role in ("target", "draft") if "draft" in methods else ("target",):
            if role not in runners:
                runners[role] = self.runner(role, config.max_batch)
        target, target_cost = runners["target"]
        proposers = {m: self.proposer(m, config.max_batch, runners.get("draft"), config.suffix_corpus)
                     for m in methods}
        if proposer is not None:
            proposers[methods[0]] = proposer
        policies = {m: self._policy(m, p, config, target_cost, runners["draft"][1] if m == "draft" else PassCost(),
                                    target.packs) for m, p in proposers.items()}
        return DecodeCore(config, target, proposers, policies, StopRules(self.tokenizer, self.eos_ids),
                          Limits(self.manifest.max_len, self.gamma_max, self.target.spec.geometry.vocab_size))

    def _policy(self, method: str, proposer, config: CoreConfig, target_cost: PassCost, proposer_cost: PassCost,
                packs: bool = False) -> SpeculationPolicy:
        """The batch-aware γ policy of one method (the target's pass costs are shared by all of a core's);
        ``packs``: the target runner packs rows (``Runner.packs``)."""
        cap = self.manifest.defaults.get("speculation_max_batch")
        tree = (proposer.max_nodes + 1, proposer.depth) if proposer.tree else None
        drafts = method == "draft" or tree is not None
        return SpeculationPolicy(PolicyConfig(
            gamma_max=self.gamma_max, fixed_gamma=fixed_gamma(method, proposer, config.gamma),
            speculation_max_batch=int(cap) if cap is not None else None, probe_every=config.probe_every,
            draft_cost=drafts, tree=tree, probe=not proposer.shadow, packed=packs and not drafts),
            target_cost, proposer_cost)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles ``ConstraintSpec``s for this engine dir's tokenizer and vocabulary (made on first use;
        ``compile`` is thread-safe, for a server's worker threads). Building it reads the whole vocabulary (0.1 s
        for 4K tokens, ~1 s for 49K, more for 262K): a server may touch it at startup."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.spec.geometry.vocab_size,
                                                         self.eos_ids)
        return self._grammar_compiler

    def core(self, method: str, acceptance: str = "exact") -> DecodeCore:
        """The batch-1 decode core of ``method`` (made once; the target's cache and pass costs shared)."""
        key = (method, acceptance)
        if key not in self._cores:
            roles = ("target", "draft") if "draft" in parse_methods(method) else ("target",)
            for role in roles:
                if role not in self._shared:
                    self._shared[role] = self.runner(role, 1)
            self._cores[key] = self.new_core(CoreConfig(max_batch=1, method=method, acceptance=acceptance,
                                                        probe_every=8), runners={r: self._shared[r] for r in roles})
            self._forget_others(self._cores[key])  # its calibration wrote into the shared slot
        return self._cores[key]

    def _forget_others(self, core: DecodeCore) -> None:
        """``core`` writes the shared runners' slot: what the other batch-1 cores' prefix caches kept there is gone.
        (Each core keeps its own prompts between calls: a repeated prompt or a next chat turn on the same method
        skips the prefix its last call left; switching methods starts cold.)"""
        for other in self._cores.values():
            if other is not core:
                other.prefix.clear()

    # ---- public API -------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = None, method: str | None = None,
                 gamma: int | None = None, stop=(), stop_token_ids=(), acceptance: str = "exact",
                 constraint: ConstraintSpec | None = None, **penalties_and_logprobs) -> GenerationOutput:
        """Generate a continuation of ``prompt`` (a string or a list of token ids).

        ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logprobs``, ``logit_bias``
        ({token id: bias in [-100, 100]}) and ``min_tokens`` (keywords) are ``SamplingParams``'s; speculation
        stays exact with them. ``constraint``: a ``ConstraintSpec`` (JSON schema, regex, choice, grammar; or a
        ``Grammar`` compiled by ``grammar_compiler``) the output must follow, exact under speculation too;
        ``ConstraintError`` for one that does not compile. Example:
        ``rt.generate("Name: ", constraint=ConstraintSpec("regex", "[A-Z][a-z]+"), max_new_tokens=8)``.

        ``acceptance="typical"`` (method "medusa" only) opts into Medusa-2's typical acceptance:
        faster at temperature > 0 but LOSSY (the output no longer follows the target's distribution).
        """
        return self.stream(prompt, max_new_tokens, temperature, top_p, top_k, min_p, seed, method, gamma,
                           stop, stop_token_ids, acceptance, constraint, **penalties_and_logprobs).result()

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, seed: int | None = None, method: str | None = None,
               gamma: int | None = None, stop=(), stop_token_ids=(), acceptance: str = "exact",
               constraint: ConstraintSpec | None = None, **penalties_and_logprobs) -> Generation:
        """Like ``generate``, but returns a ``Generation`` that yields tokens as they are produced.

        Arguments are validated here, before anything runs.
        """
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
                                **_keywords(penalties_and_logprobs))
        method = self.resolve_method(method)
        if gamma is None:
            gamma = self.default_gamma  # the engine dir's defaults.gamma; None there too = adaptive
        elif not isinstance(gamma, int) or not 0 <= gamma <= self.gamma_max:
            raise SamplingError(f"gamma must be an integer in 0..{self.gamma_max} (the exported verify shape "
                                f"is {self.gamma_max + 1}) or None for the engine dir's default, got {gamma!r}")
        check_logit_bias(params.logit_bias, self.target.spec.geometry.vocab_size)
        ids = self.encode(prompt)
        grammar = self.grammar_compiler.compile(constraint) if isinstance(constraint, ConstraintSpec) else constraint
        if grammar is not None and not isinstance(grammar, Grammar):
            raise ConstraintError(f"constraint must be a ConstraintSpec (or a compiled Grammar), got "
                                  f"{type(constraint).__name__}")
        core = self.core(method, acceptance)
        self._requests += 1
        request = SequenceRequest(f"generate-{self._requests}", ids, params, gamma=gamma,  # γ None: adaptive
                                  grammar=grammar)
        generation = Generation(logprobs=params.logprobs is not None)
        generation.events = self._events(core, request, generation)
        return generation

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text as ``encode`` makes a prompt's (no special tokens added; ``encode_batch``), with
        no length check: corpora, data a caller sorts by length."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (text, or ids checked against the vocabulary). Text goes through
        ``encode_batch``, which releases the GIL (``encode`` holds it: a 10 MB prompt froze every other
        thread for 12 s), and a too-long one is refused before its ids are turned into Python ints."""
        if isinstance(prompt, str):
            encoding = self.tokenizer.encode_batch([prompt], add_special_tokens=False)[0]
            check_prompt_length(len(encoding), self.manifest.max_len)
            ids = encoding.ids
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(isinstance(int(t), int) for t in prompt):
            ids = [int(t) for t in prompt]
            vocab = self.target.spec.geometry.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        check_prompt_length(len(ids), self.manifest.max_len)
        return ids

    def resolve_method(self, method: str | None) -> str:
        return resolve_method(self.manifest, method)

    # ---- internals --------------------------------------------------------------------------
    def _events(self, core: DecodeCore, request: SequenceRequest, out: Generation):
        """Run ``request`` to its end on the batch-1 ``core``, yielding its events and filling in ``out``."""
        for other in self._cores.values():  # a stream abandoned before its end left its sequence behind
            for row in list(other.rows):  # (the batch-1 cores share the target's cache)
                other.remove(row.request.request_id)
        self._forget_others(core)
        rid = request.request_id
        runners = [r for r in (core.target, core.proposer.runner) if r is not None]
        t0, engine_s0 = time.perf_counter(), sum(r.engine_seconds for r in runners)
        update = core.add(request)
        while True:
            for event in update.events:
                if event.token_id is not None:
                    out.token_ids.append(event.token_id)
                    if out.logprobs is not None:
                        out.logprobs.append((event.logprob, event.top_logprobs))
                out.text += event.text
                yield event
            if update.finish_reason:
                break
            if [row.request.request_id for row in core.rows] != [rid]:
                raise RuntimeError("this generation was interrupted: another generate/stream ran on the same "
                                   "Runtime before it finished (a Runtime runs one sequence at a time)")
            update = core.step()[0][0]
        seconds, engine_s = time.perf_counter() - t0, sum(r.engine_seconds for r in runners) - engine_s0
        out.finish_reason = update.finish_reason
        out.stats = {**update.stats, "seconds": seconds, "tokens_per_second": len(update.token_ids) / seconds,
                     "engine_seconds": engine_s, "loop_overhead": max(0.0, 1 - engine_s / seconds)}


def runner_for_graph(engine, spec: GraphSpec, max_len: int, max_batch: int = 1, on_call=None, packs: bool = False,
                     decode_rows: int | None = None):
    """The runner of a target or draft graph described by a manifest ``GraphSpec``: an
    ``InPlaceRunner`` for a fused graph on ONNX Runtime, else a ``HostRunner``. ``packs``: its passes of chains may
    run packed (the target's verify passes; a draft's calls never do, so it opens no packed graph);
    ``decode_rows``: ``InPlaceRunner.for_graph``'s (a draft's is 1: its steps need not equal its own verify rows)."""
    if spec.kv_layout == "in_place" and getattr(engine, "session", None) is not None:
        return InPlaceRunner.for_graph(engine, spec, max_len, max_batch, on_call, packs, decode_rows)
    g = spec.geometry
    return HostRunner(engine, g.num_layers, g.num_kv_heads, g.head_dim, max_len, max_batch, NP_DTYPES[spec.dtype],
                      int(spec.shapes.get("prefill", 128)), on_call, spec.sliding_window)
