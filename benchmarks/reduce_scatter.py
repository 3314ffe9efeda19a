"""gloo reduce-scatter: torch's reduce_scatter_tensor against fourfold's all-to-all + local sum.

Run: torchrun --standalone --nproc-per-node 8 benchmarks/reduce_scatter.py [--mib 16] [--repeat 5]
"""

import argparse

import torch
import torch.distributed as dist

from fourfold.parallel import comm
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.spec.layout import Layout
from timing import best_time  # benchmarks/timing.py, beside this file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    init_process_group()
    world = dist.get_world_size()
    group = Grid(Layout(x=world)).group("x")
    n = int(args.mib * 2**20 / 4) // world * world
    full = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = torch.empty(n // world)
    torch_rs = best_time(lambda: dist.reduce_scatter_tensor(out, full, group=group.process_group), args.repeat)
    ours = best_time(lambda: comm.reduce_scatter(full, group), args.repeat)
    all_reduce = best_time(lambda: dist.all_reduce(full.clone(), group=group.process_group), args.repeat)
    dist.reduce_scatter_tensor(out, full, group=group.process_group)
    torch.testing.assert_close(comm.reduce_scatter(full, group), out)
    if dist.get_rank() == 0:
        print(f"{world} ranks, {args.mib} MiB float32 message, best of {args.repeat}")
        print(f"torch reduce_scatter_tensor (gloo) {torch_rs * 1e3:8.1f} ms")
        print(f"torch all_reduce (same message)    {all_reduce * 1e3:8.1f} ms")
        print(f"fourfold reduce_scatter (a2a+sum)  {ours * 1e3:8.1f} ms   speed-up {torch_rs / ours:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
