"""A small Llama training step (forward, backward, AdamW) on the same ranks: fourfold data
parallelism (ZeRO-1, its parameter all-gather waited at the update or left in flight behind the
next forward), fourfold 3D grids with overlap off and on (on: also with each linear's forward
unchunked, `forward_chunks` 1), torch DDP and torch FSDP2.

Run: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/train_step.py [--repeat 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from fourfold.models.config import ModelConfig
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.overlap import OverlapOptions
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from timing import best_time, print_table  # benchmarks/timing.py, beside this file

CFG = ModelConfig("llama", hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=4096, max_positions=512,
                  tied=False, eps=1e-5)


def fourfold_step(layout: Layout, overlap: OverlapOptions, ids: torch.Tensor, overlap_gather: bool = True):
    grid = Grid(layout)
    model = Transformer(grid, CFG, TensorOptions(overlap=overlap), seed=0)
    opt = AdamW(GradientSync(model, grid), lr=1e-3, overlap_gather=overlap_gather)
    c = grid.coords
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]

    def step():
        (model(local[:, :-1], local[:, 1:]).sum() / ids[:, 1:].numel()).backward()
        opt.step()

    return step, grid


def torch_step(wrap: str, ids: torch.Tensor):
    world = dist.get_world_size()
    model = Transformer(Grid(Layout(dp=world)), CFG, TensorOptions(), seed=0)  # plain layers: no tensor dims
    if wrap == "ddp":
        model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = ids.chunk(world)[dist.get_rank()]

    def step():
        (model(local[:, :-1], local[:, 1:]).sum() / ids[:, 1:].numel()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    init_process_group()
    world = dist.get_world_size()
    ids = torch.randint(0, CFG.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    off = OverlapOptions.off()
    rows = []
    for label, layout, overlap, gather in [
        (f"fourfold dp={world} (ZeRO-1), gather waited", Layout(dp=world), OverlapOptions(), False),
        (f"fourfold dp={world} (ZeRO-1), gather hidden", Layout(dp=world), OverlapOptions(), True),
        ("fourfold dp2 x2 z2, overlap off", Layout(dp=2, x=2, z=2), off, False),
        ("fourfold dp2 x2 z2, overlap on", Layout(dp=2, x=2, z=2), OverlapOptions(), True),
        ("fourfold dp2 y2 z2, overlap off", Layout(dp=2, y=2, z=2), off, False),
        ("fourfold dp2 y2 z2, overlap on, forward unchunked", Layout(dp=2, y=2, z=2),
         OverlapOptions(forward_chunks=1), True),
        ("fourfold dp2 y2 z2, overlap on", Layout(dp=2, y=2, z=2), OverlapOptions(), True),
    ]:
        step, grid = fourfold_step(layout, overlap, ids, gather)
        seconds = best_time(step, args.repeat)
        grid.ledger.reset()
        step()
        rows.append((label, seconds, float(grid.ledger.total()) / 2**20))
    for wrap in ("ddp", "fsdp2"):
        rows.append((f"torch {wrap.upper()} dp={world}", best_time(torch_step(wrap, ids), args.repeat), float("nan")))
    if dist.get_rank() == 0:
        print(f"Llama hidden={CFG.hidden} layers={CFG.layers} vocab={CFG.vocab}, "
              f"{CFG.parameter_count() / 1e6:.1f}M params, global batch {args.batch}x{args.seq}, float32, "
              f"{world} ranks, best of {args.repeat}")
        print_table(rows, baseline=-2, against="DDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
