"""Collectives as autograd functions: each forward op paired with the backward op it implies.

Which pair is right depends on how the ranks of the group use the result:
- `all_reduce_replicated`: the sum is used identically on every rank (the rest of the
  computation is replicated), so the backward is the identity.
- `reduce_scatter` (backward all-gather) and `all_gather` (backward reduce-scatter) along a dim;
  `all_gather_weight` for a weight's z shards (its gradient summed in fp32 at least).
- `all_gather_replicated`: parts gathered into a tensor every rank uses whole, so the backward
  keeps each rank's own part.
- `all_to_all_rows`: rows sent to the ranks that use them (uneven splits), their gradients sent back.
- `scatter_tokens`, `gather_tokens_replicated`, `own_tokens`: the same over a micro-batch's tokens
  (sequence parallelism). A rank's share of [batch, seq, f] is a contiguous range of its tokens
  flattened in order, [batch*seq/g] rows viewed as [batch, seq/g, f] (whole sequences where g divides
  the batch; with one sequence, a slice of it): its collectives then copy nothing whatever the batch,
  where a slice of every sequence would be strided (`tensor.linear` keeps the same order).
(The norms' statistics, summed over x and used by each rank's feature slice, have their own
autograd function in `norm.py`.)
"""

from __future__ import annotations

import torch

from fourfold.parallel import comm
from fourfold.parallel.comm import Group


class _AllReduceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.reduce_scatter(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=ctx.dim), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad, ctx.group, dim=ctx.dim), None, None


class _AllGatherWeight(_AllGather):
    """A weight's z shards gathered: its gradient is reduce-scattered in fp32 at least (as the
    linears' in `overlap.py`), then cast back to the weight's dtype."""

    @staticmethod
    def backward(ctx, grad):
        wide = grad.to(comm.at_least_fp32(grad.dtype))
        return comm.reduce_scatter(wide, ctx.group, dim=ctx.dim).to(grad.dtype), None, None


class _AllGatherReplicated(torch.autograd.Function):
    """Each rank's part gathered into a tensor every rank then uses whole and identically (the
    per-token losses of the tokens each x rank scored): the gradient of a rank's part is its own
    part of the gradient, not a sum over the ranks."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size, ctx.dim)[ctx.group.rank].contiguous(), None, None


class _SumGradients(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over the group (each rank's features give a part
    of it): the mirror of `_AllReduceReplicated`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous(), ctx.group), None


class _OwnPart(torch.autograd.Function):
    """A tensor replicated over the group cut to this rank's part of `dim`; the gradient parts
    gathered back: the mirror of `_AllGatherReplicated`."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.chunk(group.size, dim=dim)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


class _AllToAllRows(torch.autograd.Function):
    """Rows sent to the ranks that use them (a mixture's dispatch, and its combine back): the
    gradient of each row goes back to the rank it came from, by the reverse exchange."""

    @staticmethod
    def forward(ctx, x, group, send, recv):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return comm.all_to_all_rows(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_to_all_rows(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def all_to_all_rows(x: torch.Tensor, group: Group, send: list[int], recv: list[int]) -> torch.Tensor:
    return x if group.size == 1 else _AllToAllRows.apply(x, group, send, recv)


def sum_gradients(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _SumGradients.apply(x, group)


def own_part(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if group.size == 1 else _OwnPart.apply(x, group, dim % x.dim())


def all_reduce_replicated(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _AllReduceReplicated.apply(x, group)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatter.apply(x, group, dim % x.dim())


def all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if group.size == 1 else _AllGather.apply(x, group, dim % x.dim())


def all_gather_weight(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if group.size == 1 else _AllGatherWeight.apply(x, group, dim % x.dim())


def all_gather_replicated(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if group.size == 1 else _AllGatherReplicated.apply(x, group, dim % x.dim())


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """[batch, seq, f] as the one row of tokens [1, batch*seq, f] that token collectives split (a view)."""
    return x.reshape(1, -1, x.shape[-1])


def scatter_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    return reduce_scatter(token_rows(x), group, 1).view(x.shape[0], -1, x.shape[-1])


def gather_tokens_replicated(x: torch.Tensor, group: Group) -> torch.Tensor:
    return all_gather_replicated(token_rows(x), group, 1).view(x.shape[0], -1, x.shape[-1])


def own_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    return own_part(token_rows(x), group, 1).view(x.shape[0], -1, x.shape[-1])
