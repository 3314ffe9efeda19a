"""`fourfold simulate`: one rank of a whole job, run on this machine without the other ranks.

Rank R joins a `fake` process group of the job's full size (its collectives return at once with
outputs of the right shape) and runs the trainer's own code under FakeTensorMode (tensors carry
shape and dtype, no data): it builds the grid and its groups, its part of the model and the
optimizer, runs training steps and plans a checkpoint save. What that costs this process is
what the rank pays at scale before any network cost: start-up seconds, Python seconds per step
(the CPU work a GPU step must hide), device bytes by phase, host memory, and the collectives per
step by group (the ledger's calls and bytes). Costs that grow with the world size show up here
at 16,384 ranks on one CPU.

The Python seconds include FakeTensorMode's own dispatch cost per operator, so they are an upper
bound on the eager runtime's; the network, the kernels and the files are not simulated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from fourfold import checkpoint
from fourfold.models.config import ModelConfig
from fourfold.parallel import comm
from fourfold.parallel.comm import at_least_fp32
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import LocalBatch, Model
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.pipeline import Pipeline
from fourfold.parallel.tensor.block import torch_dtype
from fourfold.parallel.tensor.params import Replicas
from fourfold.parallel.tensor.vocab import vocab_parallel_cross_entropy
from fourfold.spec.job import Job
from fourfold.spec.layout import DIMS
from fourfold.spec.rules import check
from fourfold.spec.schedule import schedule_order
from fourfold.tools.fake import fake_world
from fourfold.tools.measure import LiveBytes


def trainer_groups(grid: Grid) -> None:
    """Every group the trainer, its optimizer and its evaluation ask for, made now (the combined
    ones by role are the expensive kind to create)."""
    for dim in DIMS:
        grid.group(dim)
    for role in (grid.replica_group, grid.loss_group, grid.token_group, grid.world_group):
        role()


@dataclass
class Simulation:
    world: int
    rank: int
    coords: dict[str, int]
    layers: int  # the model's layers as simulated (all of them unless reduced)
    startup_seconds: dict[str, float]  # phase -> seconds: process group, grid and groups, model, optimizer
    step_seconds: list[float]  # Python seconds of each timed step
    device_peak_bytes: dict[str, int]  # phase -> the most device bytes alive during it
    host_peak_bytes: int  # this process's peak RSS
    collectives_per_step: list[dict] = field(default_factory=list)  # {group, op, calls, bytes}
    save: dict = field(default_factory=dict)  # the checkpoint save's plan on this rank
    load: dict = field(default_factory=dict)  # a same-grid load of that checkpoint: its reads on this rank

    @property
    def startup_total(self) -> float:
        return sum(self.startup_seconds.values())

    def as_json(self) -> dict:
        return dict(dataclasses.asdict(self), startup_total_seconds=self.startup_total)


def _timed(seconds: dict[str, float], phase: str):
    @contextlib.contextmanager
    def clock():
        start = time.perf_counter()
        yield
        seconds[phase] = time.perf_counter() - start

    return clock()


def _pipeline_step(pipeline: Pipeline, job: Job, ids: torch.Tensor, scale: float) -> None:
    """This rank's stages through one step in its schedule's order (`schedule_order`), without the
    schedule itself (a fake process group cannot answer its start-up vote): each stage runs on its
    own input (the ids on the first, a stream as the previous stage would send it on the others)
    and keeps its output until that micro-batch's backward through it, so the saved tensors alive
    at once are the schedule's. The schedule's sends (each stage's output forward, its input's
    gradient backward, a mixture's load-balancing sums beside them) are recorded in the ledger as
    `_LedgerStage` records them; a tied embedding's table and its copy's gradient are sent as the
    pipeline sends them."""
    grid, first, pp = pipeline.grid, pipeline.models[0], pipeline.pp
    n_stages = pp.size * len(pipeline.models)
    stream = torch.empty(pipeline.stream_shape, dtype=first.opts.dtype)
    sums = torch.empty(2, first.cfg.experts, dtype=at_least_fp32(first.opts.dtype)) if pipeline.routing else None
    pipeline._set_copy()
    pipeline._forwards = 0  # as Pipeline.step starts a step: the tied table's copy counts its forwards again
    for model in pipeline.models:
        model.overlap.new_pass()
    chunks = ids.chunk(job.microbatches)
    waiting = {}  # (micro-batch, local stage) -> its output, until its backward
    for backward, micro, local in schedule_order(pp.rank, pp.size, len(pipeline.models), job.microbatches,
                                                 job.schedule):
        if backward:
            out = waiting.pop((micro, local))
            out.backward(None if out.dim() == 0 else torch.empty_like(out))
            continue
        index = pipeline.indices[local]
        for _ in range((index < n_stages - 1) + (index > 0)):
            pp._record("send", stream)
            if sums is not None:
                pp._record("send", sums)
        h = chunks[micro] if index == 0 else torch.empty(pipeline.stream_shape, dtype=first.opts.dtype,
                                                         requires_grad=True)
        out = pipeline.models[local](h)
        if index == n_stages - 1:
            out = vocab_parallel_cross_entropy(out, chunks[micro], grid).sum() * scale
        waiting[(micro, local)] = out
    if pipeline.tied and pipeline.has_last:
        comm.send(pipeline.models[-1].lm_head.copy_grad, 0, pp)


def _model(cfg: ModelConfig, job: Job, grid: Grid) -> Model:
    return Model(grid, job, cfg, dtype=torch_dtype(job.precision, torch.device("cuda")))


def _optimizer(model: Model, grid: Grid) -> AdamW:
    return AdamW(GradientSync(model.module, grid), lr=1e-4, skip_non_finite=False)  # fake values


def _training_step(cfg: ModelConfig, job: Job, model: Model, opt: AdamW) -> Callable[[], None]:
    """A training step of the rank's model on fake ids, as the trainer runs it (under FakeTensorMode)."""
    scale = 1.0 / (job.global_batch * job.seq)
    tokens = (job.microbatches * (job.micro_batch // job.z), job.seq // job.cp)

    def step() -> None:
        ids = torch.randint(0, cfg.vocab, tokens)
        if model.pipeline is None:
            model.step(LocalBatch(ids, ids), opt.sync, scale)
        else:
            _pipeline_step(model.pipeline, job, ids, scale)
        opt.step()

    return step


def _on_fake_gpus(job: Job) -> Job:
    return dataclasses.replace(job, precision="bf16") if job.precision == "auto" else job  # "auto" on GPUs


def train_step(cfg: ModelConfig, job: Job, *, rank: int = 0) -> None:
    """One training step of rank `rank` of `job` alone, as `simulate` runs it, without its measurements:
    that a job the rules accept builds, runs forward, backward and the update on this rank (the
    sweep of every family on every grid form, tests/tools/test_families_on_grid_forms.py)."""
    check(cfg, job, gpu=True)
    job = _on_fake_gpus(job)
    with fake_world(job.world_size, rank, "simulate"):
        grid = Grid(job.layout)
        with FakeTensorMode(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model = _model(cfg, job, grid)
            opt = _optimizer(model, grid)
            _training_step(cfg, job, model, opt)()


def simulate(cfg: ModelConfig, job: Job, *, rank: int = 0, steps: int = 2) -> Simulation:
    """Run rank `rank` of `job` alone (see the module's doc); `steps` timed steps follow two
    counted ones (the second has the optimizer state of every later step)."""
    check(cfg, job, gpu=True)
    if not 0 <= rank < job.world_size:
        raise ValueError(f"--rank {rank} is outside a job of {job.world_size} ranks; give 0..{job.world_size - 1}")
    job = _on_fake_gpus(job)
    startup: dict[str, float] = {}
    begun = time.perf_counter()
    with fake_world(job.world_size, rank, "simulate"):
        startup["process group"] = time.perf_counter() - begun
        with _timed(startup, "grid and groups"):
            grid = Grid(job.layout)  # outside fake mode: DeviceMesh reads its rank tensor's values
            trainer_groups(grid)
            if job.layout.ep > 1:  # a mixture's token exchange and expert replicas (Grid.expert_group)
                for kind in ("ep", "edp"):
                    grid.expert_group(kind)
        with FakeTensorMode(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            with _timed(startup, "model"):
                model = _model(cfg, job, grid)
            with _timed(startup, "optimizer"):
                opt = _optimizer(model, grid)
            step = _training_step(cfg, job, model, opt)
            with LiveBytes([*model.module.parameters(), *opt.sync.main_grads.values()]) as counter:
                for n in range(2):
                    counter.enter(f"step {n}")
                    step()
                counter.enter("checkpoint save")
                save, load = checkpoint.dry_run(model.module, opt, Replicas.of_grid(grid))  # as the trainer
                counter.enter("checkpoint load")
            grid.ledger.reset()
            seconds = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - start)
        collectives = [dict(group=g, op=op, calls=calls // max(1, steps),
                            bytes=int(grid.ledger.bytes()[(g, op)]) // max(1, steps))
                       for (g, op), calls in sorted(grid.ledger.calls().items())]
        return Simulation(world=job.world_size, rank=rank, coords=grid.coords, layers=cfg.layers,
                          startup_seconds=startup, step_seconds=seconds, device_peak_bytes=counter.phase_peaks,
                          host_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          collectives_per_step=collectives, save=save, load=load)


def report(sim: Simulation) -> str:
    """The simulation as a few lines of text."""
    mib, gib = 2**20, 2**30
    coords = " ".join(f"{d}{c}" for d, c in sim.coords.items())
    lines = [f"rank {sim.rank} of {sim.world} (at {coords}), {sim.layers} layers",
             f"start-up: {sim.startup_total:.2f} s ("
             + ", ".join(f"{k} {v:.2f}" for k, v in sim.startup_seconds.items()) + ")"]
    if sim.step_seconds:
        lines.append(f"Python seconds per step (FakeTensorMode, an upper bound): "
                     f"{sum(sim.step_seconds) / len(sim.step_seconds):.3f}")
    lines.append("device memory peak by phase (GiB): "
                 + ", ".join(f"{k} {v / gib:.2f}" for k, v in sim.device_peak_bytes.items()))
    lines.append(f"host memory peak (RSS): {sim.host_peak_bytes / gib:.2f} GiB")
    save = sim.save
    lines.append(f"checkpoint save: {save['chunks']} chunks, {save['bytes_written'] / gib:.2f} GiB offered (an async "
                 f"save stages as much in host memory), plan "
                 f"{save['plan_bytes'] / 1024:.1f} KiB (the coordinator gathers one from each of {sim.world} ranks), "
                 f"planned in {save['seconds']:.2f} s")
    lines.append(f"checkpoint load (same grid): {sim.load['reads']} reads, {sim.load['bytes_read'] / gib:.2f} GiB "
                 f"into this rank's own tensors, planned in {sim.load['seconds']:.2f} s")
    lines.append(f"collectives per step: {'group':<16} {'op':<15} {'calls':>6} {'MiB sent':>10}")
    for c in sim.collectives_per_step:
        lines.append(f"{'':21}{c['group']:<16} {c['op']:<15} {c['calls']:>6} {c['bytes'] / mib:>10.1f}")
    return "\n".join(lines)
