"""probs() against a direct float64 reference; sampling validation and reproducibility."""
import numpy as np
import pytest

from reference import reference_probs
from specrt.runtime.sampling import SamplingError, SamplingParams, probs, sample


CASES = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(top_k=1),
         dict(top_p=0.9), dict(top_p=0.3, temperature=0.8), dict(top_p=1.0, top_k=0), dict(min_p=0.2),
         dict(top_k=50, top_p=0.95, min_p=0.05, temperature=0.9), dict(top_p=1e-6), dict(temperature=0.0),
         dict(temperature=0.0, top_k=3, top_p=0.5)]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("vocab", [7, 300, 32000])
def test_probs_match_reference(case, vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0, 3, size=(3, vocab)).astype(np.float32)
    case = {"temperature": 1.0, **case}
    got = probs(logits, SamplingParams(**case))
    want = reference_probs(logits, **case)
    np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(got.sum(-1), 1.0)


def test_ties_are_kept_together():
    logits = np.log(np.array([[0.3, 0.3, 0.2, 0.1, 0.1]]))
    # top_k=1 with a tie at the top keeps both tied tokens
    np.testing.assert_allclose(probs(logits, SamplingParams(temperature=1, top_k=1)), [[0.5, 0.5, 0, 0, 0]])
    # top_p=0.5: the tied pair has 0.6 >= 0.5; both kept
    np.testing.assert_allclose(probs(logits, SamplingParams(temperature=1, top_p=0.5)), [[0.5, 0.5, 0, 0, 0]])
    # top_p=0.85 reaches into the tied 0.1 pair: both kept
    np.testing.assert_allclose(probs(logits, SamplingParams(temperature=1, top_p=0.85)).round(12),
                               [[0.3, 0.3, 0.2, 0.1, 0.1]])
    # greedy breaks ties by the lowest id
    np.testing.assert_allclose(probs(logits, SamplingParams(temperature=0)), [[1, 0, 0, 0, 0]])


def test_top_p_partial_sort_exact_on_flat_tail():
    # the kept set is larger than the first candidate block (64): the growth loop must kick in
    logits = np.zeros((2, 32000))
    logits[0, :10] = 5.0
    got = probs(logits, SamplingParams(temperature=1, top_p=0.99))
    np.testing.assert_allclose(got, reference_probs(logits, top_p=0.99), atol=1e-12)


def test_low_temperature_tends_to_greedy():
    logits = np.array([[1.0, 2.0, 1.5]])
    np.testing.assert_allclose(probs(logits, SamplingParams(temperature=1e-4)), [[0, 1, 0]], atol=1e-12)


def test_seeded_sampling_reproducible():
    p = probs(np.random.default_rng(0).normal(size=(50, 100)), SamplingParams(temperature=1))
    a = sample(p, np.random.default_rng(7))
    b = sample(p, np.random.default_rng(7))
    c = sample(p, np.random.default_rng(8))
    assert (a == b).all() and (a != c).any()


def test_sample_never_picks_zero_probability():
    p = np.zeros((1000, 10))
    p[:, [2, 7]] = 0.5
    s = sample(p, np.random.default_rng(0))
    assert set(s.tolist()) == {2, 7}


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(top_k=1.5), dict(min_p=1.0),
                                 dict(min_p=-0.1), dict(max_new_tokens=0), dict(seed=-3)])
def test_invalid_params_rejected(bad):
    with pytest.raises(SamplingError):
        SamplingParams(**bad)
