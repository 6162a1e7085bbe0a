"""The methods (one proposer each), the one rule for which methods a core serves and a request runs,
and how a core that serves several keeps them apart.

    none    plain decoding through the same core      ngram   prompt lookup (n-gram match)
    draft   a small draft model (exported beside it)  suffix  suffix tree over prompt, output, past outputs
    medusa  Medusa heads and a candidate tree          eagle   an EAGLE-1/2/3 head and a dynamic tree
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .sampling import SamplingError

if TYPE_CHECKING:  # the CLI imports METHODS: keep this module free of ONNX Runtime
    from ..engines.manifest import Manifest

METHODS = ("none", "draft", "ngram", "suffix", "medusa", "eagle")


def parse_methods(method) -> tuple[str, ...]:
    """The methods a core serves, the first a request's default: "draft", "draft,ngram" or a tuple / list of
    names -> ("draft",), ("draft", "ngram"); SamplingError for an empty or unknown one (duplicates dropped)."""
    names = method.split(",") if isinstance(method, str) else list(method) if isinstance(method, (list, tuple)) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise SamplingError(f"method must be a name, a comma-separated list or a tuple of names, got {method!r}")
    out = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    for name in out:
        if name not in METHODS:
            raise SamplingError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    if not out:
        raise SamplingError(f"no method named in {method!r}; available: {', '.join(METHODS)}")
    return out


def resolve_method(manifest: Manifest, method) -> str:
    """The method(s) a core or request runs (None: the engine dir's default, else draft if it has one, else
    ngram; several: "draft,ngram" or a tuple, returned as "draft,ngram"); SamplingError for an unknown one or
    one the engine dir lacks. Needs only the manifest."""
    if method is None:
        method = manifest.defaults.get("method") or ("draft" if manifest.draft else "ngram")
    names = parse_methods(method)
    for name in names:
        check_method(manifest, name)
    return ",".join(names)


def check_method(manifest: Manifest, method: str) -> None:
    """SamplingError for an unknown method or one whose graphs the engine dir lacks."""
    if method not in METHODS:
        raise SamplingError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    present = {"draft": manifest.draft, "medusa": manifest.medusa, "eagle": manifest.eagle}
    if method in present and present[method] is None:
        raise SamplingError(f"method {method!r} needs an engine dir exported with --{method}")


# ---- a core serving several methods (runtime/core.py) ---------------------------------------------
def fixed_gamma(method: str, proposer, gamma: int | None) -> int | None:
    """The policy's fixed γ for a requested γ (None: the policy decides): 0 for method "none"; a tree
    method has one speculative choice, its whole tree: γ >= 1 means "always verify the tree", 0 "never"."""
    if method == "none":
        return 0
    return min(gamma, 1) if gamma is not None and proposer.tree else gamma


def by_method(parts, methods: tuple, none=None) -> dict:
    """method -> part (proposer or policy) for each of ``methods`` from a dict, or a single part standing for
    the first; "none" gets ``none`` where it has no part and ``none`` is given."""
    given = dict(parts) if isinstance(parts, dict) else {methods[0]: parts}
    missing = [m for m in methods if m not in given and not (m == "none" and none is not None)]
    if missing:
        raise ValueError(f"no proposer / policy given for method(s) {', '.join(missing)}")
    out = {m: given[m] for m in methods if m in given}
    if none is not None and "none" not in out:
        out["none"] = given.get("none", none)
    return out


def target_feature(proposers: dict) -> str | None:
    """The target output the core's proposers read at prefill and after each pass (None: none)."""
    features = sorted({p.feature for p in proposers.values() if p.feature is not None})
    if len(features) > 1:
        raise SamplingError(f"methods reading different target outputs ({', '.join(features)}) cannot share a core")
    return features[0] if features else None


def cache_owner(proposers: dict, default):
    """The one proposer whose model cache moves slot for slot with the target's (runtime/prefix_cache.py);
    ``default`` when none has a cache. SamplingError for two (the prefix cache follows one proposer cache)."""
    owners = [m for m, p in proposers.items() if p.runner is not None]
    if len(owners) > 1:
        raise SamplingError(f"methods {' and '.join(owners)} each keep a model cache of their own; one core serves "
                            "at most one such method")
    return proposers[owners[0]] if owners else default
