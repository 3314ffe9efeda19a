"""One Llama block, forward + backward, on one rank: eager; with only its pieces compiled (norms, RoPE
and SwiGLU under torch.compile: what train.compile does to a block with collectives in it); and
compiled whole (`ParallelBlock.compile_whole`: what train.compile does on this grid), with the graph
breaks torch._dynamo counted.

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
    from torch._dynamo.utils import counters

    seconds, first, outputs, breaks = {}, {}, {}, {}
    modes = ("eager", "pieces compiled", "block compiled whole")
    for mode in modes:
        block = ParallelBlock(grid, cfg, TensorOptions(compile=mode != "eager"), seed=0)
        if mode == "block compiled whole":
            block.compile_whole()

        def step():
            h.grad = None
            out = block(h, positions)
            out.square().sum().backward()
            return out, h.grad

        counters.clear()
        start = time.perf_counter()
        outputs[mode] = step()  # the first step compiles
        first[mode] = time.perf_counter() - start
        breaks[mode] = sum(counters["graph_break"].values())
        seconds[mode] = best_time(step, args.repeat)
    print(f"block hidden={args.hidden} heads={args.heads} ffn={args.ffn} batch={args.batch} seq={args.seq}, float32, "
          f"1 rank, {torch.get_num_threads()} threads, best of {args.repeat}")
    out, grad = outputs["eager"]
    for mode in modes:
        out_c, grad_c = outputs[mode]
        print(f"{mode:<22} {seconds[mode] * 1e3:8.1f} ms  {seconds['eager'] / seconds[mode]:5.2f}x  first step "
              f"{first[mode]:5.1f} s  graph breaks {breaks[mode]}  largest difference: output "
              f"{(out - out_c).abs().max().item():.1e}, input gradient {(grad - grad_c).abs().max().item():.1e}")

if __name__ == "__main__":
    main()
