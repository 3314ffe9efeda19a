"""Shared by the benchmarks: the best wall time of a step over all ranks."""

import time

import torch.distributed as dist


def best_time(step, repeat: int) -> float:
    """Best of `repeat` runs of `step` (after one warm-up), each fenced by barriers."""
    step()
    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best
