"""Shared by the benchmarks: the best wall time of a step over all ranks, the result table, and
the block-shape options of the block benchmarks."""

import argparse
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


def print_table(rows: list[tuple[str, float, float]], baseline: int, against: str) -> None:
    """Rows of (variant, seconds per step, MiB sent per rank), times as ratios to rows[baseline]."""
    width = max(len(label) for label, _, _ in rows) + 2
    base = rows[baseline][1]
    print(f"{'variant':<{width}} {'step ms':>9} {'vs ' + against:>10} {'MiB sent/rank':>14}")
    for label, seconds, mib in rows:
        print(f"{label:<{width}} {seconds * 1e3:9.1f} {seconds / base:10.2f} {mib:14.2f}")


def block_arguments(description: str) -> argparse.Namespace:
    """The shape of the benchmarked Transformer block, and how many timed steps."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    return p.parse_args()
