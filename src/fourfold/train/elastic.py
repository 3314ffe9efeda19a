"""A run started on another number of ranks than its grid has, with grid.elastic (issue #39, item 3):
torchrun's elastic rendezvous (`--nnodes MIN:MAX`) restarted it on the nodes left (or more), or a
user relaunched it on other GPUs. It takes a grid for the ranks present: the first of
grid.fallbacks that this run can use, else the planner's best row for them (as grid.auto). The
global batch is kept (each replica accumulates more, or fewer, micro-batches), the checkpoint it
resumes from is resharded onto the new grid as any checkpoint loads onto any grid, and the data
goes on from the checkpoint's position in the data order. Every rank decides alike (a function of
the config and the rank count), and rank 0 says in one line what changed."""

from __future__ import annotations

import dataclasses
import math

from fourfold.config import ConfigError, TrainConfig, parse_fallbacks, validate
from fourfold.spec.job import Job
from fourfold.spec.layout import DIMS, Layout, grid_text

# the planner's rows a regrid tries: every rank searches at a restart, and the first usable is
# nearly always among the best few
PLANNER_ROWS = 16


def _text(layout: Layout) -> str:
    return grid_text(dict(layout.sizes, ep=layout.ep))


def copied(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its own copies of the sections a job sets (`TrainConfig.use_job`)."""
    return dataclasses.replace(cfg, grid=dataclasses.replace(cfg.grid), batch=dataclasses.replace(cfg.batch),
                               train=dataclasses.replace(cfg.train), pipeline=dataclasses.replace(cfg.pipeline))


def fallbacks(cfg: TrainConfig) -> list[dict[str, int]]:
    return parse_fallbacks(cfg.grid.fallbacks)


def _with_grid(cfg: TrainConfig, sizes: dict[str, int]) -> TrainConfig:
    grid = dataclasses.replace(cfg.grid, **{d: sizes.get(d, 1) for d in (*DIMS, "ep")})
    return dataclasses.replace(cfg, grid=grid)


def _problem(cfg: TrainConfig, world: int, gpu: bool) -> str | None:
    """Why `cfg` cannot run on `world` ranks (the first line of fourfold train's checks), or None."""
    try:
        validate(cfg, world, gpu)
        return None
    except ConfigError as e:
        return str(e).splitlines()[-1].strip(" -")


def _usable(cfg: TrainConfig, world: int, gpu: bool) -> bool:
    return _problem(cfg, world, gpu) is None


def regrid(cfg: TrainConfig, world: int, local: int, gpu: bool = False) -> tuple[TrainConfig, str | None]:
    """(the config to run on `world` ranks of `local` a node, the line that says what changed: None
    when nothing did). Raises ConfigError naming the smallest node count that would do."""
    if not cfg.grid.elastic or cfg.layout().world_size == world:
        return cfg, None
    before = cfg.job()
    given = fallbacks(cfg)
    if given:
        chosen = next((c for c in (_with_grid(cfg, g) for g in given) if _usable(c, world, gpu)), None)
        if chosen is None:
            raise ConfigError(_none_fits(cfg, given, world, local, gpu))
        source = "grid.fallbacks"
    else:
        chosen = copied(cfg)
        _planned(chosen, world, local, gpu)
        source = f"the planner's best on {chosen.cluster().gpu.name}"
    return chosen, _changed(before, chosen.job(), world, source)


def _changed(before: Job, after: Job, world: int, source: str) -> str:
    return (f"elastic: {world} ranks, not the grid's {before.layout.world_size}: grid {_text(before.layout)} -> "
            f"{_text(after.layout)} ({source}); the global batch stays {after.global_batch} sequences, "
            f"{after.microbatches} micro-batches of {after.micro_batch} a replica a step (was {before.microbatches} "
            f"of {before.micro_batch})")


def _none_fits(cfg: TrainConfig, given: list[dict[str, int]], world: int, local: int, gpu: bool) -> str:
    grids = [_with_grid(cfg, g) for g in given]
    why = "; ".join(f"{_text(c.layout())}: " + (_problem(c, world, gpu) if c.layout().world_size == world else
                                                 f"{c.layout().world_size} ranks") for c in grids)
    said = (f"{world} ranks ({math.ceil(world / local)} node{'s' * (world > local)} of {local}) fit none of "
            f"grid.fallbacks ({why})")
    runs = sorted({(c.layout().world_size, _text(c.layout())) for c in grids
                   if _usable(c, c.layout().world_size, gpu)})
    if not runs:
        return f"{said}, and none of them passes this run's checks on its own rank count either: give grids that do"
    ranks, text = runs[0]
    return (f"{said}; the smallest node count that runs one is {math.ceil(ranks / local)} ({ranks} ranks: {text}): "
            f"start the run on as many nodes, or add a grid of {world} ranks to grid.fallbacks")


def _planned(cfg: TrainConfig, world: int, local: int, gpu: bool) -> None:
    """Take the planner's best job for `world` ranks that this run can use into `cfg`; else an
    error naming the smallest node count, up to the grid's own, at which the planner finds one."""
    job = planner_job(cfg, world, gpu, top=PLANNER_ROWS)
    if job is not None:
        cfg.use_job(job)
        return
    nodes, most = math.ceil(world / local), cfg.layout().world_size // local
    tried = sorted({min(most, nodes + 2**k) for k in range(most.bit_length())})  # (a search each: doubling steps)
    # (so the count named is the smallest of those tried, not always the smallest that would do)
    for n in tried:
        job = planner_job(cfg, n * local, gpu, top=PLANNER_ROWS)
        if job is not None:
            raise ConfigError(f"the planner found no configuration of {world} ranks that fits and that this run "
                              f"can use; the smallest it finds takes {n} nodes of {local} ({_text(job.layout)}): "
                              f"start the run on as many, or give grid.fallbacks")
    raise ConfigError(f"the planner found no configuration of {world} ranks that fits and that this run can use; "
                      f"give grid.fallbacks, or set the grid by hand")


def planner_job(cfg: TrainConfig, ranks: int, gpu: bool = False, top: int | None = None) -> Job | None:
    """The planner's best job on `ranks` GPUs of [hardware] that this run can use (every check of
    `fourfold train`, the trainer's own options too), of its `top` best rows (None: all); None if none."""
    from fourfold.plan.search import search

    for candidate in search(cfg.model_config(), ranks, cfg.cluster(), cfg.job(), top=top)[:top]:
        trial = copied(cfg)
        trial.use_job(candidate["job"])
        if _usable(trial, ranks, gpu):
            return candidate["job"]
    return None


def min_nodes(cfg: TrainConfig, nodes: int, gpus_per_node: int, gpu: bool = True) -> int:
    """The fewest of `nodes` nodes a grid.elastic run can go on with (`fourfold slurm`'s --nnodes
    MIN:MAX): the smallest of grid.fallbacks that runs on whole nodes, else the smallest of the node
    count's halvings at which the planner finds a job."""
    if not cfg.grid.elastic:
        return nodes
    given = fallbacks(cfg)
    if given:
        counts = [c.layout().world_size // gpus_per_node for c in (_with_grid(cfg, g) for g in given)
                  if c.layout().world_size % gpus_per_node == 0 and c.layout().world_size <= nodes * gpus_per_node
                  and _usable(c, c.layout().world_size, gpu)]
        return min(counts + [nodes])
    for n in sorted({max(1, nodes >> k) for k in range(nodes.bit_length())}):
        if n == nodes or planner_job(cfg, n * gpus_per_node, gpu, top=PLANNER_ROWS) is not None:
            return n
    return nodes


def counts_without_grid(cfg: TrainConfig, low: int, high: int, gpus_per_node: int, gpu: bool = True) -> list[int]:
    """The node counts in low..high that none of grid.fallbacks runs on (a restart on one of them
    would be refused); [] without fallbacks (the planner is asked at the restart)."""
    given = [_with_grid(cfg, g) for g in fallbacks(cfg)]
    runs = {c.layout().world_size for c in given if _usable(c, c.layout().world_size, gpu)}
    return [n for n in range(low, high + 1) if given and n * gpus_per_node not in runs]
