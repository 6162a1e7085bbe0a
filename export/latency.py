"""The verification cost curve of a fused graph, measured at export time and kept in the manifest.

``models.<role>.latency`` (docs/engine-format.md): seconds of one call of Q new tokens after ``past``
cached ones, batch 1, for Q in ``QS`` (those that fit), the fastest of ``REPS`` calls after a warm-up,
on the exporting machine with ONNX Runtime's default threads and the kernels the runtime picks there
(``attention="auto"``: specrt's attention kernel and int4 matmul where they build, as ``specrt.load`` runs
the graph; which ran is recorded: ``ran_on``); and the ratios T(Q)/T(1). A few
calls per Q: a record of what the chosen quantization costs where it was exported (its kernels'
shape: docs/bench/verify-curve.md), not a benchmark; ``specrt profile`` measures the machine it runs
on and shows both.

Example::

    verify_curve(Path("engine/target.onnx"), max_len=2048)
    # {"q": [1, 2, 4, 5, 8, 16], "seconds": [...], "ratio": [1.0, 1.04, ...], "past": 128, "reps": 3,
    #  "ran_on": {"attention": "specrt", "matmul": "specrt"}, ...}
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np

QS = (1, 2, 4, 5, 8, 16)
PAST = 128  # cached tokens before each timed call (capped so that past + Q fits the cache)
REPS = 3  # timed calls per Q (after one warm-up); the fastest is kept


def verify_curve(path: Path, max_len: int, qs=QS, past: int = PAST, reps: int = REPS, threads: int | None = None,
                 extra_qs=()) -> dict:
    """T(Q) of the fused graph at ``path`` (see the module docstring); ``extra_qs``: Qs to add (the export's
    verify shapes)."""
    import onnxruntime as ort

    from ..engines.ort import OrtEngine
    from .fused_call import FusedCall

    qs = sorted({q for q in (*qs, *extra_qs) if 1 <= q < max_len})
    past = max(0, min(past, max_len - qs[-1]))
    engine = OrtEngine(path, threads=threads, attention="auto")  # what specrt.load runs
    call = FusedCall(engine, max_len)
    seconds = []
    for q in qs:
        ids = np.zeros(q, np.int64)
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            call.run(ids, past)
            if i:
                times.append(time.perf_counter() - t0)
        seconds.append(min(times))
    return {"q": qs, "seconds": [round(s, 7) for s in seconds], "ratio": [round(s / seconds[0], 3) for s in seconds],
            "past": past, "reps": reps, "threads": threads or "default", "machine": platform.machine(),
            "ran_on": {"attention": "specrt" if engine.session.specrt_attention else "ort",  # (OrtEngine.open sets both)
                       "matmul": "specrt" if engine.session.specrt_matmuls else "ort"},
            "cpu": cpu_name(), "onnxruntime": ort.__version__}


def cpu_name() -> str:
    """The CPU's model name (Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
