"""``specrt.load(engine_dir)`` returns a ``Runtime``: generate / stream over an engine dir."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..engines import EngineError, open_engine
from ..engines.manifest import Manifest, load_manifest
from .decode import DecodeStats, calibrate, decode_plain, speculative_decode
from .decode_tree import ACCEPTANCE, TreeStats, calibrate_tree, tree_speculative_decode, tree_stats
from .gamma import GammaController, predicted_speedup
from .model import CachedModel
from .medusa import MedusaProposer, check_tree_fits
from .proposers import DraftModelProposer, NGramProposer
from .sampling import SamplingError, SamplingParams
from .text import IncrementalDetokenizer, StopMatcher
from .tree import compile_tree, load_tree

METHODS = ("none", "draft", "ngram", "medusa", "eagle")


class PromptTooLongError(ValueError):
    pass


@dataclass
class StreamEvent:
    token_id: int | None  # the token produced; None for a final text-only flush event
    text: str  # text this token made final ("" while a multi-byte char or possible stop string is held)


@dataclass
class GenerationOutput:
    token_ids: list  # generated token ids (an EOS or stop token included; prompt excluded)
    text: str  # decoded generated text, stop string excluded
    finish_reason: str  # "stop" (EOS, stop token or stop string) | "length" (max_new_tokens or cache full)
    stats: dict = field(default_factory=dict)  # see Runtime.stats_for


class Generation:
    """An in-progress generation: iterate it for ``StreamEvent``s; afterwards read
    ``token_ids``, ``text``, ``finish_reason`` and ``stats``."""

    def __init__(self, events, holder: dict):
        self._events = events
        self._holder = holder

    def __iter__(self):
        return self._events

    def __getattr__(self, name):
        if name in ("token_ids", "text", "finish_reason", "stats"):
            return self._holder[name]
        raise AttributeError(name)

    def result(self) -> GenerationOutput:
        for _ in self._events:
            pass
        h = self._holder
        return GenerationOutput(h["token_ids"], h["text"], h["finish_reason"], h["stats"])


class Runtime:
    """An engine dir, loaded: tokenizer, target (and draft) graphs with their KV caches.

    One sequence at a time (batch 1); not thread-safe: a server drives it from one worker.
    """

    def __init__(self, manifest: Manifest, target: CachedModel, draft: CachedModel | None, tokenizer,
                 medusa=None, eagle=None):
        self.manifest = manifest
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_ids = set(manifest.eos_token_ids)
        self.gamma_max = manifest.gamma
        self.default_gamma = self._default_gamma(manifest)  # defaults.gamma: used when a caller passes None
        self.calibrated = False
        self.alpha_state: dict = {}  # method -> α evidence carried across requests (GammaController.state)
        self.medusa = medusa  # Engine of the Medusa heads graph, if the engine dir has one
        tree = manifest.medusa.tree if manifest.medusa else None
        self.tree = compile_tree(tree["choices"], tree["name"]) if tree else None  # tree used by method "medusa"
        self.tree_calibrated = False
        self.eagle = eagle  # Engine of the EAGLE head graph, if the engine dir has one
        self.eagle_tree = dict(manifest.eagle.tree) if manifest.eagle else None  # {"nodes", "depth", "topk"}

    def _default_gamma(self, manifest: Manifest) -> int | None:
        """The manifest's ``defaults.gamma`` (e.g. written by `specrt profile --write-defaults`); None = adaptive."""
        g = manifest.defaults.get("gamma")
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= manifest.gamma):
            raise EngineError(f"manifest.json: defaults.gamma must be null (adaptive) or an integer in "
                              f"0..{manifest.gamma} (the exported gamma), got {g!r}")
        return g

    @classmethod
    def load(cls, engine_dir: str | Path, backend: str = "ort", **engine_options) -> "Runtime":
        from tokenizers import Tokenizer

        m = load_manifest(engine_dir)
        models = {}
        for role, spec in m.graphs.items():
            options = dict(engine_options)
            if backend == "ort" and role == "draft" and "threads" not in options:
                # one intra-op thread: a draft step is too small to gain from a pool, and a pool's
                # spinning threads compete with the target's (measured on the 2-core demo: draft
                # decoding 1.3-1.5x faster than with the default pool; plain decoding unchanged)
                options["threads"] = 1
            engine = open_engine(m.root / spec.file, backend=backend, **options)
            expected = [i["name"] for i in spec.inputs]
            if list(engine.input_names) != expected:
                raise EngineError(f"{spec.file}: graph inputs {engine.input_names[:4]}... do not match "
                                  f"the manifest ({expected[:4]}...): the engine dir is inconsistent")
            models[role] = CachedModel(engine, spec, m.max_len)
        tok = Tokenizer.from_file(str(m.tokenizer_dir / "tokenizer.json"))
        medusa = open_engine(m.root / m.medusa.file, backend=backend, **engine_options) if m.medusa else None
        eagle = open_engine(m.root / m.eagle.file, backend=backend, **engine_options) if m.eagle else None
        return cls(m, models["target"], models.get("draft"), tok, medusa=medusa, eagle=eagle)

    def use_tree(self, tree) -> None:
        """Use another candidate tree (a default name, a JSON file, a list of paths or a ``Tree``) for
        method "medusa"; it must fit the exported tree-verify shape and the heads."""
        if self.manifest.medusa is None:
            raise SamplingError("this engine dir has no Medusa heads: export with --medusa")
        tree = load_tree(tree)
        check_tree_fits(tree, self.manifest.medusa)
        self.tree, self.tree_calibrated = tree, False

    # ---- public API -------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = None, method: str | None = None,
                 gamma: int | None = None, stop=(), stop_token_ids=(), acceptance: str = "exact") -> GenerationOutput:
        """Generate a continuation of ``prompt`` (a string or a list of token ids).

        ``acceptance="typical"`` (method "medusa" only) opts into Medusa-2's typical acceptance:
        faster at temperature > 0 but LOSSY (the output no longer follows the target's distribution).
        """
        return self.stream(prompt, max_new_tokens, temperature, top_p, top_k, min_p, seed, method, gamma,
                           stop, stop_token_ids, acceptance).result()

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, seed: int | None = None, method: str | None = None,
               gamma: int | None = None, stop=(), stop_token_ids=(), acceptance: str = "exact") -> Generation:
        """Like ``generate``, but returns a ``Generation`` that yields tokens as they are produced.

        Arguments are validated here, before anything runs.
        """
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids)
        method = self.resolve_method(method)
        if acceptance not in ACCEPTANCE or (acceptance != "exact" and method != "medusa"):
            raise SamplingError(f"acceptance must be one of {', '.join(ACCEPTANCE)} ('typical' is lossy and only for "
                                f"method 'medusa'), got {acceptance!r} with method {method!r}")
        if gamma is None:
            gamma = self.default_gamma  # the engine dir's defaults.gamma; None there too = adaptive
        elif not isinstance(gamma, int) or not 0 <= gamma <= self.gamma_max:
            raise SamplingError(f"gamma must be an integer in 0..{self.gamma_max} (the exported verify shape "
                                f"is {self.gamma_max + 1}) or None for the engine dir's default, got {gamma!r}")
        ids = self.encode(prompt)
        holder: dict = {"token_ids": [], "text": "", "finish_reason": None, "stats": {}}
        return Generation(self._events(ids, params, method, gamma, holder, acceptance), holder)

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
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
        if len(ids) >= self.manifest.max_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the engine's cache holds max_len="
                                     f"{self.manifest.max_len} tokens in all, so at most {self.manifest.max_len - 1}")
        return ids

    def resolve_method(self, method: str | None) -> str:
        if method is None:
            method = self.manifest.defaults.get("method") or ("draft" if self.draft else "ngram")
        if method not in METHODS:
            raise SamplingError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
        if method == "draft" and self.draft is None:
            raise SamplingError("method 'draft' needs an engine dir exported with --draft")
        if method == "medusa" and self.medusa is None:
            raise SamplingError("method 'medusa' needs an engine dir exported with --medusa")
        if method == "eagle" and self.eagle is None:
            raise SamplingError("method 'eagle' needs an engine dir exported with --eagle")
        return method

    # ---- internals --------------------------------------------------------------------
    def cost(self, gamma: int, proposer) -> tuple[float, float]:
        """Measured (c, T(γ+1)/T(1)) on this machine."""
        lat = self.target.latency
        t1 = lat.get(1) or 1e-9
        step = proposer.step_seconds if proposer.step_seconds is not None else self.draft.latency.get(1, 0.0)
        tq = lat.get(gamma + 1)
        if tq is None:  # not measured: interpolate linearly between the nearest measured shapes
            qs = sorted(lat)
            tq = float(np.interp(gamma + 1, qs, [lat[q] for q in qs]))
        return step / t1, tq / t1

    def _events(self, ids, params: SamplingParams, method: str, gamma, holder, acceptance: str = "exact"):
        rng = np.random.default_rng(params.seed)
        stops = StopMatcher(params.stop)
        detok = IncrementalDetokenizer(self.tokenizer)
        out: list[int] = holder["token_ids"]
        end_ids = self.eos_ids | set(params.stop_token_ids)
        limit = min(params.max_new_tokens, self.manifest.max_len - len(ids))
        steps, proposer, controller, stats = self._start_decoder(method, ids, params, rng, gamma, acceptance,
                                                                 budget=lambda: limit - len(out))
        t0, engine_s0 = time.perf_counter(), self._engine_seconds()
        finish = None
        for new in steps:
            for tok in new:
                out.append(tok)
                if tok in end_ids:
                    finish = "stop"
                    yield StreamEvent(tok, "")
                    break
                text = stops.feed(detok.add(tok))
                holder["text"] += text
                finish = "stop" if stops.hit else ("length" if len(out) >= limit else None)
                yield StreamEvent(tok, text)
                if finish:
                    break
            if finish:
                break
        tail = stops.flush(detok.flush())
        if tail:
            holder["text"] += tail
            yield StreamEvent(None, tail)
        holder["finish_reason"] = finish
        if controller is not None:
            self.alpha_state[method] = controller.export_state()
        holder["stats"] = self.stats_for(stats, out, method, controller, proposer, time.perf_counter() - t0,
                                         self._engine_seconds() - engine_s0)

    def _start_decoder(self, method: str, ids, params: SamplingParams, rng, gamma, acceptance: str, budget):
        """The decode generator for ``method`` (plus its proposer, γ controller and stats object)."""
        proposer = controller = None
        stats = DecodeStats()
        if method in ("draft", "ngram") and not (self.calibrated and (method != "draft" or 1 in self.draft.latency)):
            self._calibrate(ids, with_draft=method == "draft")
        self.target.reset()
        if method == "medusa":
            proposer = MedusaProposer(self.medusa, self.manifest.medusa, self.tree)
            if not self.tree_calibrated:
                self.target.prefill(ids)
                calibrate_tree(self.target, proposer, ids[-1])
                self.target.reset()
                self.tree_calibrated = True
            stats = TreeStats(acceptance=acceptance, lossy=acceptance == "typical" and not params.greedy)
            steps = tree_speculative_decode(self.target, proposer, self.tree, ids, params, rng, stats,
                                            budget=budget, acceptance=acceptance)
        elif method == "eagle":
            from .eagle import EagleDrafter, EagleHeadModel, EagleStats, eagle_decode

            t = self.eagle_tree
            head = EagleHeadModel(self.eagle, self.manifest.eagle, self.manifest.max_len + (t["depth"] + 1) * t["topk"])
            proposer = EagleDrafter(head, t["topk"], t["depth"], t["nodes"])
            stats = EagleStats()
            steps = eagle_decode(self.target, proposer, ids, params, rng, stats, budget=budget)
        elif method != "none":
            proposer = DraftModelProposer(self.draft) if method == "draft" else NGramProposer()
            proposer.reset(ids)
            controller = GammaController(self.gamma_max, fixed=gamma, state=self.alpha_state.get(method))
            steps = speculative_decode(self.target, proposer, controller, ids, params, rng, stats,
                                       budget=budget, cost=lambda g: self.cost(g, proposer))
        else:
            steps = decode_plain(self.target, ids, params, rng, stats)
        return steps, proposer, controller, stats

    def _calibrate(self, ids, with_draft: bool) -> None:
        """Measure T(q) for q = 1..γmax+1 (and a draft step) once, on this prompt's cache."""
        self.target.reset()
        self.target.prefill(ids)
        if with_draft:
            self.draft.reset()
            self.draft.prefill(ids)
        calibrate(self.target, self.draft if with_draft else None, self.gamma_max, ids[-1])
        self.calibrated = True

    def _engine_seconds(self) -> float:
        return self.target.engine_seconds + (self.draft.engine_seconds if self.draft else 0.0)

    def stats_for(self, s: DecodeStats, out, method, controller, proposer, seconds, engine_seconds) -> dict:
        n = len(out)
        alpha = s.alpha
        stats = {"method": method, "new_tokens": n, "target_passes": s.target_passes,
                 "seconds": seconds, "tokens_per_second": n / seconds if seconds > 0 else 0.0,
                 "engine_seconds": engine_seconds,
                 "loop_overhead": max(0.0, 1 - engine_seconds / seconds) if seconds > 0 else 0.0}
        if method == "medusa":
            stats.update(tree_stats(s, self.target.latency, proposer))
        elif method == "eagle":
            from .eagle import eagle_stats

            stats.update(eagle_stats(s, self.target.latency, proposer))
        elif method != "none":
            rounds = max(s.rounds, 1)
            c, _ = self.cost(1, proposer)
            mean_k = s.proposed / rounds
            stats.update({
                "proposed": s.proposed, "accepted": s.accepted,
                "acceptance_rate": s.accepted / s.proposed if s.proposed else 0.0, "alpha": alpha,
                "rejections": s.rejections,
                "rounds": s.rounds, "tokens_per_pass": (s.accepted + s.rounds) / rounds,
                "draft_passes": proposer.passes if method == "draft" else 0,
                "c": c, "verify_ratio": self.cost(self.gamma_max, proposer)[1],
                "predicted_speedup": s.predicted_speedup(alpha, lambda g: self.cost(g, proposer)),
                "predicted_speedup_reference_formula": predicted_speedup(alpha, round(mean_k), c),
                "gamma_history": controller.history, "alpha_estimate": controller.alpha,
            })
        return stats
