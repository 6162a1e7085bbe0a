"""The demo engine for the structured-output server tests: its 4096-token BPE vocabulary writes JSON (the tiny
test engines' character vocabulary has no braces or quotes)."""
import pytest


@pytest.fixture(scope="session")
def demo_engine_dir():
    """The committed demo pair, exported once into the specrt cache (~/.cache/specrt, $SPECRT_CACHE)."""
    from specrt.tools.demo_engines import demo_engine_dir

    return demo_engine_dir(gamma=4, max_len=1024, log=lambda *_: None)
