"""fourfold's own peak memory per rank for one configuration, measured without the memory or the ranks.

Rank 0's part of the model is built and trained for two steps (the second has the optimizer state
of every later step) under FakeTensorMode: tensors carry shape, dtype and strides but no data, so
a 70B layer costs nothing. The other ranks are a `fake` process group whose collectives return at
once with outputs of the right shapes. Every storage an operator creates is counted until it is
freed: the same runtime code as a real run, so this is the check the estimator answers to
(`fourfold memory --measure`, tests/plan/test_planner_measured.py), and what is alive at the peak is
listed with the line of fourfold that made it.

What it cannot see: the CUDA context, NCCL's workspaces and allocator fragmentation (GPU-only;
left to the estimate's own terms). The attention kernel is CPU's: its flash kernel keeps what a
GPU's flash kernel keeps (output and log-sum-exp), the math path keeps the probabilities.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fourfold import checkpoint
from fourfold.models.config import ModelConfig
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.block import torch_dtype
from fourfold.parallel.tensor.params import Replicas
from fourfold.spec.job import Job
from fourfold.spec.rules import JobError, Problem, problems
from fourfold.tools.fake import fake_world

GPU_ONLY_TERMS = ("nccl", "cuda_context", "fragmentation")


@dataclass
class Measurement:
    peak_bytes: int
    phase_peaks: dict[str, int]  # "step 1 backward": the most bytes alive during it
    at_peak: list[tuple[int, str]]  # (bytes, what) of the tensors alive at the peak, largest first


class LiveBytes(TorchDispatchMode):
    """Bytes of every storage alive, counted from the operator that created it until it is freed."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}
        self.current = self.peak = 0
        self.at_peak: dict[int, tuple[int, str]] = {}
        self.phase_peaks: dict[str, int] = {}
        self.phase = "start"
        for t in existing:
            self._add(t, "parameter or accumulator")

    def enter(self, phase: str) -> None:
        """Count what follows as `phase` (its peak starts at what is alive now)."""
        self.phase = phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)

    def _add(self, t: torch.Tensor, what: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = (size, f"{self.phase}: {what} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        self.current += size
        weakref.finalize(storage, self._free, key)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.current)
        if self.current > self.peak:
            self.peak, self.at_peak = self.current, dict(self.live)

    def _free(self, key: int) -> None:
        size, _ = self.live.pop(key, (0, ""))
        self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, f"{func.__name__} at {_fourfold_line()}")
        return out

    def largest_at_peak(self, n: int) -> list[tuple[int, str]]:
        merged: dict[str, int] = {}
        for size, what in self.at_peak.values():
            merged[what] = merged.get(what, 0) + size
        return sorted(((size, what) for what, size in merged.items()), reverse=True)[:n]


def _fourfold_line() -> str:
    """file:line of the innermost fourfold frame below this module (frames walked, not formatted)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/fourfold/" in name and not name.endswith("measure.py"):
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "torch"


def check_measurable(cfg: ModelConfig, job: Job) -> None:
    """The rule function's problems, and what this measurement cannot take (JobError)."""
    found = problems(cfg, job, gpu=True)
    if job.pp > 1:
        found.append(Problem("--measure runs one model without pipeline sends",
                             "use pp 1 (to measure a stage, give the layers it holds with --layers)"))
    if found:
        raise JobError(found)


def measure_peak(cfg: ModelConfig, job: Job, *, flash_attention: bool = True, top: int = 12) -> Measurement:
    """Peak bytes alive on rank 0 over two training steps of `job` (one micro-batch each), then a
    checkpoint save and load (planned without files); `flash_attention` False measures CPU's math path."""
    check_measurable(cfg, job)
    with fake_world(job.world_size, 0, "measure_peak"):
        grid = Grid(job.layout)  # outside fake mode: DeviceMesh reads its rank tensor's values
        kernel = SDPBackend.FLASH_ATTENTION if flash_attention else SDPBackend.MATH
        # "auto" is a GPU's bf16 here: the measurement stands for a GPU run
        tokens = (job.micro_batch // job.z, job.seq // job.cp)
        with FakeTensorMode(), sdpa_kernel(kernel):
            # Built before counting starts: the runtime initialises parameters in host memory.
            model = Model(grid, job, cfg, dtype=torch_dtype(job.precision, torch.device("cuda"))).module
            opt = AdamW(GradientSync(model, grid), lr=1e-4, skip_non_finite=False)  # fake values: no check
            with LiveBytes([*model.parameters(), *opt.sync.main_grads.values()]) as counter:
                for step in range(2):
                    ids = torch.randint(0, cfg.vocab, tokens)
                    counter.enter(f"step {step} forward")
                    loss = model(ids, ids).sum()
                    counter.enter(f"step {step} backward")
                    loss.backward()
                    counter.enter(f"step {step} optimizer")
                    opt.step()
                    del loss
                counter.enter("checkpoint save and load")
                # a save and a load use the live tensors; the trainer's replicas
                checkpoint.dry_run(model, opt, Replicas.of_grid(grid))
        return Measurement(counter.peak, counter.phase_peaks, counter.largest_at_peak(top))
