"""The order in which a pipeline rank runs its stages' forwards and backwards, as torch's schedules
order them (no torch here: the planner counts what a rank holds with it, `fourfold simulate` runs it)."""

from __future__ import annotations

import functools

from fourfold.spec.job import split_layers


def schedule_order(rank: int, pp: int, virtual: int, microbatches: int, schedule: str) -> list[tuple[bool, int, int]]:
    """(backward?, micro-batch, local stage) of pipeline rank `rank`, in the order its schedule runs
    them: a warm-up of forwards (1F1B: pp - 1 - rank; interleaved 1F1B over `virtual` stages a rank:
    (virtual - 1) rounds of pp micro-batches and 2 (pp - 1 - rank), torch's ScheduleInterleaved1F1B;
    GPipe: all), then one forward and one backward at a time, then the backwards left. Interleaved,
    forwards go stage by stage a round at a time, backwards from the last stage back."""
    total = microbatches * virtual
    per_round = microbatches // max(1, microbatches // pp)
    if schedule == "gpipe":
        warmup = total
    elif virtual == 1:
        warmup = min(pp - 1 - rank, total)
    else:
        warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), total)

    def op(k: int, backward: bool) -> tuple[bool, int, int]:
        stage = (k // per_round) % virtual
        micro = (k // (per_round * virtual)) * per_round + k % per_round
        return backward, micro, virtual - 1 - stage if backward else stage

    order = [op(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(warmup + k, False), op(k, True)]
    return order + [op(k, True) for k in range(total - warmup, total)]


@functools.lru_cache(maxsize=4096)  # the planner asks for every candidate of a pipeline shape
def held_layers(layers: int, pp: int, virtual: int, microbatches: int, schedule: str,
                stage_layers: tuple[int, ...] = ()) -> int:
    """The most (layer, micro-batch) pairs whose saved tensors one pipeline rank holds at once: each
    forward of a stage adds its layers until that micro-batch's backward through it, in the order
    of `schedule_order`; the largest over the ranks."""
    sizes = [len(stage) for stage in split_layers(layers, pp * virtual, stage_layers)]
    most = 0
    for rank in range(pp):
        held = 0
        for backward, _, local in schedule_order(rank, pp, virtual, microbatches, schedule):
            held += -sizes[rank + local * pp] if backward else sizes[rank + local * pp]
            most = max(most, held)
    return most
