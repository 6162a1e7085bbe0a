"""Fixtures every head's test module shares: each module defines ``trained`` (its target and head) and
``engine`` (their engine dir); these build on them."""
import pytest

import specrt
from specrt.export.hf_checkpoint import load_hf


@pytest.fixture(scope="module")
def rt(engine):
    return specrt.load(engine)


@pytest.fixture(scope="module")
def target_model(trained):
    return load_hf(trained["target"])
