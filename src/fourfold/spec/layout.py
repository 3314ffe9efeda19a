"""The shape of the process grid and where each rank sits in it: pure arithmetic, no torch.

`Layout` is shared by the runtime (`fourfold.parallel.grid.Grid` builds process groups from it) and by the
planner (which only needs the arithmetic), so the placement rule is written once, here.

Placement: `order` lists the dims from innermost to outermost. The innermost dim varies fastest
with the global rank, so its groups are made of consecutive ranks (on a GPU cluster: the same
node). With the default order x, y, z, cp, dp, pp the ranks of an x group are r, r+1, ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

DIMS = ("dp", "pp", "cp", "x", "y", "z")
DEFAULT_ORDER = ("x", "y", "z", "cp", "dp", "pp")


class GridError(ValueError):
    """A grid that cannot be built as asked; the message says what to change."""


def _check_order(order: Iterable[str]) -> tuple[str, ...]:
    order = tuple(order)
    unknown = [d for d in order if d not in DIMS]
    if unknown:
        raise GridError(
            f"unknown dim {unknown[0]!r} in the placement order {','.join(order)}; "
            f"the dims are {','.join(DIMS)}"
        )
    repeated = sorted({d for d in order if order.count(d) > 1})
    if repeated:
        raise GridError(
            f"dim {repeated[0]!r} appears more than once in the placement order "
            f"{','.join(order)}; name each of {','.join(DIMS)} once"
        )
    # A partial order names the innermost dims; the rest follow in their default order.
    return order + tuple(d for d in DEFAULT_ORDER if d not in order)


@dataclass(frozen=True)
class Layout:
    """Sizes of the six grid dims and their placement order (innermost first).

    `ep`, expert parallelism, adds no ranks: it splits a mixture's experts over `ep` of the dp*cp
    ranks (consecutive members of the dp*cp group, innermost first, as the anchors take expert
    ranks from the data-parallel ones). Of the dp*cp ranks, the `ep` of an expert group exchange
    tokens; the dp*cp/ep holding the same experts (the expert replicas) sum their gradients."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    x: int = 1
    y: int = 1
    z: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    ep: int = 1

    def __post_init__(self) -> None:
        for dim in (*DIMS, "ep"):
            size = getattr(self, dim)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise GridError(f"{dim}={size!r} is not a valid size; every dim must be an integer >= 1")
        if (self.dp * self.cp) % self.ep:
            raise GridError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp} (expert ranks are taken from the "
                            f"data and context parallel ranks); choose ep from {_divisors(self.dp * self.cp)}")
        object.__setattr__(self, "order", _check_order(self.order))

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, order: str | Iterable[str] | None = None) -> "Layout":
        """Read the command-line form `dp=2,x=2,y=2` (dims left out are 1) and `x,y,z,cp,dp,pp`."""
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep:
                raise GridError(f"grid entry {item!r} has no '='; write the grid as e.g. dp=2,x=2,y=2")
            if name not in (*DIMS, "ep"):
                raise GridError(f"unknown dim {name!r} in grid {text!r}; the dims are {','.join(DIMS)} (and ep)")
            if name in sizes:
                raise GridError(f"dim {name!r} is given twice in grid {text!r}; give each dim once")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise GridError(f"{name}={value.strip()!r} in grid {text!r} is not an integer") from None
        if isinstance(order, str):
            order = [d.strip() for d in order.split(",") if d.strip()]
        return cls(**sizes, order=tuple(order) if order is not None else DEFAULT_ORDER)

    # ----- sizes ----------------------------------------------------------------------------
    @property
    def sizes(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in DIMS}

    @property
    def world_size(self) -> int:
        return math.prod(list(self.sizes.values()))

    def size(self, dims: str | Iterable[str]) -> int:
        return math.prod([getattr(self, d) for d in _as_dims(dims)])  # (a list: torch.compile traces it)

    @property
    def mesh_order(self) -> tuple[str, ...]:
        """Dims outermost first: the axis order of the rank array (row-major, last varies fastest)."""
        return tuple(reversed(self.order))

    def stride(self, dim: str) -> int:
        """Distance in global rank between neighbours along `dim`."""
        inner = self.order[: self.order.index(dim)]
        return math.prod([getattr(self, d) for d in inner])

    # ----- ranks and coordinates ------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        self._check_rank(rank)
        return {dim: (rank // self.stride(dim)) % getattr(self, dim) for dim in DIMS}

    def rank(self, coords: Mapping[str, int]) -> int:
        unknown = [d for d in coords if d not in DIMS]
        if unknown:
            raise GridError(f"unknown dim {unknown[0]!r}; the dims are {','.join(DIMS)}")
        rank = 0
        for dim in DIMS:
            c = coords.get(dim, 0)
            if not 0 <= c < getattr(self, dim):
                raise GridError(f"coordinate {dim}={c} is outside the grid ({dim} has size {getattr(self, dim)})")
            rank += c * self.stride(dim)
        return rank

    def group_ranks(self, dims: str | Iterable[str], rank: int) -> list[int]:
        """Global ranks of the group along `dims` that contains `rank`, in group-rank order.

        For several dims the group rank runs over them innermost first (as in `order`).
        """
        dims = sorted(_as_dims(dims), key=self.order.index)
        base = self.coords(rank)
        ranks = []
        for index in range(self.size(dims)):
            coords = dict(base)
            for dim in dims:
                coords[dim] = index % getattr(self, dim)
                index //= getattr(self, dim)
            ranks.append(self.rank(coords))
        return ranks

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} is outside a grid of {self.world_size} ranks")

    def __str__(self) -> str:
        dims = ",".join(f"{d}={getattr(self, d)}" for d in (*DIMS, "ep") if getattr(self, d) > 1) or "dp=1"
        return f"{dims} (order {','.join(self.order)})"


def grid_text(sizes: Mapping[str, int]) -> str:
    """"dp=2,x=2,ep=2": the dims (and ep) above 1 of a grid's sizes (a config's [grid], or
    `dict(layout.sizes, ep=layout.ep)`), as logs and messages name a grid."""
    return ",".join(f"{d}={sizes.get(d, 1)}" for d in (*DIMS, "ep") if sizes.get(d, 1) > 1) or "dp=1"


def factorisations(n: int, k: int = len(DIMS)) -> Iterator[tuple[int, ...]]:
    """Every ordered k-tuple of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorisations(n // d, k - 1):
                yield (d, *rest)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _as_dims(dims: str | Iterable[str]) -> tuple[str, ...]:
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    for d in dims:
        if d not in DIMS:
            raise GridError(f"unknown dim {d!r}; the dims are {','.join(DIMS)}")
    if len(set(dims)) != len(dims):
        raise GridError(f"dims {','.join(dims)} name one dim twice")
    return dims
