"""Benchmarks: `specrt bench plain|spec` (spec.py) and the `python -m specrt.tools.bench.NAME` scripts."""
