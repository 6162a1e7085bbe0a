"""The methods (one proposer each) and the one rule for which method a request runs.

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


def resolve_method(manifest: Manifest, method: str | None) -> str:
    """The method a request runs (None: the engine dir's default, else draft if it has one, else
    ngram); SamplingError for an unknown one or one the engine dir lacks. Needs only the manifest."""
    if method is None:
        method = manifest.defaults.get("method") or ("draft" if manifest.draft else "ngram")
    check_method(manifest, method)
    return method


def check_method(manifest: Manifest, method: str) -> None:
    """SamplingError for an unknown method or one whose graphs the engine dir lacks."""
    if method not in METHODS:
        raise SamplingError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    present = {"draft": manifest.draft, "medusa": manifest.medusa, "eagle": manifest.eagle}
    if method in present and present[method] is None:
        raise SamplingError(f"method {method!r} needs an engine dir exported with --{method}")
