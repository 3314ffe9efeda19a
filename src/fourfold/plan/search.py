"""Evaluate one configuration, or search every configuration of a GPU count, best first."""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from dataclasses import replace
from typing import Callable

import numpy as np

from fourfold.models.config import ModelConfig
from fourfold.plan.constants import Calibration
from fourfold.plan.costs import group_bandwidth
from fourfold.plan.frameworks import FOURFOLD, Framework
from fourfold.plan.memory import GIB, Memory
from fourfold.plan.perf import StepTime, compute_bound, placement_bound, step_time
from fourfold.spec.hardware import Cluster
from fourfold.spec.job import RECOMPUTE, Job
from fourfold.spec.layout import Layout, factorisations
from fourfold.spec.rules import JobError

# every group the perf model times (ep, edp: a mixture's expert groups, `perf.group_ranks`)
COMM_GROUPS = [("x",), ("y",), ("z",), ("cp",), ("pp",), ("dp", "cp"), ("ep",), ("edp",)]
# A candidate that fits but leaves less than this fraction of the card free is "tight": the estimate's
# error, allocator fragmentation or a longer batch can push it over. Shown, and ranked after the others.
HEADROOM = 0.05
ROUNDING = 1e-3  # step times equal to four digits are equally fast (`rounded_seconds`)


def check(cfg: ModelConfig, job: Job, framework: Framework = FOURFOLD) -> None:
    """Raise JobError naming each fix when the framework cannot run `job`."""
    if found := framework.problems(cfg, job):
        raise JobError(found)


def predict(cfg: ModelConfig, job: Job, cluster: Cluster, cal: Calibration = Calibration(), rule80: bool = True,
             framework: Framework = FOURFOLD) -> dict:
    """Memory and speed of one job, as the JSON object the CLI prints (plus the `job` itself,
    which the JSON printers leave out)."""
    check(cfg, job, framework)
    return _result(cfg, job, cluster, cal, rule80, framework)


def _result(cfg: ModelConfig, job: Job, cluster: Cluster, cal: Calibration, rule80: bool, framework: Framework,
            t: StepTime | None = None, mem: Memory | None = None) -> dict:
    mem = mem or framework.memory(cfg, job, cluster.gpu.memory_gib, rule80)
    t = t or step_time(cfg, job, cluster, cal, framework)
    tokens = job.global_batch * job.seq
    tflops = t.flops_per_gpu / t.total / 1e12
    g = job.layout
    return {
        "job": job, "framework": framework.name, "dp": g.dp, "pp": g.pp, "cp": g.cp, "x": g.x, "y": g.y, "z": g.z,
        "ep": g.ep, "virtual": job.virtual, "order": ",".join(g.order), "micro_batch": job.micro_batch,
        "recompute": job.recompute, "seq_parallel": job.seq_parallel, "keep_gathered_inputs": job.keep_gathered_inputs,
        "memory_gib": mem.gib, "memory_limit_gib": mem.limit_bytes / 2**30, "fits": mem.fits,
        "tight": mem.fits and mem.total > (1 - HEADROOM) * cluster.gpu.memory_gib * GIB,
        "step_seconds": t.total, "tokens_per_second": tokens / t.total, "model_tflops_per_gpu": tflops,
        "mfu": tflops / cluster.gpu.bf16_tflops,
        "memory_breakdown_gib": mem.breakdown_gib(), "time_breakdown_seconds": t.breakdown(),
        "async_checkpoint_host_gib": mem.checkpoint_host_bytes / GIB,
    }


def as_json(result: dict) -> dict:
    """A result without its `job` object (the JSON printers' form)."""
    return {k: v for k, v in result.items() if k != "job"}


def rounded_seconds(seconds: float) -> float:
    """A step time to four significant digits: closer candidates count as equally fast."""
    return round(seconds, 3 - math.floor(math.log10(seconds))) if seconds > 0 else seconds


def _best_placement(cfg: ModelConfig, job: Job, mem: Memory, orders, cluster: Cluster, cal: Calibration,
                    rule80: bool, framework: Framework) -> dict:
    """The fastest placement order of `job` (whose memory, `mem`, no order changes). The order
    changes time only through the bandwidth each group gets: one order is evaluated per distinct
    set of bandwidths."""
    placements = [replace(job, layout=layout) for layout in _distinct_placements(job.layout, cluster, tuple(orders))]
    t, best = min(((step_time(cfg, placed, cluster, cal, framework), placed) for placed in placements),
                  key=lambda timed: timed[0].total)
    return _result(cfg, best, cluster, cal, rule80, framework, t, mem)


@functools.lru_cache(maxsize=4096)  # jobs of one grid differ in micro-batch and recompute only
def _distinct_placements(layout: Layout, cluster: Cluster, orders: tuple) -> tuple[Layout, ...]:
    """One layout per distinct set of group bandwidths among `orders` (the first order of each)."""
    placements = {}
    for o in orders:
        placed = replace(layout, order=o)
        placements.setdefault(tuple(group_bandwidth(placed, cluster, g) for g in COMM_GROUPS), placed)
    return tuple(placements.values())


class Ranking(list):
    """Results, best first (`rank`); `considered`: how many jobs the rules accepted (more than the
    results when the search stopped early)."""

    def __init__(self, results: list[dict], considered: int):
        super().__init__(results)
        self.considered = considered


def search(cfg: ModelConfig, gpus: int, cluster: Cluster, base: Job, *, micro_batches=(1, 2, 4, 8),
           recomputes=RECOMPUTE, cal: Calibration = Calibration(), rule80: bool = True, include_unfit: bool = False,
           framework: Framework = FOURFOLD, top: int | None = None, virtuals: tuple[int, ...] | None = None,
           progress: Callable[[int, int], None] | None = None) -> Ranking:
    """Every job the framework accepts on `gpus`: each (dp, pp, cp, x, y, z), micro-batch, pipeline
    schedule (`schedules`; `virtuals`: the stages per pipeline rank to try instead of its own), order
    and recompute option of `base`, and for a mixture of experts each expert parallelism ep dividing
    the experts and the framework's expert replicas (fourfold: dp*cp; megatron: dp, with cp 1),
    ranked (`rank`); each result's `job` is the job itself. `top`: only the first `top` results (and
    every tie of the first) are wanted, exactly as a full search ranks them: jobs are evaluated in
    the order of a lower bound of their step time (`compute_bound`), and the search stops where
    that bound passes every time it keeps. `progress(evaluated, candidates)` is told as the jobs are
    evaluated (a large search takes minutes)."""
    orders = framework.placement_orders(cfg)
    # (bound, arrival, memory, job): a heap. A job enters with its compute bound; when it first
    # reaches the top its memory is estimated and, if it fits, it goes back with its tighter
    # placement bound. A job's heavier recompute enters when a lighter one does not fit.
    queue = []
    arrival = itertools.count()
    for dp, pp, cp, x, y, z in factorisations(gpus):
        if not framework.runs_grid(cfg, pp, x, z):
            continue
        for ep in expert_parallel_sizes(cfg, framework.expert_replicas(dp, cp)):
            layout = Layout(dp=dp, pp=pp, cp=cp, x=x, y=y, z=z, ep=ep)
            for mb in micro_batches:
                if base.global_batch % (dp * mb) or mb % z:
                    continue  # two of the rules, asked first: most of a large GPU count's grids fail them
                for pipeline in schedules(cfg, base, pp, framework, virtuals):
                    job = replace(base, layout=layout, micro_batch=mb, recompute=recomputes[0], **pipeline)
                    if not framework.problems(cfg, job):
                        queue.append((compute_bound(cfg, job, cluster, cal, framework), next(arrival), None, job))
    considered = len(queue)
    heapq.heapify(queue)
    results, kept = [], []
    evaluated = 0
    while queue:
        bound, _, mem, job = heapq.heappop(queue)
        if progress is not None and mem is None:
            evaluated += 1
            progress(min(evaluated, considered), considered)
        if top and len(kept) >= top and bound > _cutoff(kept, top, cal):
            break  # every job left is slower than what is kept
        if mem is None:
            mem = framework.memory(cfg, job, cluster.gpu.memory_gib, rule80)
            heavier = recomputes.index(job.recompute) + 1
            if not mem.fits and heavier < len(recomputes):  # a lighter recompute that fits makes heavier ones pointless
                next_job = replace(job, recompute=recomputes[heavier])
                heapq.heappush(queue, (compute_bound(cfg, next_job, cluster, cal, framework), next(arrival), None,
                                       next_job))
            if not (mem.fits or include_unfit):
                continue
            if top:  # kept inputs only take collectives away: its bound holds for both variants
                lightest = replace(job, keep_gathered_inputs=True) if framework.keeps_gathered_inputs else job
                heapq.heappush(queue, (placement_bound(cfg, lightest, cluster, cal, framework), next(arrival), mem,
                                       job))
                continue
        best = _best_placement(cfg, job, mem, orders, cluster, cal, rule80, framework)
        keep = replace(job, keep_gathered_inputs=True)
        if (framework.keeps_gathered_inputs and mem.fits and keep != job
                and (keep_mem := framework.memory(cfg, keep, cluster.gpu.memory_gib, rule80)).fits):
            # Memory allows keeping the linears' gathered inputs: no all-gather again in backward.
            # Taken when faster, unless it gives up the headroom the plain job has.
            kept_inputs = _best_placement(cfg, keep, keep_mem, orders, cluster, cal, rule80, framework)
            if kept_inputs["step_seconds"] < best["step_seconds"] and (best["tight"] or not kept_inputs["tight"]):
                best = kept_inputs
        results.append(best)
        if mem.fits and not best["tight"]:
            bisect.insort(kept, best["step_seconds"])
    return Ranking(rank(results, cal), considered)


def schedules(cfg: ModelConfig, base: Job, pp: int, framework: Framework = FOURFOLD,
              virtuals: tuple[int, ...] | None = None) -> list[dict]:
    """The pipeline schedules the search tries on pp ranks: `base`'s own without interleaving, and
    interleaved 1F1B (a smaller bubble for more sends and in-flight activations) over each of the
    framework's stages per rank (`Framework.virtuals`); `virtuals`: these stages per rank instead (1: plain).
    A base with its own split (`stage_layers`) keeps its schedule, on the pp whose stages it splits."""
    if base.stage_layers:
        own = dict(virtual=base.virtual, schedule=base.schedule)
        return [own] if pp * base.virtual == len(base.stage_layers) else []
    plain = dict(virtual=1, schedule="1f1b" if base.schedule == "interleaved-1f1b" else base.schedule)
    if pp == 1:
        return [plain]
    if virtuals is None:
        virtuals = framework.virtuals(cfg, pp)
    return [plain if v == 1 else dict(virtual=v, schedule="interleaved-1f1b") for v in virtuals]


def expert_parallel_sizes(cfg: ModelConfig, replicas: int) -> list[int]:
    """The ep the search tries over `replicas` ranks (fourfold: dp*cp; Megatron: dp, with cp 1): every
    divisor of gcd(experts, replicas) for a mixture of experts (the rules' condition), else 1."""
    if not cfg.block.moe:
        return [1]
    n = math.gcd(cfg.experts, replicas)
    return [d for d in range(1, n + 1) if n % d == 0]


def _cutoff(kept: list[float], top: int, cal: Calibration) -> float:
    """The step time past which no job can enter the first `top` results (`kept`: the times of the
    candidates that fit with headroom, sorted): the `top`-th's tier (`rank`) reaches at most the
    widest band past it, whoever leads that tier."""
    return kept[top - 1] * (1 + cal.widest_band()) * (1 + ROUNDING)


def rank(results: list[dict], cal: Calibration) -> list[dict]:
    """Best first: those that fit with headroom, then the tight ones, then those that do not fit.
    The model cannot tell two step times apart within its cross-validated error (the band of the
    larger of the two kinds', `kind`), so those with headroom are listed in tiers: the fastest not yet
    in one leads a tier of every other not yet in one within the band of it, each tier listed simplest
    first: the least model parallelism (tp*cp*pp), then the least expert parallelism, then the fewest
    virtual stages, then the largest micro-batch, as the measured runs rank them (docs/planner.md,
    "Calibration"); then by step time (equal to four digits: less context parallelism, then the
    smaller model-parallel group, then less memory). Each result gets its `tier` (0: the fastest's;
    None: tight or not fitting) and `tie` (in the fastest's tier with another)."""
    def by_time(r: dict) -> tuple:
        return (rounded_seconds(r["step_seconds"]), r["cp"], model_parallel(r), r["memory_gib"])

    widest = cal.widest_band()
    for r in results:
        r["tier"] = None
    left = sorted((r for r in results if r["fits"] and not r["tight"]), key=lambda r: (r["step_seconds"], *by_time(r)))
    if not widest:  # no error known: a tier a row, by time to four digits
        left.sort(key=by_time)
    tier = 0
    while left:
        leader = left[0]
        for r in left:
            if r["step_seconds"] > leader["step_seconds"] * (1 + widest):
                break  # (sorted: none further can join)
            margin = max(cal.error_band(kind(r)), cal.error_band(kind(leader)))
            if r is leader or (margin and r["step_seconds"] <= leader["step_seconds"] * (1 + margin)):
                r["tier"] = tier
        left, tier = [r for r in left if r["tier"] is None], tier + 1
    listed = sorted(results, key=lambda r: (not r["fits"], r["tight"], r["tier"] or 0,
                                            simplest(r) if r["tier"] is not None else (), *by_time(r)))
    tiered = _beaten_after_their_betters([r for r in listed if r["tier"] is not None])
    listed[: len(tiered)] = tiered  # (the others are listed by time: none beats an earlier one)
    for later, r in zip(tiered[::-1][:-1], tiered[::-1][1:]):  # a row moved up joins the tier it is listed in
        r["tier"] = min(r["tier"], later["tier"])
    first = sum(r["tier"] == 0 for r in results)
    for r in results:
        r["tie"] = first > 1 and r["tier"] == 0
    return listed


def beats(a: dict, b: dict) -> bool:
    """Whether `a` is faster than `b` and needs less memory, as the table shows them (four digits of
    the step time, a tenth of a GiB)."""
    return (rounded_seconds(a["step_seconds"]) < rounded_seconds(b["step_seconds"])
            and round(a["memory_gib"], 1) < round(b["memory_gib"], 1))


def _beaten_after_their_betters(rows: list[dict]) -> list[dict]:
    """`rows` in their order, except that a row another beats on both step time and memory (`beats`) is
    never listed above it: each place goes to the first row left, unless a row left beats it, then to
    the first of those (and so on: a row that beats that one is faster still)."""
    seconds = np.array([rounded_seconds(r["step_seconds"]) for r in rows])
    gib = np.array([round(r["memory_gib"], 1) for r in rows])
    left = np.ones(len(rows), dtype=bool)
    out = []
    while len(out) < len(rows):
        i = int(np.argmax(left))  # the first row left
        while (better := np.flatnonzero(left & (seconds < seconds[i]) & (gib < gib[i]))).size:
            i = int(better[0])
        out.append(rows[i])
        left[i] = False
    return out


def kind(r: dict) -> str:
    """A candidate's kind for its error band: cp > 1, else pp > 1, else tensor parallel, else data only."""
    return "cp" if r["cp"] > 1 else "pp" if r["pp"] > 1 else "tp" if r["x"] * r["y"] * r["z"] > 1 else "dp"


def simplest(r: dict) -> tuple:
    """The listing's order within a tier: the least tp*cp*pp, ep and virtual stages, the largest micro-batch."""
    return (model_parallel(r), r.get("ep", 1), r.get("virtual", 1), -r["micro_batch"])


def model_parallel(r: dict) -> int:
    return r["pp"] * r["cp"] * r["x"] * r["y"] * r["z"]
