"""Vocabulary-parallel embedding, LM head and cross-entropy: no rank ever holds the full logits.

The table [V, H] is laid out like an x-in weight (H over x, V over y, flat over z), so a tied LM
head is the same parameter. The head reduce-scatters its partial logits over x by tokens, so each
rank holds and scores 1/(x*y) of the [tokens, V] logits (an all-reduce would leave every x rank
the same [tokens, V/y] and the same fp32 softmax). The cross-entropy over V/y logits all-reduces
three vectors over y (the max, the sum of exponentials, the target's logit); the per-token losses
of the x ranks are then gathered.

When y does not divide the vocabulary, both tables are padded to `rules.padded_vocab` rows: the
padding is a source of rows named PADDING, which the layers keep out of their layouts (so out of
checkpoints, gradient norms and exports) and out of their gathered weights; its rows are zero, and
the head sets their logits to -inf, so the loss, sampling and evaluation never see them.

A tied head on the last pipeline stage is a copy of the first stage's table (`LMHead.hold_copy`;
`fourfold.parallel.pipeline` keeps the two equal and sums their gradients into the embedding's).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fourfold.parallel import comm
from fourfold.parallel.comm import Group
from fourfold.parallel.grid import Grid
from fourfold.parallel.overlap import Overlapper
from fourfold.parallel.tensor.linear import SEQ_DIM, ParallelLinear, RowSource, ShardedMatrix
from fourfold.parallel.tensor.params import ParallelModule, ParamLayout, Piece, Read
from fourfold.parallel.tensor.regions import (
    all_gather_replicated,
    all_gather_weight,
    all_reduce_replicated,
    scatter_tokens,
)
from fourfold.spec.rules import loss_chunk_tokens, padded_vocab

PADDING = "(vocabulary padding)"  # not a serial parameter's name


def _vocab_rows(name: str, vocab: int, grid: Grid) -> list[RowSource]:
    """The table's rows: the vocabulary's, then any padding up to `padded_vocab`."""
    pad = padded_vocab(vocab, grid.size("y")) - vocab
    return [RowSource(name, 0, vocab)] + ([RowSource(PADDING, 0, pad)] if pad else [])


def _real(pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
    return tuple(p for p in pieces if p.name != PADDING)


def _zero_padding(weight: torch.Tensor, matrix: ShardedMatrix) -> None:
    """Zero the padded rows' elements (initialised as if they were a parameter's)."""
    for p in matrix.pieces():
        if p.name == PADDING:
            weight[p.local_start : p.local_start + p.flat[1] - p.flat[0]] = 0


def _padded_read(read: Read, dtype: torch.dtype) -> Read:
    """`read`, giving zeros for the padded rows (no checkpoint has them)."""

    def padded(name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        if name != PADDING:
            return read(name, rows, cols)
        return torch.zeros(rows.stop - rows.start, cols.stop - cols.start, dtype=dtype)

    return padded


def _without_padding(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights.pop(PADDING, None)
    return weights


class _AddToGrad(torch.autograd.Function):
    """The identity, whose backward adds `more()` to the gradient."""

    @staticmethod
    def forward(ctx, weight, more: Callable[[], torch.Tensor]):
        ctx.more = more
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad + ctx.more().to(grad.dtype), None


def _zero_row(weight: torch.Tensor, matrix: ShardedMatrix, name: str, row: int) -> None:
    """Zero this rank's elements of row `row` of the serial tensor `name` (a flat shard's pieces)."""
    for p in matrix.pieces():
        r = row - p.offset[0]
        if p.name != name or not 0 <= r < p.window[0]:
            continue
        cols = p.window[1]
        lo, hi = max(p.flat[0], r * cols), min(p.flat[1], (r + 1) * cols)
        if lo < hi:
            weight[p.local_start + lo - p.flat[0] : p.local_start + hi - p.flat[0]] = 0


class ParallelEmbedding(ParallelModule):
    """The vocabulary-parallel table's lookup. `padding_idx`, as nn.Embedding's: that row starts at
    zero and gets no gradient from the lookup (transformers' embeddings, `ModelConfig.pad_token`)."""

    def __init__(self, grid: Grid, vocab: int, hidden: int, *, seed: int, std: float, seq_parallel: bool,
                 dtype: torch.dtype, name: str = "embed", padding_idx: int | None = None):
        super().__init__()
        self.grid, self.seq_parallel, self.name, self.padding_idx = grid, seq_parallel, name, padding_idx
        self.matrix = ShardedMatrix(grid, _vocab_rows(name, vocab, grid), hidden, "x-in", name)
        self.seed, self.std = seed, std
        self.weight = nn.Parameter(torch.empty(self.matrix.shard_numel, dtype=dtype))
        # Set for one forward: its backward adds `add_grad()` to the shard's gradient (a tied
        # head's, sent by the last pipeline stage).
        self.add_grad: Callable[[], torch.Tensor] | None = None
        self.initialise()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.copy_(self.matrix.init_shard(self.seed, self.std, self.weight.dtype))
        _zero_padding(self.weight, self.matrix)
        if self.padding_idx is not None:
            _zero_row(self.weight, self.matrix, self.name, self.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [batch/z, seq] -> [batch/z, seq (/y with sequence parallelism), hidden/x]."""
        y_group = self.grid.group("y")
        rows = self.matrix.block_shape[0]
        weight = self.weight
        if self.add_grad is not None:
            weight, self.add_grad = _AddToGrad.apply(weight, self.add_grad), None
        table = self.matrix.unpad(all_gather_weight(weight, self.grid.group("z"), dim=0))
        local = ids - y_group.rank * rows
        inside = (local >= 0) & (local < rows)
        pad = None if self.padding_idx is None else self.padding_idx - y_group.rank * rows
        pad = pad if pad is not None and 0 <= pad < rows else None  # (the row is this y rank's)
        partial = F.embedding(local.clamp(0, rows - 1), table, padding_idx=pad) * inside.unsqueeze(-1).to(table.dtype)
        if self.seq_parallel:
            return scatter_tokens(partial, y_group)
        return all_reduce_replicated(partial, y_group)

    def load(self, read, put) -> None:
        put(self.weight, self.matrix.read_shard(_padded_read(read, self.weight.dtype)))

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        return _without_padding(self.matrix.gather_full(pick(self.weight).detach()))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        return {self.weight: ParamLayout((), (), _real(self.matrix.pieces()))}


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The loss of logits [tokens, V/y] split over y, scored in fp32 at least a chunk of tokens at a
    time (`rules.loss_chunk_tokens`), so that no fp32 copy of the logits is ever whole: the forward keeps
    the logits as they came (bf16 on GPUs) with two floats a token, and the backward rebuilds each
    chunk's softmax from them and writes its gradient over them (the logits are not needed after)."""

    @staticmethod
    def forward(ctx, logits, targets, group: Group):
        rows, shape = logits.shape[-1], targets.shape
        flat, compute = logits.reshape(-1, rows), torch.promote_types(logits.dtype, torch.float32)
        targets = targets.reshape(-1)
        scored = targets >= 0  # negative targets (padding) score 0 and get no gradient
        local = targets - group.rank * rows
        inside = (local >= 0) & (local < rows) & scored
        local = local.clamp(0, rows - 1)
        # The max only stabilises the exponentials; it needs no gradient.
        top = comm.all_reduce(flat.detach().amax(-1).to(compute), group, op=dist.ReduceOp.MAX)
        target, sum_exp = torch.zeros_like(top), torch.zeros_like(top)
        for part in _chunks(flat):
            shifted = flat[part].to(compute) - top[part].unsqueeze(-1)
            # where, not a product: a padded column's logit is -inf
            target[part] = torch.where(inside[part], shifted.gather(-1, local[part].unsqueeze(-1)).squeeze(-1), 0)
            sum_exp[part] = shifted.exp_().sum(-1)
            del shifted  # (else it is alive beside the next chunk's cast and difference)
        target, sum_exp = comm.all_reduce(target, group), comm.all_reduce(sum_exp, group)
        ctx.save_for_backward(logits, top, sum_exp, local, inside, scored)
        ctx.consume = logits.grad_fn is not None  # a leaf's values are its user's: not written over
        return ((sum_exp.log() - target) * scored).view(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, top, sum_exp, local, inside, scored = ctx.saved_tensors
        flat, compute, grad_loss = logits.reshape(-1, logits.shape[-1]), top.dtype, grad_loss.reshape(-1)
        flat = flat if ctx.consume else flat.clone()
        for part in _chunks(flat):
            grad = (flat[part].to(compute) - top[part].unsqueeze(-1)).exp_()
            grad.div_(sum_exp[part].unsqueeze(-1)).mul_(scored[part].unsqueeze(-1))
            grad.scatter_add_(-1, local[part].unsqueeze(-1), -inside[part].unsqueeze(-1).to(compute))
            flat[part] = grad.mul_(grad_loss[part].unsqueeze(-1))  # (rounded to the logits' dtype)
            del grad
        return flat.view(logits.shape), None, None


def _chunks(flat: torch.Tensor) -> list[slice]:
    step = loss_chunk_tokens(flat.shape[-1])
    return [slice(start, start + step) for start in range(0, len(flat), step)]


class LMHead(ParallelLinear):
    """The LM head [V, H]: an x-in linear on the tokens flattened into one row ([1, tokens, H/x];
    its input gathered over y with sequence parallelism), whose logits are reduce-scattered over x
    by tokens: [1, tokens/x, V/y] (V padded, its padded columns -inf). Flattened, this x rank's share
    is a contiguous range of the GEMM's output, so the reduce-scatter copies nothing whatever the batch."""

    def __init__(self, grid: Grid, hidden: int, vocab: int, **options):
        super().__init__(grid, hidden, _vocab_rows("lm_head", vocab, grid), "x-in", reduction="scatter_tokens",
                         name="lm_head", **options)
        self.vocab = vocab
        self.copy_grad: torch.Tensor | None = None  # a copy's gradient (`hold_copy`)

    def hold_copy(self) -> None:
        """Make this tied head (its rows the embedding's) a copy of the table on a pipeline stage
        without the embedding: the weight leaves the module's parameters (no gradient bucket,
        optimizer state, checkpoint or export entry: the first stage's parameter has them) and its
        gradient accumulates over a step's micro-batches in `copy_grad` (fp32 at least), which
        `pipeline.Pipeline` adds to the embedding's, as it sets the copy from the table. Its dW is
        reduced over z at once (a deferred one lands in GradientSync, which does not hold it), and
        handed over in fp32."""
        weight = self.weight.detach().requires_grad_()
        del self.weight
        self.register_buffer("weight", weight, persistent=False)
        self.copy_grad = torch.zeros_like(weight, dtype=comm.at_least_fp32(weight.dtype))
        weight.register_post_accumulate_grad_hook(self._accumulate)
        options = dataclasses.replace(self.overlap.options, prefetch_weights=False, defer_weight_grads=False)
        self.overlap = Overlapper(options, self.grid.group("z"))
        self.overlap.on_grad_landed = self._accumulate

    def _accumulate(self, weight: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        grad = weight.grad if grad is None else grad
        if grad is not None:
            self.copy_grad += grad
        weight.grad = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        _zero_padding(self.weight, self.matrix)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().forward(h.reshape(1, -1, h.shape[-1]))
        rows = self.matrix.block_shape[0]
        first_padded = max(0, self.vocab - self.grid.coords["y"] * rows)  # this y rank's first padded column
        if first_padded < rows:  # in place, outside autograd (no copy of the gradient: exp(-inf) gives it 0 there)
            logits.detach()[..., first_padded:] = float("-inf")
        return logits

    def load(self, read, put) -> None:
        super().load(_padded_read(read, self.weight.dtype), put)

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        return {} if self.copy_grad is not None else _without_padding(super().full_weights(pick))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        if self.copy_grad is not None:
            return {}
        return {p: dataclasses.replace(layout, pieces=_real(layout.pieces))
                for p, layout in super().param_layouts().items()}


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Per-token loss [batch, seq] from the head's logits [1, tokens/x, V/y] (this x rank's tokens,
    the vocabulary split over y) and global target ids [batch, seq]; a negative target marks
    padding: its loss is 0. Every x rank returns every token's loss. The loss consumes the logits:
    its backward writes their gradient over them (the largest tensor of the step is not copied)."""
    x = grid.group("x")
    mine = targets.reshape(1, -1).chunk(x.size, dim=SEQ_DIM)[x.rank]  # the head's tokens: in order, flattened
    # bf16 logits are scored in fp32 (as Megatron does), a chunk at a time; float64 stays float64
    scored = _VocabParallelCrossEntropy.apply(logits, mine, grid.group("y"))
    return all_gather_replicated(scored, x, SEQ_DIM).view(targets.shape)
