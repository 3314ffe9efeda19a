"""One Llama block, forward + backward, on the same ranks: 1D TP, the published 3D algorithm,
fourfold's 3D path, and torch's DTensor tensor parallelism (Colwise/Rowwise + SequenceParallel).

Run: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/tensor_block.py
     [--hidden 1024 --heads 16 --ffn 2816 --batch 4 --seq 256 --repeat 5]
Prints, per variant: best time of `repeat` steps, and MiB sent per rank (fourfold's ledger; for
DTensor a dispatch mode counting the c10d functional collectives at the same ring volumes).
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.tensor.block import ParallelBlock, TensorOptions, rope_tables, rotate
from fourfold.spec.blockspec import BlockConfig
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import bytes_sent
from timing import best_time, block_arguments, print_table  # benchmarks/timing.py, beside this file


class CountCollectives(TorchDispatchMode):
    """Bytes sent per rank by the c10d functional collectives DTensor issues (ring volumes)."""

    def __init__(self):
        super().__init__()
        self.bytes = Fraction(0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace != "_c10d_functional":
            return func(*args, **(kwargs or {}))
        nbytes = args[0].numel() * args[0].element_size()
        if name == "all_reduce":
            self.bytes += bytes_sent("all_reduce", dist.get_world_size(), nbytes)
        elif name == "all_gather_into_tensor":
            self.bytes += bytes_sent("all_gather", args[1], nbytes * args[1])
        elif name == "reduce_scatter_tensor":
            self.bytes += bytes_sent("reduce_scatter", args[2], nbytes)
        elif name == "all_to_all_single":
            self.bytes += bytes_sent("all_to_all", dist.get_world_size(), nbytes)
        return func(*args, **(kwargs or {}))


class SerialBlock(nn.Module):
    """The block as a plain module, for torch's parallelize_module (torchtitan's layout)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        d = cfg.head_dim
        self.cfg = cfg
        self.attn_norm, self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps), nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.q = nn.Linear(cfg.hidden, cfg.heads * d, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.o = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, h):
        b, s, _ = h.shape
        d = self.cfg.head_dim
        n = self.attn_norm(h)
        q = self.q(n).view(b, s, -1, d).transpose(1, 2)  # local heads after ColwiseParallel
        k = self.k(n).view(b, s, -1, d).transpose(1, 2)
        v = self.v(n).view(b, s, -1, d).transpose(1, 2)
        cos, sin = rope_tables(torch.arange(s), s, d, self.cfg.rope_theta, None, q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        h = h + self.o(o.transpose(1, 2).reshape(b, s, -1))
        n = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


def dtensor_block(cfg: BlockConfig, world: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    block = SerialBlock(cfg)
    # torchtitan's plan: norms on sequence shards, projections gather the sequence first.
    plan = {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()}
    for name in ("q", "k", "v", "gate", "up"):
        plan[name] = ColwiseParallel(input_layouts=Shard(1))
    for name in ("o", "down"):
        plan[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return parallelize_module(block, mesh, plan)


def main() -> None:
    args = block_arguments(__doc__.splitlines()[0])
    init_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    cfg = BlockConfig(hidden=args.hidden, heads=args.heads, kv_heads=args.heads, ffn=args.ffn)
    results = []

    variants = [
        ("1D TP (x=1, y=8), Megatron-SP", Layout(y=world), TensorOptions(seq_parallel=True)),
        ("published 3D (x=2,y=2,z=2, all-reduce path)", Layout(x=2, y=2, z=2), TensorOptions(non_redundant=False)),
        ("fourfold 3D (x=2,y=2,z=2)", Layout(x=2, y=2, z=2), TensorOptions()),
        ("fourfold 3D + SP (x=2,y=2,z=2)", Layout(x=2, y=2, z=2), TensorOptions(seq_parallel=True)),
    ]
    for label, layout, opts in variants:
        grid = Grid(layout)
        block = ParallelBlock(grid, cfg, opts, seed=0)
        s_local = args.seq // layout.y if opts.seq_parallel else args.seq
        h = torch.randn(args.batch // layout.z, s_local, args.hidden // layout.x, requires_grad=True)
        pos = torch.arange(args.seq)

        def step():
            block.zero_grad(set_to_none=True)
            block(h, pos).sum().backward()

        seconds = best_time(step, args.repeat)
        grid.ledger.reset()
        step()
        results.append((label, seconds, float(grid.ledger.total())))

    block = dtensor_block(cfg, world)
    h = torch.randn(args.batch, args.seq // world, args.hidden, requires_grad=True)
    def dstep():
        block.zero_grad(set_to_none=True)
        x = DTensor.from_local(h, block.q.weight.device_mesh, [Shard(1)], run_check=False)
        block(x).to_local().sum().backward()

    seconds = best_time(dstep, args.repeat)
    with CountCollectives() as counter:
        dstep()
    results.append(("torch DTensor TP (tp=8, SequenceParallel)", seconds, float(counter.bytes)))

    if rank == 0:
        print(f"block hidden={args.hidden} heads={args.heads} ffn={args.ffn} batch={args.batch} seq={args.seq}, "
              f"float32, {world} ranks, best of {args.repeat}")
        print_table([(label, seconds, nbytes / 2**20) for label, seconds, nbytes in results], baseline=-1,
                    against="DTensor")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
