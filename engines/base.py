"""The one interface the runtime talks to: named numpy arrays in, named numpy arrays out."""
from __future__ import annotations

from typing import Protocol

import numpy as np


class EngineError(RuntimeError):
    """An engine dir or graph is unusable; the message names the problem and the file."""


class Engine(Protocol):
    """One graph. Backends: ``ort`` (ONNX Runtime); ``torch`` (reference) where available."""

    input_names: list[str]  # graph inputs, in graph order
    output_names: list[str]  # graph outputs, in graph order

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph once. ``feeds`` holds every input by name; returns every output by name."""
        ...
