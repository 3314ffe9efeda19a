"""The training order's permutation: a bijection fixed by (seed, epoch), in constant memory."""

import tracemalloc

import numpy as np
import pytest

from fourfold.data.shuffle import Permutation

pytestmark = pytest.mark.torch_free


@pytest.mark.parametrize("n", [*range(1, 40), 255, 256, 257, 1000, 4097])
def test_every_element_once(n):
    for seed, epoch in ((0, 0), (7, 3)):
        order = Permutation(n, seed, epoch)[np.arange(n)]
        assert sorted(order.tolist()) == list(range(n))


def test_fixed_by_seed_and_epoch_and_the_same_at_any_position():
    n = 10_000
    whole = Permutation(n, 0, 0)[np.arange(n)]
    np.testing.assert_array_equal(Permutation(n, 0, 0)[[17, 3, 9_999]], whole[[17, 3, 9_999]])
    for other in (Permutation(n, 1, 0), Permutation(n, 0, 1)):
        assert (other[np.arange(n)] == whole).mean() < 0.01  # about 1/n of positions agree by chance


def test_the_order_is_shuffled():
    n = 100_000
    order = Permutation(n, 0, 0)[np.arange(n)]
    assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.02  # no trace of the identity
    neighbours = np.abs(np.diff(order))
    assert np.median(neighbours) > n / 5  # consecutive positions land far apart (about n/3.4 at random)
    assert abs(np.histogram(order[: n // 10], bins=10, range=(0, n))[0] / (n // 100) - 1).max() < 0.1


def test_a_trillion_token_corpus_takes_no_memory():
    windows = 10**12 // 8192  # 122M windows of 8,192 tokens: numpy's permutation would hold 0.98 GB
    tracemalloc.start()
    order = Permutation(windows, 0, 5)[np.arange(windows - 4096, windows)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20 and len(set(order.tolist())) == 4096 and order.min() >= 0 and order.max() < windows


def test_bad_positions_and_sizes_name_the_problem():
    with pytest.raises(IndexError, match=r"positions must be in \[0, 5\)"):
        Permutation(5, 0, 0)[[5]]
    with pytest.raises(ValueError, match="need at least one"):
        Permutation(0, 0, 0)
