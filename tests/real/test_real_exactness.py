"""SmolLM2-135M-Instruct: sampled speculative output follows the target's distribution exactly (chi-square).

The harness of tests/stat_harness.py on the real vocabulary (49,152), paths binned as binned_harness.py
states (the K = 4 most probable tokens per node kept, the tail of each node in one bin, every bin's
probability exact): n-gram decoding at a fixed γ = 3 on the fp32 engine, at T = 1 and at T = 0.8 with
top-p 0.9, against the graph's own distribution. The prompt lists pets, then starts the list again up to
"dog": after the "," the model picks the next pet, n-gram proposes " fish" (what followed last time), and the
model takes it about a third of the time (measured at T = 1: a proposal in ~95% of the trials, ~33% of them
accepted), so acceptance, rejection with a residual sample and the bonus token all occur. As in the
harness, a trial generates 3 tokens: after the first (from the prefill) 2 are left, so a round verifies one
proposed token and a bonus (γ = 3 is capped there). A check fails below P_MIN = 1e-4, the harness's
false-failure rate.

The same harness must FAIL a wrong verifier on this model (resampling from p after a rejection instead of
from the residual): the binning keeps the harness's power.
"""
import numpy as np
import pytest

from binned_harness import P_MIN, binned_p_values, path_bins, sample_paths
from specrt.runtime import verify
from specrt.runtime.sampling import sample

pytestmark = pytest.mark.real

TRIALS = 600
WRONG_RULE_TRIALS = 300  # its bias is large: " fish" emitted with p + (1 - p) p instead of p (measured p ~ 1e-11)
GAMMA = 3
PROMPT = "Pets: cat, dog, fish. Pets: cat, dog"


@pytest.fixture(scope="module")
def rt(smollm2_rt):
    return smollm2_rt("fp32")


@pytest.fixture(scope="module")
def prompt(rt) -> list[int]:
    return rt.encode(PROMPT)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)], ids=str)
def test_ngram_is_exact(rt, prompt, sampling):
    bins = path_bins(rt, prompt, sampling)
    paths, totals = sample_paths(rt, prompt, TRIALS, "ngram", GAMMA, **sampling)
    pv = binned_p_values(bins, paths)
    assert min(pv.values()) > P_MIN, pv
    assert totals["proposed"] > TRIALS / 2 and 0 < totals["accepted"] < totals["proposed"], totals


def resample_from_p_rule(tokens, q, p, rng):
    """WRONG: the right acceptance test, but on rejection sample from p instead of the residual."""
    x = np.asarray(tokens)
    q_x = q[np.arange(len(x)), x] if q is not None else np.ones(len(x))
    accept = rng.random(len(x)) * q_x < p[np.arange(len(x)), x]
    n = int(np.argmin(accept)) if not accept.all() else len(x)
    return n, int(sample(p[n][None], rng)[0])


def test_harness_fails_a_wrong_rule(rt, prompt, monkeypatch):
    monkeypatch.setattr(verify, "verify_sampled", resample_from_p_rule)
    sampling = dict(temperature=1.0)
    pv = binned_p_values(path_bins(rt, prompt, sampling), sample_paths(rt, prompt, WRONG_RULE_TRIALS, "ngram",
                                                                       GAMMA, **sampling)[0])
    assert min(pv.values()) < P_MIN, pv
