"""One training job's parallel setup, as plain data (no torch): the grid, the batch, the sequence,
recompute, sequence parallelism, the pipeline schedule and stages, the precision.

The trainer builds one from its TOML config (`TrainConfig.job()`), the planner searches over them
and returns them (so `grid.auto` is a plain replacement), `fourfold memory --measure`, `eval` and
`generate` run them; `fourfold.spec.rules.problems` says whether a model can run one.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass

from fourfold.spec.layout import DIMS, Layout

RECOMPUTE = ("none", "selective", "full")  # activation checkpointing per block
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
# "auto": bf16 on GPUs, float32 on CPU (decided where the device is known).
PRECISIONS = ("auto", "bf16", "float32", "float64")
FP8_RECIPES = ("", "tensorwise", "rowwise")  # torchao's float8 training recipes; "": bf16 GEMMs
ELEMENT_BYTES = {"auto": 2, "bf16": 2, "float32": 4, "float64": 8}  # the planner plans GPUs: auto is bf16


@dataclass(frozen=True)
class Job:
    layout: Layout = Layout()
    global_batch: int = 16  # sequences per optimizer step
    micro_batch: int = 1  # sequences per forward/backward on one data-parallel replica (split over z)
    seq: int = 128
    recompute: str = "none"  # activation checkpointing per block: none, selective (attention core), full
    seq_parallel: bool = False  # residual stream and norms on seq/(cp*y) tokens
    schedule: str = "1f1b"  # pipeline schedule (with pp > 1)
    virtual: int = 1  # pipeline stages per pp rank (interleaved-1f1b)
    stage_layers: tuple[int, ...] = ()  # layers per pipeline stage; empty: an even split
    precision: str = "auto"  # parameters and activations; gradients and optimizer state are fp32 at least
    keep_gathered_inputs: bool = False  # linears keep their gathered input for backward (else gather it again)
    fp8: str = ""  # the blocks' linears' GEMMs in FP8 (torchao's recipes: tensorwise, rowwise); "": off

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each data-parallel replica."""
        return self.global_batch // (self.layout.dp * self.micro_batch)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.precision]

    def with_layout(self, **sizes: int) -> "Job":
        """This job on another grid (dims and `order` as Layout takes them)."""
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, **sizes))

    def __str__(self) -> str:
        return (f"{self.layout}, micro_batch {self.micro_batch}, global_batch {self.global_batch}, seq {self.seq}, "
                f"recompute {self.recompute}{', seq_parallel' if self.seq_parallel else ''}")


# Read-only views of the grid's sizes (job.x is job.layout.x): the dims are declared in Layout only.
for _dim in DIMS:
    setattr(Job, _dim, property(operator.attrgetter(f"layout.{_dim}"), doc=f"layout.{_dim}"))


def default_stage_layers(layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage when none are given: as even as can be, the extra layers of an
    uneven count on the middle stages first (the first and last also hold the embedding and the
    LM head; Llama 3 405B's 126 layers on 16 stages: 7, 8 x 14, 7)."""
    if layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} pipeline stages; use pp*virtual of at most {layers}")
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    for stage in (list(range(1, stages - 1)) + [0, stages - 1])[:extra]:
        counts[stage] += 1
    return counts


def megatron_stages(layers: int, chunks: int) -> tuple[int, ...]:
    """Megatron-Core's split when `chunks` does not divide the layers (Megatron-Bridge's 405B recipes:
    account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split): the embedding
    and the loss count as a layer each, so the first and last chunks hold one layer less."""
    per, extra = divmod(layers + 2, chunks)
    if extra or per < 2:
        return ()
    return (per - 1, *(per,) * (chunks - 2), per - 1)


def split_layers(layers: int, stages: int, stage_layers: tuple[int, ...] | list[int] = ()) -> tuple[range, ...]:
    """The global layer indices of each pipeline stage: the counts given, or the default split
    (ValueError naming the fix when they do not work)."""
    return _split_layers(layers, stages, tuple(stage_layers))


@functools.lru_cache(maxsize=4096)  # the rules and the planner ask for every candidate
def _split_layers(layers: int, stages: int, stage_layers: tuple[int, ...]) -> tuple[range, ...]:
    stage_layers = list(stage_layers) or default_stage_layers(layers, stages)
    if len(stage_layers) != stages or sum(stage_layers) != layers or min(stage_layers) < 1:
        raise ValueError(f"pipeline.stage_layers {stage_layers} must give each of the {stages} stages at least "
                         f"one layer and sum to the model's {layers} layers")
    starts = [sum(stage_layers[:i]) for i in range(stages)]
    return tuple(range(start, start + n) for start, n in zip(starts, stage_layers))


def most_layers_on_a_rank(layers: int, job: "Job") -> int:
    """The layers of the most loaded pipeline rank (its virtual stages together): what bounds a
    stage's memory and the pipeline's pace."""
    return max(rank_layers(layers, job.pp, job.virtual, job.stage_layers))


@functools.lru_cache(maxsize=4096)  # the planner asks for every candidate
def rank_layers(layers: int, pp: int, virtual: int, stage_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Layers of each pipeline rank (its virtual stages together)."""
    stages = split_layers(layers, pp * virtual, stage_layers)
    return tuple(sum(len(stages[r + v * pp]) for v in range(virtual)) for r in range(pp))
