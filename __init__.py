"""specrt: speculative decoding, exported and run.

    import specrt
    rt = specrt.load("engine_dir")
    out = rt.generate("def fib(n):", max_new_tokens=64, method="draft")
    print(out.text, out.stats)
"""
__version__ = "0.1.0"


def load(engine_dir, backend: str = "ort", **engine_options):
    """Load an engine dir (see docs/engine-format.md) and return a ready ``Runtime``."""
    from .runtime.api import Runtime

    return Runtime.load(engine_dir, backend=backend, **engine_options)


_ERRORS = {  # name -> module; imported on first use, so `import specrt` stays light
    "EngineError": "engines.base", "SamplingError": "runtime.sampling", "PromptTooLongError": "runtime.api",
    "TreeError": "trees", "ExportError": "export.errors", "ConstraintError": "runtime.constraints",
}


def __getattr__(name):
    """The error classes a caller may catch: ``except specrt.EngineError`` etc."""
    if name in _ERRORS:
        import importlib

        return getattr(importlib.import_module(f".{_ERRORS[name]}", __name__), name)
    raise AttributeError(f"module 'specrt' has no attribute {name!r}")


__all__ = ["load", "__version__", *_ERRORS]
