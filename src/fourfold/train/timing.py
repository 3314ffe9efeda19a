"""Every rank's split of its steps (`parallel.clock`: compute and the waits of each kind) brought to
rank 0 in one small gather at each read of the steps' numbers, and the stragglers named.

A straggler is a rank whose compute takes longer than the median of the ranks of its pipeline
stage by more than `log.straggler_margin` (the stages' work differs: the last one has the head).
One slow GPU or NIC makes every other rank of a synchronous job wait in its collectives, so its
compute is what stands out, not its step time (the same on every rank).
"""

from __future__ import annotations

import os
import socket
import statistics

import torch
import torch.distributed as dist

from fourfold.data import corpus
from fourfold.parallel import comm
from fourfold.parallel.clock import KINDS
from fourfold.parallel.grid import Grid
from fourfold.spec.layout import DIMS

FIELDS = ("step", "compute", *KINDS)  # one rank's figures, in the gathered vector's order
SLOWEST = 3  # ranks a timing record lists with their figures
STRAGGLERS = 16  # ranks it names (a bad switch can slow thousands: their count is kept)
# log.straggler_margin's default by device: CPU processes share cores, and the scheduler moves
# their compute a lot (the demo, 8 ranks on 2 cores: up to 133% over the median, no straggler)
DEFAULT_MARGIN = {"cuda": 0.25, "cpu": 2.0}


SHARED_CORES = ("stragglers: not named, the ranks share this machine's CPU cores (the scheduler moves their compute "
                "times); each step's split is in log.jsonl")


def cores_shared(device) -> bool:
    """Whether this node's ranks are CPU processes sharing its cores (more ranks than cores)."""
    return device.type == "cpu" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > corpus.usable_cores()


def places(grid: Grid) -> list[dict] | None:
    """On rank 0, each rank's host, local rank and coordinates on the grid (once, at the start);
    None elsewhere."""
    mine = dict(host=socket.gethostname(), local_rank=int(os.environ.get("LOCAL_RANK", grid.rank)),
                grid=",".join(f"{d}={grid.coords[d]}" for d in DIMS if grid.size(d) > 1))
    out = [None] * dist.get_world_size() if grid.rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def gather(split: dict[str, float], grid: Grid) -> torch.Tensor | None:
    """[ranks, FIELDS] of every rank's `split` (`Clock.read`) on rank 0, None elsewhere: one gather
    of 7 numbers a rank (at 16,384 ranks 0.9 MB to rank 0, and nothing to the others)."""
    mine = torch.tensor([split[f] for f in FIELDS], dtype=torch.float64, device=grid.device)
    return comm.gather_to_first(mine, grid.world_group())


def splits_of(numbers: list[float]) -> list[dict[str, float]]:
    """`gather`'s rows, read (flat), as each rank's split."""
    n = len(FIELDS)
    return [dict(zip(FIELDS, numbers[i: i + n])) for i in range(0, len(numbers), n)]


def timing_record(after: int, steps: int, splits: list[dict[str, float]], where: list[dict], stages: list[int],
                  margin: float) -> dict:
    """log.jsonl's record of the steps before `after` (`steps` of them, their mean): the median
    rank's split, the slowest ranks by compute against the median of the other ranks of their
    stage (of every other rank, for a stage of one), and the stragglers (at most STRAGGLERS named)."""
    compute = [s["compute"] for s in splits]
    by_stage: dict[int, list[int]] = {}
    for rank, stage in enumerate(stages):
        by_stage.setdefault(stage, []).append(rank)
    centre = [0.0] * len(splits)
    for members in by_stage.values():
        # a stage of one against every other rank (16,384 ranks: a sort a stage, not a median a rank)
        for rank, median in _medians_of_the_others(compute, members if len(members) > 1 else range(len(splits))):
            if len(members) > 1 or rank in members:
                centre[rank] = median
    over = [c / m - 1 if m > 0 else 0.0 for c, m in zip(compute, centre)]
    order = sorted(range(len(splits)), key=lambda r: -over[r])
    slowest = [dict(rank=r, **where[r], over_median=round(over[r], 4),
                    **{f: round(splits[r][f], 6) for f in FIELDS}) for r in order[:SLOWEST]]
    median = {f: round(statistics.median(s[f] for s in splits), 6) for f in FIELDS}
    stragglers = [r for r in order if over[r] > margin]
    return dict(timing_after_step=after, steps=steps, median=median, slowest=slowest,
                stragglers=stragglers[:STRAGGLERS], straggler_count=len(stragglers), straggler_margin=margin,
                slowest_rank=order[0], slowest_over_median=round(over[order[0]], 4))


def _medians_of_the_others(values: list[float], members) -> list[tuple[int, float]]:
    """(member, median of the other members' values) for each member, from one sort; a member with
    no other: its own value."""
    order = sorted(members, key=values.__getitem__)
    ranked = [values[r] for r in order]
    n = len(ranked)
    if n == 1:
        return [(order[0], ranked[0])]

    def without(k: int, i: int) -> float:  # the i-th smallest once the k-th is left out
        return ranked[i + (i >= k)]

    m = n - 1
    return [(r, (without(k, (m - 1) // 2) + without(k, m // 2)) / 2) for k, r in enumerate(order)]


def straggler_lines(record: dict) -> list[str]:
    """The console's line for each straggler of a timing record."""
    lines = []
    for s in record["slowest"]:
        if s["rank"] not in record["stragglers"]:
            continue
        lines.append(f"straggler after step {record['timing_after_step']}: rank {s['rank']} (host {s['host']}, "
                     f"local rank {s['local_rank']}{', ' + s['grid'] if s['grid'] else ''}) computes "
                     f"{s['compute']:.3f} s a step, "
                     f"{s['over_median']:.0%} over its stage's median (margin {record['straggler_margin']:.0%})")
    more = record["straggler_count"] - len(lines)
    if more > 0:
        listed = record["stragglers"][len(lines):]
        lines.append(f"straggler after step {record['timing_after_step']}: {more} more rank{'s' * (more > 1)} over the "
                     f"margin: {', '.join(map(str, listed))}{', ...' if len(listed) < more else ''} (log.jsonl)")
    return lines


def worst_ranks(records: list[dict]) -> list[dict]:
    """summary.json's worst ranks over the run's timing records: each rank a record named a
    straggler or listed first, its worst excess over the median and how many reports named it."""
    worst: dict[int, dict] = {}
    for record in records:
        for s in record["slowest"]:
            named = s["rank"] in record["stragglers"]
            if not named and s["rank"] != record["slowest_rank"]:
                continue
            w = worst.setdefault(s["rank"], dict(rank=s["rank"], host=s["host"], local_rank=s["local_rank"],
                                                 grid=s["grid"], worst_over_median=s["over_median"], reports=0))
            w["worst_over_median"] = max(w["worst_over_median"], s["over_median"])
            w["reports"] += named
    return sorted(worst.values(), key=lambda w: (-w["reports"], -w["worst_over_median"]))[:SLOWEST]
