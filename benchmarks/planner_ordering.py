"""Does the planner rank grids the way measured step times do? On 8 CPU ranks (one machine).

First measures what the planner needs to know about this machine (per-rank GEMM rate, gloo
bandwidth and latency per collective step), then times training steps of one small Llama on
several grids and prints measured and predicted step times side by side with their ranks:
once with the micro-benchmarked latency, once with the latency fitted to one grid (the one with
the most collectives, x2 y2 z2) and checked on the other seven.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/planner_ordering.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from fourfold.config import BatchSection, GridSection, TrainConfig, TrainSection
from fourfold.models.config import ModelConfig
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.model import Model, local_batch
from fourfold.parallel.optimizer import AdamW
from fourfold.plan.constants import UNCALIBRATED, Profile
from fourfold.plan.perf import step_time
from fourfold.spec.hardware import GPU, Cluster
from fourfold.spec.job import Job
from fourfold.spec.layout import DIMS, Layout

CFG = ModelConfig("llama", hidden=256, layers=4, heads=8, kv_heads=8, ffn=704, vocab=4096, max_positions=512,
                  tied=False, eps=1e-5)
GLOBAL_BATCH, MICRO, SEQ = 16, 2, 128
GRIDS = ["dp=8", "dp=4,x=2", "dp=2,x=2,y=2", "dp=2,y=2,z=2", "x=2,y=2,z=2", "dp=4,pp=2", "dp=2,cp=2,y=2",
         "pp=2,cp=2,x=2"]


def machine() -> tuple[float, float, float]:
    """(GEMM FLOP/s per rank with all ranks busy, gloo bytes/s per rank, seconds per ring step)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    flops = 20 * 2 * 512**3 / (time.perf_counter() - start)
    big, small = torch.zeros(4 * 2**20 // 4), torch.zeros(1)
    dist.all_reduce(big)
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(big)
    seconds = (time.perf_counter() - start) / 3
    world = dist.get_world_size()
    bandwidth = 2 * (world - 1) / world * big.numel() * 4 / seconds
    start = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(small)
    latency = (time.perf_counter() - start) / 20 / (2 * (world - 1))
    measured = torch.tensor([flops, bandwidth, latency], dtype=torch.float64)
    dist.all_reduce(measured)
    return tuple((measured / world).tolist())


def measure(text: str, repeat: int = 3) -> float:
    """Median seconds of a training step on this grid, run by the trainer's own Model and batch split."""
    layout = Layout.parse(text)
    grid = Grid(layout)
    cfg = TrainConfig(grid=GridSection(**{d: getattr(layout, d) for d in DIMS}),
                      batch=BatchSection(global_batch=GLOBAL_BATCH, micro_batch=MICRO, seq=SEQ),
                      train=TrainSection(seq_parallel=layout.y > 1))
    job = cfg.job()
    model = Model(grid, job, CFG, dtype=torch.float32)
    opt = AdamW(GradientSync(model.module, grid), lr=1e-3)
    rows = GLOBAL_BATCH // layout.dp
    ids = np.random.default_rng(0).integers(0, CFG.vocab, (rows, SEQ + 1))
    batch = local_batch(job, grid, ids)
    times = []
    for step in range(repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        model.step(batch, opt.sync, 1.0 / (GLOBAL_BATCH * SEQ))
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]  # the median after the traced first step


def predict(text: str, cluster: Cluster) -> float:
    layout = Layout.parse(text)
    s = Job(layout, micro_batch=MICRO, seq=SEQ, global_batch=GLOBAL_BATCH, seq_parallel=layout.y > 1,
            precision="float32")
    # the GPU-fitted constants (overheads, bus efficiencies) do not describe CPU processes: the
    # guesses with a CPU's GEMM curve
    cpu = Profile(cluster.name, efficiency_max=1.0, efficiency_half=16, intra_node_efficiency=1.0,
                  inter_node_efficiency=1.0)
    return step_time(CFG, s, cluster, dataclasses.replace(UNCALIBRATED, profiles=(cpu,))).total


def fitted_latency(grid: str, measured: float, cluster: Cluster) -> Cluster:
    """The cluster with the latency per collective step that makes `grid`'s prediction equal its
    measured time (bisection: the prediction grows with the latency)."""
    low, high = 0.0, 1e6
    for _ in range(60):
        middle = (low + high) / 2
        if predict(grid, replace(cluster, latency_us=middle)) < measured:
            low = middle
        else:
            high = middle
    return replace(cluster, latency_us=(low + high) / 2)


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0] * len(values)
    for position, index in enumerate(order):
        out[index] = position + 1
    return out


def main() -> None:
    init_process_group()
    torch.manual_seed(0)
    flops, bandwidth, latency = machine()
    cluster = Cluster(GPU("cpu-rank", flops / 1e12, 3, 0.01, 1.0), 8, bandwidth / 1e9, bandwidth / 1e9, latency * 1e6)
    measured = [measure(g) for g in GRIDS]
    if dist.get_rank() == 0:
        fit_on = GRIDS.index("x=2,y=2,z=2")
        fitted = fitted_latency(GRIDS[fit_on], measured[fit_on], cluster)
        raw = [predict(g, cluster) for g in GRIDS]
        calibrated = [predict(g, fitted) for g in GRIDS]
        print(f"this machine, 8 ranks: {flops / 1e9:.1f} GFLOP/s per rank, gloo {bandwidth / 1e9:.2f} GB/s per rank, "
              f"{latency * 1e6:.0f} us per ring step (micro-benchmark), {fitted.latency_us:.0f} us fitted on x2 y2 z2")
        print(f"{'grid':16} {'measured s':>11} {'rank':>5} {'predicted s':>12} {'rank':>5} {'fitted s':>9} {'rank':>5}")
        for g, m, rm, p, rp, f, rf in zip(GRIDS, measured, ranks(measured), raw, ranks(raw), calibrated,
                                          ranks(calibrated)):
            print(f"{g:16} {m:11.3f} {rm:5d} {p:12.3f} {rp:5d} {f:9.3f} {rf:5d}")
        others = [i for i in range(len(GRIDS)) if i != fit_on]
        rho_raw = spearman(measured, raw)
        rho_fit = spearman([measured[i] for i in others], [calibrated[i] for i in others])
        print(f"Spearman rank correlation: {rho_raw:.2f} with the micro-benchmarked latency, {rho_fit:.2f} on the "
              f"seven grids not used for the fit")
        json.dump(dict(grids=GRIDS, measured=measured, predicted=raw, fitted=calibrated,
                       latency_us=[latency * 1e6, fitted.latency_us], spearman=[rho_raw, rho_fit]), sys.stderr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
