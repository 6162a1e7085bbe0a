"""The verification rules, directly: first-position emission distribution equals p."""
import numpy as np
import pytest

from specrt.runtime.verify import verify_greedy, verify_sampled
from stat_harness import P_MIN, chi2_p

N = 40000


def dists(seed, v=8, k=3):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.7), size=k + 1)  # [k+1, V]
    q = rng.dirichlet(np.full(v, 0.7), size=k)  # [k, V]
    return p, q


def first_emitted(p, q, deterministic: bool, seed=0):
    """Distribution of the token emitted at position 0 (accepted x_0, or the recovered token)."""
    rng = np.random.default_rng(seed)
    v = p.shape[1]
    counts = np.zeros(v)
    for _ in range(N):
        x = np.array([rng.choice(v, p=q[i]) for i in range(len(q))])
        n, nxt = verify_sampled(x, None if deterministic else q, p, rng)
        counts[x[0] if n > 0 else nxt] += 1
    return counts


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "point-mass"])
def test_first_token_follows_p(deterministic):
    p, q = dists(1)
    assert chi2_p(first_emitted(p, q, deterministic), p[0]) > P_MIN


def test_second_token_follows_p_given_first():
    """Conditionally on the first emitted token being the accepted x_0, the next follows p_1."""
    p, q = dists(2, v=5, k=2)
    rng = np.random.default_rng(0)
    counts = np.zeros(5)
    for _ in range(N):
        x = np.array([0, rng.choice(5, p=q[1])])  # condition: the proposal's first token is 0
        n, nxt = verify_sampled(x, q, p, rng)
        if n >= 1:
            counts[x[1] if n > 1 else nxt] += 1
    assert chi2_p(counts, p[1]) > P_MIN


def test_bonus_token_after_full_acceptance():
    p = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])  # p_0 is a point mass on 1: always accepted
    rng = np.random.default_rng(0)
    counts = np.zeros(3)
    for _ in range(20000):
        n, nxt = verify_sampled(np.array([1]), np.array([[0.0, 1.0, 0.0]]), p, rng)
        assert n == 1
        counts[nxt] += 1
    assert chi2_p(counts, p[1]) > P_MIN


def test_identical_p_q_accepts_everything():
    p, _ = dists(3)
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = np.array([rng.choice(8, p=p[i]) for i in range(3)])
        assert verify_sampled(x, p[:3], p, rng)[0] == 3


def test_greedy_rule():
    logits = np.array([[0, 5, 1], [2, 0, 1], [0, 0, 9], [1, 0, 0]], dtype=float)
    assert verify_greedy(np.array([1, 0, 2]), logits) == (3, 0)  # all accepted, bonus = argmax of last
    assert verify_greedy(np.array([1, 2, 2]), logits) == (1, 0)  # rejected at 1: emit argmax there
    assert verify_greedy(np.array([], dtype=int), logits[:1]) == (0, 1)
