"""The cost of timing every rank's step (issue #39, item 1: `parallel.clock`, the trainer's split of
a step into compute and waits): the same training step with the clock off and on, on grids whose
collectives it times (data, tensor and context parallel), each timed run reading the clock every
`--every` steps as the trainer does at its log.every.

Run: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/step_timing.py [--repeat 15]
(a rank a core: more ranks than cores make the step's noise larger than what is measured)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from fourfold.models.config import ModelConfig
from fourfold.parallel.context import shard_sequence
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from timing import best_time  # benchmarks/timing.py, beside this file

CFG = ModelConfig("llama", hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=4096, max_positions=512,
                  tied=False, eps=1e-5)


def steps(layout: Layout, ids: torch.Tensor, timed: bool, every: int):
    """`every` training steps, each timed by the rank's clock (read after the last) when `timed`."""
    grid = Grid(layout)
    model = Transformer(grid, CFG, TensorOptions(), seed=0)
    opt = AdamW(GradientSync(model, grid), lr=1e-3)
    local = ids.chunk(layout.dp)[grid.coords["dp"]]
    inputs, targets = (shard_sequence(t, grid.group("cp")) for t in (local[:, :-1], local[:, 1:]))

    def run():
        for _ in range(every):
            if timed:
                grid.clock.step_began()
            (model(inputs, targets).sum() / ids[:, 1:].numel()).backward()
            opt.step()
            if timed:
                grid.clock.step_ended()
        if timed:
            run.spans = grid.clock.span_count
            grid.clock.read()

    run.grid = grid
    return run


def span_seconds(clock, n: int = 100_000) -> float:
    """What one span costs (the context manager and its two timer reads), timed over `n` of them."""
    clock.step_began()
    start = time.perf_counter()
    for _ in range(n):
        with clock.span("dp"):
            pass
    seconds = (time.perf_counter() - start) / n
    clock.step_ended()
    clock.read()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    init_process_group()
    world = dist.get_world_size()
    ids = torch.randint(0, CFG.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for label, layout in [(f"dp{world}", Layout(dp=world)), (f"x{world}", Layout(x=world)),
                          (f"cp{world}", Layout(cp=world))]:
        off, on = (steps(layout, ids, timed, args.every) for timed in (False, True))
        on.grid.clock.read()
        on()  # (a warm-up, and the spans of `every` timed steps counted)
        spans = on.spans / args.every
        seconds = {False: float("inf"), True: float("inf")}
        for _ in range(args.repeat):  # interleaved, so that drift of the machine hits both alike
            for timed, run in ((False, off), (True, on)):
                seconds[timed] = min(seconds[timed], best_time(run, 1) / args.every)
        rows.append((label, seconds[False], seconds[True], spans, spans * span_seconds(on.grid.clock)))
    if dist.get_rank() == 0:
        print(f"Llama hidden={CFG.hidden} layers={CFG.layers}, global batch {args.batch}x{args.seq}, float32, "
              f"{world} ranks; best of {args.repeat}, clock read every {args.every} steps")
        print(f"{'grid':<10} {'untimed ms':>11} {'timed ms':>9} {'timed/untimed':>14} {'spans/step':>11} "
              f"{'their cost':>11}")
        for label, off, on, spans, cost in rows:
            print(f"{label:<10} {off * 1e3:11.1f} {on * 1e3:9.1f} {on / off:14.3f} {spans:11.0f} {cost / off:11.4%}")
        print("their cost: the spans a step records times one span's cost (timed over 100,000), against the "
              "untimed step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
