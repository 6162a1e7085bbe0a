import doctest

import numpy as np

from specrt.runtime.proposers import ngram
from specrt.runtime.proposers.ngram import NGramIndex, find_continuation


def test_docstring_example():
    assert doctest.testmod(ngram).failed == 0


def test_index_equals_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    for trial in range(200):
        toks = rng.integers(0, 4, size=rng.integers(1, 60)).tolist()
        idx = NGramIndex(max_n=3, min_n=1)
        pos = 0
        while pos < len(toks):  # extend in random chunk sizes, as rounds do
            step = int(rng.integers(1, 5))
            idx.extend(toks[pos : pos + step])
            pos += step
            k = int(rng.integers(1, 6))
            assert idx.match(k)[0] == find_continuation(toks[:pos], k, max_n=3, min_n=1)


def test_no_match_and_prefers_longest():
    assert find_continuation([1, 2, 3], k=2) == []
    # suffix [1, 2]: longest match wins over the more recent [2]
    assert find_continuation([1, 2, 9, 5, 2, 7, 1, 2], k=1, max_n=2) == [9]


def test_a_proposal_s_kind_is_the_length_of_its_match():
    """The decode core prices an n-gram chain by what guesses of its match length realized (gamma.KindAlphas)."""
    from types import SimpleNamespace

    idx = NGramIndex(max_n=3)
    idx.extend([5, 1, 2, 3, 9, 1, 2])
    assert idx.match(3) == ([3, 9, 1], 2)
    idx.extend([4])
    assert idx.match(2) == ([], 0)
    proposer = ngram.NGramProposer(max_n=3)
    row = SimpleNamespace(request=SimpleNamespace(request_id="r"), seq=[7, 8, 9, 7, 8, 9, 7, 8])
    proposer.start(row, None)
    p = proposer.propose([row], [2])[0]
    assert p.tokens.tolist() == [9, 7] and p.kind == 3
