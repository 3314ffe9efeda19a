"""Which keys the load-balanced context-parallel ranks see: pure arithmetic on the chunk layout, shared
by the runtime's attention (`fourfold.parallel.context`) and the volume functions.

The sequence is cut into 2*cp chunks; cp rank i holds chunks i and 2cp-1-i. A block is a rank's
keys; a query sees the keys at or before it and, with a sliding window, less than `window` before.
"""

from __future__ import annotations

import bisect
import functools

BANDS = 8  # row bands of a masked block, each cut to the keys its documents, causality and window reach


def rank_positions(rank: int, ranks: int, seq: int) -> list[int]:
    """The global positions of the `seq` tokens cp rank `rank` of `ranks` holds (chunks rank and
    2*ranks-1-rank; all of them on one rank): increasing along the rank's tokens."""
    if ranks == 1:
        return list(range(seq))
    c = seq // 2
    return [*range(rank * c, (rank + 1) * c), *range((2 * ranks - 1 - rank) * c, (2 * ranks - rank) * c)]


def visible(rank: int, owner: int, seq: int) -> tuple[slice, slice, bool]:
    """(query rows, block keys, causal) of rank `owner`'s block for rank `rank`, each holding `seq`
    tokens. owner == rank: causal within (local positions increase, so it is the plain lower
    triangle); owner < rank: chunk owner precedes both of ours and chunk 2cp-1-owner follows both,
    so all our queries see the block's first half only; owner > rank: both its chunks follow our
    first and precede our second, so only our second half sees it, all of it. Masked parts are
    never computed: every rank does the same work per ring step."""
    half, everything = seq // 2, slice(None)
    if owner == rank:
        return everything, everything, True
    if owner < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def bands(rows: slice, seq: int, window: int) -> list[slice]:
    """A block's rows in up to BANDS bands, none longer than the window (a band then sees about two
    windows of keys, not the whole block)."""
    r0, r1 = rows.start or 0, seq if rows.stop is None else rows.stop
    size = -(-(r1 - r0) // BANDS)
    size = min(size, window) if window else size
    return [slice(a, min(a + size, r1)) for a in range(r0, r1, size)]


def position_reach(row_bands: list[slice], row_pos: list[int], key_pos: list[int], keys: slice,
                   window: int) -> list[tuple[int, int]]:
    """For each band, the (start, stop) of the keys (`keys` of the block, positions `key_pos`) at
    or before its last row and, with a window, within it of its first row (both positions increase)."""
    k0, k1 = keys.start or 0, len(key_pos) if keys.stop is None else keys.stop
    out = []
    for band in row_bands:
        first, last = row_pos[band.start], row_pos[band.stop - 1]
        start = max(k0, bisect.bisect_left(key_pos, first - window + 1)) if window else k0
        out.append((start, min(k1, bisect.bisect_right(key_pos, last))))
    return out


@functools.lru_cache(maxsize=256)
def window_reach(ranks: int, seq: int, window: int) -> tuple[tuple[int, ...], ...]:
    """For each cp rank, the ranks whose blocks its queries reach under a sliding `window`, its own
    first, then in ring order (rank, rank - 1, ...): the blocks a windowed attention fetches."""
    out = []
    for rank in range(ranks):
        reached = []
        for step in range(ranks):
            owner = (rank - step) % ranks
            rows, keys, _ = visible(rank, owner, seq)
            reach = position_reach(bands(rows, seq, window), rank_positions(rank, ranks, seq),
                                   rank_positions(owner, ranks, seq), keys, window)
            if any(a < b for a, b in reach):
                reached.append(owner)
        out.append(tuple(reached))
    return tuple(out)


def fetches_windows(ranks: int, seq: int, window: int) -> bool:
    """Whether windowed attention fetches the blocks it reaches (some rank reaches fewer than all)
    instead of passing every block round the ring."""
    return 0 < window < ranks * seq and ranks > 1 and any(len(r) < ranks for r in window_reach(ranks, seq, window))
