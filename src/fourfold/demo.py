"""The main job on an embedded default; it grows as fourfold does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fourfold import comm
from fourfold.grid import Grid, init_process_group
from fourfold.layout import DIMS, Layout


def run_demo(layout: Layout) -> None:
    init_process_group()
    grid = Grid(layout)
    if grid.rank == 0:
        print(f"fourfold demo on {layout.world_size} ranks, grid {layout}")
    # One all-reduce per grid dim: each group sums its members' ranks.
    for dim in DIMS:
        t = torch.tensor([float(grid.rank)])
        comm.all_reduce(t, grid.group(dim))
        assert t.item() == sum(grid.group(dim).ranks)
    shard = comm.reduce_scatter(torch.ones(1024 * layout.size(("dp", "cp"))), grid.group(("dp", "cp")))
    assert torch.all(shard == layout.size(("dp", "cp")))
    if grid.rank == 0:
        print("communication ledger of rank 0:")
        print(grid.ledger.table())
    dist.destroy_process_group()
