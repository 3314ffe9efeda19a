"""Grid on real gloo ranks: DeviceMesh groups agree with the layout for every factorisation of 8."""

import time

import pytest
import torch
import torch.distributed as dist

from fourfold.parallel.grid import Grid
from fourfold.spec.layout import DIMS, GridError, Layout
from fourfold.testing import RankFailure
from grids import ALL_8, ORDERS

COMBINED = [("dp", "cp"), ("x", "y"), ("x", "y", "z")]


def _check_layouts(order, chunk):
    for sizes in ALL_8[chunk : chunk + CHUNK]:
        layout = Layout(**sizes, order=order)
        grid = Grid(layout)
        assert grid.coords == layout.coords(dist.get_rank())
        for dims in [(d,) for d in DIMS] + COMBINED:
            group = grid.group(dims)
            assert list(group.ranks) == layout.group_ranks(dims, grid.rank)
            # the process group really connects exactly those ranks
            t = torch.tensor([float(grid.rank)])
            dist.all_reduce(t, group=group.process_group)
            assert t.item() == sum(group.ranks)
    return True


# Each gloo group holds sockets to its peers until the world is torn down, so the 56 layouts
# are checked in chunks, each in a fresh world.
CHUNK = 14


@pytest.mark.parametrize("chunk", range(0, len(ALL_8), CHUNK))
@pytest.mark.parametrize("order", ORDERS, ids=lambda o: ",".join(o))
def test_groups_match_layout_for_every_factorisation(ranks, order, chunk):
    assert ranks.run(_check_layouts, 8, order, chunk) == [True] * 8


def _wrong_world_size():
    with pytest.raises(GridError) as err:
        Grid(Layout(dp=2, x=2))
    return str(err.value)


def test_product_must_equal_world_size(ranks):
    messages = ranks.run(_wrong_world_size, 8)
    assert "grid dp=2,x=2 (order x,y,z,cp,dp,pp) has 4 ranks but the job has 8" in messages[0]
    assert "product dp*pp*cp*x*y*z is 8" in messages[0]


def test_grid_needs_a_process_group():
    with pytest.raises(GridError, match="torch.distributed is not initialised; launch with torchrun"):
        Grid(Layout())


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


def test_harness_reports_the_failing_ranks_traceback(ranks):
    with pytest.raises(RankFailure) as err:
        ranks.run(_fail_on_rank_1, 2)
    assert "rank 1 of 2 failed" in str(err.value)
    assert "ValueError: boom on rank one" in str(err.value)
    assert ranks.run(dist_rank, 2) == [0, 1]  # the pool recovers


def dist_rank():
    return dist.get_rank()


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return True


def test_harness_kills_stragglers_after_timeout(ranks):
    saved = ranks.timeout_s
    ranks.timeout_s = 3
    try:
        with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish"):
            ranks.run(_hang_on_rank_0, 2)
    finally:
        ranks.timeout_s = saved
    assert ranks.run(dist_rank, 4) == [0, 1, 2, 3]  # the pool restarted
