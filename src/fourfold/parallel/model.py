"""This rank's model and its batches: the one place a rank's model is built (plain, or its
pipeline stages), a global batch cut into this rank's part, and a step's micro-batches run.
Training, evaluation, `memory --measure` and `fourfold simulate` all build through here.

A batch is cut once: this rank's z part of each micro-batch (whole sequences, so document ids
are found over each whole sequence), then its cp chunks of every sequence (`context.shard_sequence`).
Document ids travel with the batch as an argument of every forward (through a pipeline: the
schedule's per-micro-batch keyword arguments, which every stage receives), never as state.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

from fourfold.models.config import ModelConfig
from fourfold.parallel import comm, context
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.overlap import OverlapOptions
from fourfold.parallel.tensor.block import TensorOptions, document_ids
from fourfold.parallel.tensor.moe import ParallelMoE
from fourfold.parallel.transformer import Transformer
from fourfold.spec.job import Job


class LocalBatch(NamedTuple):
    """This rank's inputs and targets [sequences, seq/cp] on its device, and with document
    attention the inputs' document ids (`block.document_ids`, of the same shape; else None)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None = None


def shard_rows(rows: torch.Tensor, grid: Grid, end_of_document: int | None = None) -> LocalBatch:
    """Rows of seq + 1 token ids [b, seq + 1] this rank holds whole (its z part) -> its `LocalBatch`:
    inputs and targets cut into its cp chunks. Negative targets are ignored by the loss (padding:
    its inputs read as id 0)."""
    inputs = rows[:, :-1].clamp_min(0)
    documents = None if end_of_document is None else document_ids(inputs, end_of_document)
    cp = grid.group("cp")
    parts = [context.shard_sequence(t, cp) for t in (inputs, rows[:, 1:], documents) if t is not None]
    if grid.device.type == "cuda":  # from pinned memory, without waiting for the GPU's queue
        parts = [t.pin_memory().to(grid.device, non_blocking=True) for t in parts]
    else:
        parts = [t.to(grid.device) for t in parts]
    return LocalBatch(*parts)


def local_batch(job: Job, grid: Grid, ids: np.ndarray, end_of_document: int | None = None) -> LocalBatch:
    """This data-parallel replica's part of the global batch [its sequences, seq + 1] -> this
    rank's: its z part of each micro-batch, its cp chunks of each sequence."""
    z = grid.size("z")
    parts = [torch.from_numpy(m).chunk(z)[grid.coords["z"]] for m in np.split(ids, len(ids) // job.micro_batch)]
    return shard_rows(torch.cat(parts), grid, end_of_document)


class Model:
    """This rank's part of the model, run the same way with or without pipeline stages.

    `module` holds every parameter of this rank (what GradientSync, the optimizer and checkpoints
    see); `parts` are the whole models that Hugging Face weights load into (one, or a pipeline's
    stages); `pipeline` is None without pp."""

    def __init__(self, grid: Grid, job: Job, model_cfg: ModelConfig, *, dtype: torch.dtype, overlap: bool = True,
                 seed: int = 0, std: float = 0.02, compile: bool = False, capacity_factor: float = 0.0,
                 train_padding_row: bool = False):
        overlaps = OverlapOptions() if overlap else OverlapOptions.off()
        opts = TensorOptions(seq_parallel=job.seq_parallel, overlap=overlaps,
                             keep_gathered_inputs=job.keep_gathered_inputs, dtype=dtype, compile=compile,
                             capacity_factor=capacity_factor, fp8=job.fp8, train_padding_row=train_padding_row)
        common = dict(seed=seed, std=std, recompute=job.recompute)
        self.grid, self.microbatches, self.module_cfg = grid, job.microbatches, model_cfg
        self.pipeline = None
        if job.pp > 1:
            from fourfold.parallel.pipeline import Pipeline  # (torch's pipelining imports dynamo: 0.4 s a process)

            self.pipeline = Pipeline(grid, model_cfg, opts, schedule=job.schedule, microbatches=self.microbatches,
                                     micro_batch=job.micro_batch // job.z, seq=job.seq // job.cp,
                                     virtual=job.virtual, stage_layers=list(job.stage_layers) or None, **common)
            self.module, self.parts = self.pipeline.module, self.pipeline.models
        else:
            with torch.device(grid.device):  # initialised where it lives (a pipeline stage is too)
                self.module = Transformer(grid, model_cfg, opts, **common)
            self.parts = [self.module]

    def step(self, batch: LocalBatch, sync: GradientSync, scale: float) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches; returns its share of the mean loss
        (each micro-batch's summed token losses times `scale`)."""
        with self._kernels():
            return self._step(batch, sync, scale)

    def _step(self, batch: LocalBatch, sync: GradientSync, scale: float) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.step(*batch, scale=scale, ready=sync.wait_for)
        total = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        chunks = [t.chunk(self.microbatches) if t is not None else [None] * self.microbatches for t in batch]
        for m, (x, y, d) in enumerate(zip(*chunks)):
            sync.sync = m == self.microbatches - 1  # reduce gradients in the last backward only
            # a mixture's load-balancing loss: each micro-batch's, averaged as the token losses are
            loss = self.module(x, y, d).sum() * scale + self.module.router_loss() / self.microbatches
            loss.backward()
            total += loss.detach()
        return total

    def expert_load(self) -> torch.Tensor | None:
        """[layers, experts + 2]: each mixture layer's routing on this rank since the last call
        (`ParallelMoE.take_load`; zeros for the layers of other pipeline stages); None without experts."""
        cfg = self.module_cfg
        if not cfg.experts:
            return None
        load = torch.zeros(cfg.layers, cfg.experts + 2, dtype=torch.float64, device=self.grid.device)
        for part in self.parts:
            for index, layer in part.layers.items():
                if isinstance(layer.mlp, ParallelMoE):
                    load[int(index)] = layer.mlp.take_load()
        return load

    @torch.no_grad()
    def balance_experts(self, speed: float, updated: torch.Tensor) -> None:
        """DeepSeek-V3's balancing biases moved by `speed` toward balance from the step's choices, summed
        over the ranks holding other tokens (one all-reduce of [layers, experts]; the x, y ranks route the
        same tokens, so every rank moves its copy alike); not where the step's update was skipped."""
        layers = [layer.mlp for part in self.parts for layer in part.layers.values()
                  if isinstance(layer.mlp, ParallelMoE) and layer.mlp.router.balance_bias is not None]
        if not layers:
            return
        counts = comm.all_reduce(torch.stack([m.take_chosen() for m in layers]), self.grid.token_group())
        for m, chosen in zip(layers, counts):
            m.balance(chosen, speed * updated)

    @torch.no_grad()
    def losses(self, batch: LocalBatch) -> torch.Tensor | None:
        """Forward only: the per-token losses of a local batch of any size, as one micro-batch
        (None on a pipeline rank without the last stage)."""
        with self._kernels():
            if self.pipeline is not None:
                return self.pipeline.losses(*batch)
            return self.module(*batch)

    def _kernels(self):
        """On GPUs, causal attention tries cuDNN's kernel first, then flash (`context.preferred_kernels`)."""
        return context.preferred_kernels() if self.grid.device.type == "cuda" else contextlib.nullcontext()
