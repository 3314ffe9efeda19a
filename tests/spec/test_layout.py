"""The grid's arithmetic: coordinates and groups for every factorisation of 8 ranks (no processes)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fourfold.spec.layout import DIMS, GridError, Layout
from grids import ALL_8, ORDERS

pytestmark = pytest.mark.torch_free


def all_groups(layout, dims):
    """Every group along `dims`, each once (the runtime never lists them: each rank builds its own)."""
    return [list(g) for g in sorted({tuple(layout.group_ranks(dims, r)) for r in range(layout.world_size)})]


def test_there_are_56_factorisations_of_8():
    assert len(ALL_8) == 56  # C(3 + 5, 5): three factors of 2 over six dims


@given(sizes=st.sampled_from(ALL_8), order=st.permutations(DIMS))
@settings(max_examples=300, deadline=None)
def test_rank_coords_round_trip_and_groups_partition_the_world(sizes, order):
    layout = Layout(**sizes, order=tuple(order))
    assert layout.world_size == 8
    assert sorted(layout.rank(layout.coords(r)) for r in range(8)) == list(range(8))
    for dim in DIMS:
        groups = all_groups(layout, dim)
        assert sorted(r for g in groups for r in g) == list(range(8))  # a partition
        for group in groups:
            assert len(group) == sizes[dim]
            # members differ only along `dim`, and group rank = coordinate along `dim`
            coords = [layout.coords(r) for r in group]
            assert [c[dim] for c in coords] == list(range(sizes[dim]))
            for other in DIMS:
                if other != dim:
                    assert len({c[other] for c in coords}) == 1


@given(sizes=st.sampled_from(ALL_8), order=st.permutations(DIMS), data=st.data())
@settings(max_examples=200, deadline=None)
def test_combined_groups_are_products_of_their_dims(sizes, order, data):
    layout = Layout(**sizes, order=tuple(order))
    dims = data.draw(st.lists(st.sampled_from(DIMS), min_size=2, max_size=3, unique=True))
    for rank in range(8):
        group = layout.group_ranks(dims, rank)
        assert len(group) == layout.size(dims) and rank in group
        inner = min(dims, key=layout.order.index)
        # innermost dim first: the first size(inner) members form this rank's group along inner
        assert group[: sizes[inner]] == layout.group_ranks(inner, group[0])


@pytest.mark.parametrize("order", ORDERS)
def test_innermost_dim_is_consecutive_ranks(order):
    for sizes in ALL_8:
        layout = Layout(**sizes, order=order)
        inner = next(d for d in order if sizes[d] > 1)
        for group in all_groups(layout, inner):
            assert group == list(range(group[0], group[0] + len(group)))


def test_default_placement_example():
    layout = Layout(dp=2, x=2, y=2)
    assert layout.coords(5) == {"dp": 1, "pp": 0, "cp": 0, "x": 1, "y": 0, "z": 0}
    assert layout.group_ranks("x", 5) == [4, 5]
    assert layout.group_ranks("y", 5) == [5, 7]
    assert layout.group_ranks("dp", 5) == [1, 5]
    assert layout.group_ranks(("dp", "cp"), 5) == [1, 5]


def test_parse_reads_the_command_line_form():
    assert Layout.parse("dp=2,x=2,y=2") == Layout(dp=2, x=2, y=2)
    assert Layout.parse(" pp=2 , z=4 ", order="z,pp") == Layout(pp=2, z=4, order=("z", "pp", "x", "y", "cp", "dp"))
    assert Layout.parse("").world_size == 1
    assert str(Layout.parse("dp=2,x=4")) == "dp=2,x=4 (order x,y,z,cp,dp,pp)"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Layout(x=0), "x=0 is not a valid size; every dim must be an integer >= 1"),
        (lambda: Layout(dp=-2), "dp=-2 is not a valid size"),
        (lambda: Layout(y=1.5), "y=1.5 is not a valid size"),
        (lambda: Layout(order=("x", "w")), "unknown dim 'w' in the placement order x,w; the dims are dp,pp,cp,x,y,z"),
        (lambda: Layout(order=("x", "y", "x")), "dim 'x' appears more than once in the placement order x,y,x"),
        (lambda: Layout.parse("dp=2,q=2"), "unknown dim 'q' in grid 'dp=2,q=2'"),
        (lambda: Layout.parse("dp=2,dp=4"), "dim 'dp' is given twice"),
        (lambda: Layout.parse("dp2"), "grid entry 'dp2' has no '='; write the grid as e.g. dp=2,x=2,y=2"),
        (lambda: Layout.parse("x=two"), "x='two' in grid 'x=two' is not an integer"),
        (lambda: Layout(x=2).coords(2), "rank 2 is outside a grid of 2 ranks"),
        (lambda: Layout(x=2).rank({"x": 2}), "coordinate x=2 is outside the grid (x has size 2)"),
    ],
)
def test_errors_say_what_to_change(make, message):
    with pytest.raises(GridError) as err:
        make()
    assert message in str(err.value)


def test_every_order_permutation_is_accepted():
    for order in itertools.permutations(DIMS):
        assert Layout(x=2, order=order).order == order
