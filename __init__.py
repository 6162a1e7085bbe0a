"""specrt: speculative decoding, exported and run.

    import specrt
    rt = specrt.load("engine_dir")
    out = rt.generate("def fib(n):", max_new_tokens=64, method="draft")
    print(out.text, out.stats)
"""
__version__ = "0.1.0"


def load(engine_dir, backend: str = "ort", **engine_options):
    """Load an engine dir (see docs/engine-format.md) and return a ready ``Runtime``."""
    from .runtime.runtime import Runtime

    return Runtime.load(engine_dir, backend=backend, **engine_options)


__all__ = ["load", "__version__"]
