"""A seeded permutation of range(n), evaluated position by position in constant memory.

The training order of a corpus's windows is fixed by (seed, epoch), the same on every rank, and
a resumed run must find any step's windows. numpy's `permutation(n)` would hold 8 bytes per
window on every rank: about 1 GiB a rank (8 GiB an 8-GPU node) for 10^12 tokens in 8,192-token
windows. `Permutation` computes each position's window instead: a balanced Feistel network on
the smallest even number of bits that holds n (a bijection of [0, 2^bits)), walking on from any
output >= n until it lands below n (cycle walking, which keeps it a bijection of [0, n); the
domain is under 4n, so a few walks at most on average). Each round mixes with splitmix64.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6  # Feistel rounds: 4 already make a pseudo-random permutation; 2 more for good measure
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """`Permutation(n, seed, epoch)[positions]`: the elements of range(n) at those positions of
    a pseudo-random order fixed by (seed, epoch)."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements: need at least one")
        self.n = n
        self._half = np.uint64((max(2, (n - 1).bit_length()) + 1) // 2)
        self._mask = np.uint64((1 << int(self._half)) - 1)
        self._keys = np.random.Generator(np.random.PCG64([seed, epoch])).integers(
            0, np.iinfo(np.uint64).max, size=ROUNDS, dtype=np.uint64, endpoint=True)

    def _feistel(self, i: np.ndarray) -> np.ndarray:
        left, right = i >> self._half, i & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __getitem__(self, positions) -> np.ndarray:
        i = np.array(positions, dtype=np.int64, ndmin=1)
        if i.size and (i.min() < 0 or i.max() >= self.n):
            raise IndexError(f"positions must be in [0, {self.n})")
        out = self._feistel(i.astype(np.uint64))
        while (away := out >= self.n).any():
            out[away] = self._feistel(out[away])
        return out.astype(np.int64)
