"""One Llama block, forward + backward, with and without TensorOptions.compile (train.compile:
norms, RoPE and SwiGLU under torch.compile), on one rank.

Run: torchrun --standalone --nproc-per-node 1 benchmarks/compile_block.py
     [--hidden 1024 --heads 16 --ffn 2816 --batch 4 --seq 256 --repeat 5]
"""

from __future__ import annotations

import time

import torch

from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.tensor.block import ParallelBlock, TensorOptions
from fourfold.spec.blockspec import BlockConfig
from fourfold.spec.layout import Layout
from timing import best_time, block_arguments  # benchmarks/timing.py, beside this file


def main() -> None:
    args = block_arguments(__doc__.splitlines()[0])
    init_process_group()
    grid = Grid(Layout())
    cfg = BlockConfig(hidden=args.hidden, heads=args.heads, kv_heads=args.heads, ffn=args.ffn)
    h = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
    positions = torch.arange(args.seq)
    seconds, first, outputs = {}, {}, {}
    for compile in (False, True):
        block = ParallelBlock(grid, cfg, TensorOptions(compile=compile), seed=0)

        def step():
            h.grad = None
            out = block(h, positions)
            out.square().sum().backward()
            return out, h.grad

        start = time.perf_counter()
        outputs[compile] = step()  # the first step compiles
        first[compile] = time.perf_counter() - start
        seconds[compile] = best_time(step, args.repeat)
    (out, grad), (out_c, grad_c) = outputs[False], outputs[True]
    print(f"block hidden={args.hidden} heads={args.heads} ffn={args.ffn} batch={args.batch} seq={args.seq}, float32, "
          f"1 rank, {torch.get_num_threads()} threads, best of {args.repeat}")
    print(f"eager               {seconds[False] * 1e3:8.1f} ms   (first step {first[False]:.1f} s)")
    print(f"train.compile=true  {seconds[True] * 1e3:8.1f} ms   (first step {first[True]:.1f} s, compiling)   "
          f"{seconds[False] / seconds[True]:.2f}x")
    print(f"largest difference: output {(out - out_c).abs().max().item():.1e}, "
          f"input gradient {(grad - grad_c).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
