"""A mixture-of-experts training step (forward, backward, AdamW) beside the dense step of the same
active parameters, on the same ranks: a Mixtral-style model of 8 experts, top-2, each expert's
MLP half the dense one's, so a token runs as many MLP weights in both. Each rank runs every
expert (ep=1) or experts/ep of them with tokens exchanged by all-to-all (expert parallelism).

Each mixture runs its experts both ways (`parallel.tensor.experts`): as one grouped GEMM
(torch._grouped_mm, float32 on CPU; bf16 on GPUs) and as their loop (the float64 reference path).

Besides the time, the all-to-all bytes each rank sent (the ledger's, at the routing the model
took) against what the volume functions predict at a balanced routing, which the planner prices.

Run: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/moe_step.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist

from fourfold.models.config import ModelConfig
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import ledger_bytes, model_collectives
from timing import best_time  # benchmarks/timing.py, beside this file

DENSE = ModelConfig("llama", hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=4096, max_positions=512,
                    tied=False, eps=1e-5)
MOE = dataclasses.replace(DENSE, family="mixtral", ffn=352, experts=8, top_k=2, norm_topk=True)


def step_of(cfg: ModelConfig, layout: Layout, ids: torch.Tensor, grouped: bool = True):
    grid = Grid(layout)
    model = Transformer(grid, cfg, TensorOptions(), seed=0)
    for layer in model.layers.values():
        if cfg.experts:
            layer.mlp.grouped_gemm = grouped
    opt = AdamW(GradientSync(model, grid), lr=1e-3)
    c = grid.coords
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]

    def step():
        (model(local[:, :-1], local[:, 1:]).sum() / ids[:, 1:].numel()).backward()
        opt.step()

    return step, grid, model, local


def balanced_exchange(cfg: ModelConfig, layout: Layout, local: torch.Tensor) -> float:
    """Bytes one rank sends by all-to-all in a step at a balanced routing (the volume functions)."""
    if layout.ep == 1:
        return 0.0
    tokens = local[:, :-1].numel()
    choices = cfg.top_k * tokens  # each rank's; a balanced routing keeps 1/ep of them at home
    away = choices * (layout.ep - 1) // layout.ep
    per_expert = choices // cfg.experts * layout.ep  # what each of a rank's experts receives from the group
    sizes = dict(layout.sizes, ep=layout.ep)
    routed = [(per_expert,) * (cfg.experts // layout.ep)] * cfg.layers
    expected = model_collectives(cfg, sizes, len(local), local.shape[1] - 1, routing=routed,
                                 exchanged=[(away, away)] * cfg.layers)
    return float(ledger_bytes(expected, sizes, 4).get(("ep", "all_to_all_v"), 0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    init_process_group()
    world = dist.get_world_size()
    ids = torch.randint(0, DENSE.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for label, cfg, layout in [
        (f"dense dp={world}", DENSE, Layout(dp=world)),
        (f"MoE dp={world}, every expert on each rank", MOE, Layout(dp=world)),
        (f"MoE dp={world} ep=2", MOE, Layout(dp=world, ep=2)),
        (f"MoE dp={world} ep=4", MOE, Layout(dp=world, ep=4)),
        (f"MoE dp={world} ep=8", MOE, Layout(dp=world, ep=8)),
        ("dense dp4 x2", DENSE, Layout(dp=world // 2, x=2)),
        ("MoE dp4 x2 ep=4", MOE, Layout(dp=world // 2, x=2, ep=4)),
    ]:
        step, grid, model, local = step_of(cfg, layout, ids)
        seconds = best_time(step, args.repeat)
        loop = best_time(step_of(cfg, layout, ids, grouped=False)[0], args.repeat) if cfg.experts else seconds
        grid.ledger.reset()
        step()
        sent = grid.ledger.bytes().get(("ep", "all_to_all_v"), 0)
        measured = torch.tensor([float(sent), balanced_exchange(cfg, layout, local)], dtype=torch.float64)
        dist.all_reduce(measured)  # the mean over ranks
        rows.append((label, seconds, loop, float(grid.ledger.total()) / 2**20, *(measured / world / 2**20).tolist()))
    if dist.get_rank() == 0:
        params = MOE.parameter_count() / 1e6
        print(f"hidden={DENSE.hidden} layers={DENSE.layers} vocab={DENSE.vocab}: dense ffn {DENSE.ffn} "
              f"({DENSE.parameter_count() / 1e6:.1f}M params); MoE {MOE.experts} experts of ffn {MOE.ffn}, "
              f"top-{MOE.top_k} ({params:.1f}M params, as many active as the dense); global batch "
              f"{args.batch}x{args.seq}, float32, {world} ranks, best of {args.repeat}")
        base = rows[0][1]
        width = max(len(r[0]) for r in rows) + 2
        print(f"{'variant':<{width}} {'step ms':>8} {'vs dense':>9} {'loop ms':>8} {'grouped/loop':>13} "
              f"{'MiB sent/rank':>14} {'a2a MiB/rank':>13} {'balanced':>9}")
        for label, seconds, loop, mib, a2a, balanced in rows:
            print(f"{label:<{width}} {seconds * 1e3:8.1f} {seconds / base:9.2f} {loop * 1e3:8.1f} "
                  f"{seconds / loop:13.2f} {mib:14.2f} {a2a:13.3f} {balanced:9.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
