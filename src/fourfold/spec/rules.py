"""Every rule a (model, job) pair must satisfy for the runtime to run it, written once (no torch).

`problems(model, job)` lists what is wrong, each with the fix; the trainer's validation, the
planner's search, `fourfold memory --measure`, `eval` and `generate` all ask it before any process
starts. The runtime's own checks (ShardedMatrix, Pipeline) stay as assertions behind it: a job
this function accepts builds and trains (tests/spec/test_rules.py runs every accepted grid up to 8
ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fourfold.models.config import ModelConfig
from fourfold.spec.blockspec import attention_chunks, mlp_chunks
from fourfold.spec.job import FP8_RECIPES, PRECISIONS, RECOMPUTE, SCHEDULES, Job, split_layers
from fourfold.spec.layout import GridError


@dataclass(frozen=True)
class Problem:
    what: str  # what cannot work
    fix: str  # what to change

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}"


def describe(found: list, header: str) -> str:
    """One problem as its line; several under `header`, one per line."""
    return "\n  ".join([header, *map(str, found)]) if len(found) > 1 else str(found[0])


def with_flags(message: str, flags: dict[str, str]) -> str:
    """A rule message for a command whose flags are not the training config's keys: each key
    (`batch.seq`) and its `key=value` form named as that command's flag (`--seq value`)."""
    for key, flag in flags.items():
        message = message.replace(f"{key}=", f"{flag} ").replace(key, flag)
    return message


class JobError(ValueError):
    """A job the runtime cannot run; the message lists every problem with its fix."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__(describe(problems, "this job cannot run:"))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)  # (the search meets many)


def padded_vocab(vocab: int, y: int) -> int:
    """The rows of the embedding and LM head on a grid of `y`: the vocabulary rounded up to a
    multiple of y (as Megatron's make-vocab-size-divisible-by), so that each y rank holds as many
    rows. The rows past `vocab` are zero, in no checkpoint, and their logits are -inf."""
    return -(-vocab // y) * y


LOSS_CHUNK_BYTES = 256 << 20  # of fp32 logits the loss scores at once


def loss_chunk_tokens(columns: int) -> int:
    """The tokens whose logits (`columns` of them a token, this y rank's) the cross-entropy scores
    at once in fp32 (parallel.tensor.vocab): at a 128k vocabulary on one y rank, 512."""
    return max(1, LOSS_CHUNK_BYTES // (4 * columns))


def problems(model: ModelConfig, job: Job, *, world: int | None = None, gpu: bool = False,
             attention: str = "causal") -> list[Problem]:
    """Everything that stops `model` from training as `job` (on `world` started processes; on
    GPUs with `gpu`, whose kernels have preconditions of their own) with `attention` (data.attention)."""
    out: list[Problem] = []
    add = lambda what, fix: out.append(Problem(what, fix))  # noqa: E731
    g = job.layout
    try:
        b = model.block
    except ValueError as e:  # heads that do not divide the hidden size, or kv heads the heads
        return [Problem(f"the model config: {e}", "fix the model's config.json")]
    if world is not None and g.world_size != world:
        add(f"the grid {g} needs {g.world_size} processes, but {world} are asked for",
            f"change the grid so that dp*pp*cp*x*y*z = {world}, or start {g.world_size} processes")

    # ----- the model over the tensor grid (x, y, z) -----------------------------------------
    if model.hidden % g.x:
        add(f"x={g.x} must divide hidden={model.hidden} (features of the residual stream, norms, embedding)",
            f"choose x from {_divisors(model.hidden)}")
    if model.hidden % g.y:
        add(f"y={g.y} must divide hidden={model.hidden} (the output projections' input features)",
            f"choose y from {_divisors(model.hidden)}")
    try:
        attention_chunks(b, g.x, g.y)
    except GridError:
        add(f"y={g.y} must divide heads={model.heads} and kv_heads={b.kv_heads}",
            f"choose y from {_divisors(b.kv_heads)} (x*y dividing both also avoids redundant attention)")
    try:
        mlp_chunks(b, g.x, g.y)
    except GridError:
        add(f"y={g.y} must divide ffn={model.ffn}", f"choose y from {_divisors(model.ffn)}")
    if b.shared_ffn and b.shared_ffn % g.y:
        add(f"y={g.y} must divide the shared expert's ffn={b.shared_ffn}", f"choose y from {_divisors(b.shared_ffn)}")
    if g.ep > 1 and not b.moe:
        add(f"ep={g.ep} splits a mixture's experts, and this model has none", "use ep=1 (the default)")
    elif b.moe and model.experts % g.ep:
        add(f"ep={g.ep} must divide the experts ({model.experts}): each expert rank holds experts/ep of them",
            f"choose ep from {_divisors(math.gcd(model.experts, g.dp * g.cp))}")
    if b.rope and b.head_dim % 2:
        add(f"rotary embeddings need an even head dim (hidden/heads = {b.head_dim})",
            "use a model with an even head dim")

    # ----- batch and sequence ----------------------------------------------------------------
    for name, value in (("batch.global_batch", job.global_batch), ("batch.micro_batch", job.micro_batch),
                        ("batch.seq", job.seq)):
        if value < 1:
            add(f"{name} is {value}", f"set {name} >= 1")
    if min(job.global_batch, job.micro_batch, job.seq) < 1:
        return out
    if job.micro_batch % g.z:
        add(f"batch.micro_batch={job.micro_batch} must be divisible by z={g.z} (z splits each micro-batch's sequences)",
            f"use a micro-batch that is a multiple of {g.z}, or a smaller z")
    if job.global_batch % (g.dp * job.micro_batch):
        add(f"batch.global_batch={job.global_batch} must be a multiple of dp*micro_batch = {g.dp}*{job.micro_batch}",
            f"use a global batch that is a multiple of {g.dp * job.micro_batch}, or change dp or the micro-batch")
    dynamic = model.rope_scaling is not None and model.rope_scaling.kind == "dynamic"  # made to run past them
    if job.seq > model.max_positions and not dynamic:
        add(f"batch.seq={job.seq} is longer than the model's {model.max_positions} positions",
            f"use a sequence of at most {model.max_positions} tokens")
    if g.cp > 1 and job.seq % (2 * g.cp):
        add(f"with context parallelism the sequence is cut into 2*cp={2 * g.cp} load-balanced chunks, "
            f"and batch.seq={job.seq} does not divide", f"use a sequence length that is a multiple of {2 * g.cp}")
    elif job.seq_parallel and (job.seq // g.cp) % g.y:
        add(f"sequence parallelism splits each rank's {job.seq // g.cp} tokens over y={g.y}",
            f"use a sequence length that is a multiple of cp*y = {g.cp * g.y}, or turn seq_parallel off")
    if job.seq % g.cp == 0 and (job.seq // g.cp) % g.x:
        add(f"the LM head splits each rank's {job.seq // g.cp} tokens over x={g.x} (each x rank scores 1/x of them)",
            f"use a sequence length that is a multiple of cp*x = {g.cp * g.x}")

    # ----- options ---------------------------------------------------------------------------
    if job.recompute not in RECOMPUTE:
        add(f"recompute {job.recompute!r} is unknown", f"use one of {', '.join(RECOMPUTE)}")
    if job.precision not in PRECISIONS:
        add(f"precision {job.precision!r} is unknown", f"use one of {', '.join(PRECISIONS)}")
    elif gpu and (g.cp > 1 or b.sinks) and job.precision in ("float32", "float64"):
        # (attention sinks run the ring's kernel on one rank too: they need its log-sum-exp)
        why = f"ring attention (cp={g.cp})" if g.cp > 1 else "attention with sinks"
        add(f"{why} runs CUDA's flash kernel, which takes bf16 or fp16, not {job.precision}",
            "use precision bf16 (or auto)" + (", or cp=1" if not b.sinks else ""))
    if job.fp8 not in FP8_RECIPES:
        add(f"fp8 {job.fp8!r} is not a recipe", "use tensorwise or rowwise (torchao's), or '' for bf16 GEMMs")
    if job.schedule not in SCHEDULES:
        add(f"pipeline.schedule {job.schedule!r} is unknown", f"use one of {', '.join(SCHEDULES)}")
    elif g.pp > 1:
        out += _pipeline_problems(model, job)
    return out


def _pipeline_problems(model: ModelConfig, job: Job) -> list[Problem]:
    out = []
    pp, virtual, micro = job.layout.pp, job.virtual, job.microbatches
    if virtual < 1 or (virtual > 1) != (job.schedule == "interleaved-1f1b"):
        out.append(Problem(f"pipeline.virtual={virtual} does not go with the {job.schedule} schedule",
                           "use virtual >= 2 with interleaved-1f1b and virtual = 1 otherwise"))
    elif job.schedule != "gpipe" and micro < pp:
        out.append(Problem(f"{job.schedule} needs at least pp={pp} micro-batches per step, and a replica gets {micro}",
                           f"raise batch.global_batch to {pp * job.layout.dp * job.micro_batch} or more, lower the "
                           "micro-batch, or use the gpipe schedule"))
    elif job.schedule == "interleaved-1f1b" and micro % pp:
        out.append(Problem(f"interleaved-1f1b needs the micro-batches per step ({micro}) to be a multiple of pp={pp}",
                           f"use a global batch that gives a multiple of {pp} micro-batches per replica"))
    if virtual >= 1:
        try:
            split_layers(model.layers, pp * virtual, job.stage_layers)
        except ValueError as e:
            what, _, fix = str(e).partition("; ")
            out.append(Problem(what, fix or "change pipeline.stage_layers"))
    return out


def check(model: ModelConfig, job: Job, *, world: int | None = None, gpu: bool = False,
          attention: str = "causal") -> None:
    """Raise JobError listing every problem of `problems`."""
    found = problems(model, job, world=world, gpu=gpu, attention=attention)
    if found:
        raise JobError(found)
