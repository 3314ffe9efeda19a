"""A multi-head latent attention block (DeepSeek-V3's) beside a grouped-query attention block of the
same hidden size, on the same ranks: one transformer layer, forward and backward, on the grids a
user would pick for it. Both blocks have a dense SwiGLU MLP of the same size, so the difference is
the attention: MLA's latent projections (replicated over y, all-reduced over x), its per-head
up-projections and the latents' gradients summed over the head group, against GQA's fused QKV
projection split over x and y. Bytes per rank from the collective ledger.

Run: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/mla_block.py [--repeat 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from fourfold.models.config import ModelConfig
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.transformer import Transformer
from fourfold.spec.counts import layer_params
from fourfold.spec.layout import Layout
from timing import best_time  # benchmarks/timing.py, beside this file

HIDDEN, HEADS, FFN, VOCAB = 512, 16, 1408, 1024
# GQA: 16 heads of 32, 8 kv heads (y = 8 splits them). MLA at about DeepSeek-V3's proportions (hidden 7168
# -> 512): 16 heads, q latent 192, kv latent 64, per head 32 features without RoPE and 16 with, values of 32.
GQA = ModelConfig("llama", hidden=HIDDEN, layers=1, heads=HEADS, kv_heads=8, ffn=FFN, vocab=VOCAB, max_positions=4096,
                  tied=False, eps=1e-6)
MLA = ModelConfig("deepseek_v3", hidden=HIDDEN, layers=1, heads=HEADS, kv_heads=HEADS, ffn=FFN, vocab=VOCAB,
                  max_positions=4096, tied=False, eps=1e-6, head_dim=48, q_lora=192, kv_lora=64, nope_dim=32,
                  rope_dim=16, v_dim=32, rope_interleave=True, dense_layers=1, dense_ffn=FFN, experts=8, top_k=2,
                  norm_topk=True, shared_ffn=FFN // 8, groups=1, top_groups=1, attention_scale=48 ** -0.5)


def step_of(cfg: ModelConfig, layout: Layout, ids: torch.Tensor, seq_parallel: bool):
    grid = Grid(layout)
    model = Transformer(grid, cfg, TensorOptions(seq_parallel=seq_parallel), seed=0)
    c = grid.coords
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]

    def step():
        (model(local[:, :-1], local[:, 1:]).sum() / ids[:, 1:].numel()).backward()

    return step, grid


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    init_process_group()
    world = dist.get_world_size()
    ids = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    grids = [("x2 y4 sp", Layout(x=2, y=world // 2), True), ("y8 sp", Layout(y=world), True),
             ("dp2 x2 y2", Layout(dp=world // 4, x=2, y=2), False), ("cp2 y4 sp", Layout(cp=2, y=world // 2), True)]
    rows = []
    for grid_label, layout, sp in grids:
        for label, cfg in (("GQA", GQA), ("MLA", MLA)):
            step, grid = step_of(cfg, layout, ids, sp)
            seconds = best_time(step, args.repeat)
            grid.ledger.reset()
            step()
            sent = torch.tensor([float(grid.ledger.total())], dtype=torch.float64)
            dist.all_reduce(sent)
            rows.append((f"{label} {grid_label}", seconds, float(sent) / world / 2**20))
    if dist.get_rank() == 0:
        attention = {n: sum(layer_params(c, block=c.layer_block(0))) - 3 * HIDDEN * FFN for n, c in
                     (("GQA", GQA), ("MLA", MLA))}
        print(f"one layer, hidden {HIDDEN}, {HEADS} heads, dense SwiGLU MLP of {FFN}; attention parameters: GQA "
              f"{attention['GQA'] / 1e6:.2f}M, MLA {attention['MLA'] / 1e6:.2f}M; batch {args.batch}x{args.seq}, "
              f"float32, {world} ranks, forward + backward, best of {args.repeat}")
        width = max(len(r[0]) for r in rows) + 2
        print(f"{'variant':<{width}} {'step ms':>8} {'MLA/GQA':>8} {'MiB sent/rank':>14}")
        for i, (label, seconds, mib) in enumerate(rows):
            ratio = f"{seconds / rows[i - 1][1]:8.2f}" if label.startswith("MLA") else f"{'':8}"
            print(f"{label:<{width}} {seconds * 1e3:8.1f} {ratio} {mib:14.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
