"""The collectives the runtime uses, each counted in a ledger of bytes sent per (group, op).

Every op takes a `Group` (from `Grid.group`), runs blocking or, with `async_op=True`, returns a
`Pending` whose `wait()` gives the result. Ops on a group of one rank are free: nothing is sent
and nothing is recorded. The figure recorded is `fourfold.spec.volumes.bytes_sent`, the ring volume.
The time a rank waits for an op (its blocking call, or an async one's `wait()`) goes to the
group's `Clock` (`parallel.clock`), under the group's kind of wait.

gloo carries out `reduce_scatter_tensor` as a full all-reduce (docs/cpu.md); on gloo,
`reduce_scatter` is an all-to-all followed by a local sum over the sources in rank order, which
computes the same result about 2x faster and sends exactly the ring reduce-scatter's volume.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from fourfold.parallel.clock import Clock, kind_of
from fourfold.spec.volumes import bytes_sent


class Ledger:
    """Bytes this rank sent, per (group name, op), and the number of calls."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self._calls: Counter[tuple[str, str]] = Counter()

    def record(self, group: str, op: str, nbytes: Fraction) -> None:
        self._bytes[(group, op)] += nbytes
        self._calls[(group, op)] += 1

    def bytes(self) -> dict[tuple[str, str], Fraction]:
        return dict(self._bytes)

    def calls(self) -> dict[tuple[str, str], int]:
        return dict(self._calls)

    def total(self) -> Fraction:
        return sum(self._bytes.values(), Fraction(0))

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()

    def table(self) -> str:
        rows = [f"{'group':<8} {'op':<15} {'calls':>6} {'MiB sent':>12}"]
        for (group, op), nbytes in sorted(self._bytes.items()):
            rows.append(f"{group:<8} {op:<15} {self._calls[(group, op)]:>6} {float(nbytes) / 2**20:>12.4f}")
        rows.append(f"{'total':<8} {'':<15} {sum(self._calls.values()):>6} {float(self.total()) / 2**20:>12.4f}")
        return "\n".join(rows)


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """Gradients accumulate, are summed across ranks and master weights live in fp32 (float64
    stays float64)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class Group:
    """A process group along one grid dim (or several, named like 'dp_cp'), with its ledger."""

    name: str
    process_group: dist.ProcessGroup | None
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this rank's index in `ranks`
    ledger: Ledger = field(repr=False, compare=False)
    clock: Clock | None = field(default=None, repr=False, compare=False)  # None: waits not timed

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_gloo(self) -> bool:
        return dist.get_backend(self.process_group) == "gloo"

    def _record(self, op: str, message: torch.Tensor) -> None:
        self.ledger.record(self.name, op, bytes_sent(op, self.size, message.numel() * message.element_size()))

    def waiting(self):
        """A context in which this rank waits for one of the group's ops (timed by its clock)."""
        return self.clock.span(kind_of(self.name)) if self.clock is not None else contextlib.nullcontext()

    def blocking(self, async_op: bool):
        """The context of issuing an op: the wait itself when it blocks (an async one is timed at `wait`)."""
        return contextlib.nullcontext() if async_op else self.waiting()


class Pending:
    """An async collective in flight: `wait()` finishes it and returns its result."""

    def __init__(self, works: Sequence[dist.Work], finish: Callable[[], torch.Tensor | None],
                 group: Group | None = None):
        self._works = works
        self._finish = finish
        self._group = group

    def wait(self) -> torch.Tensor | None:
        if self._works:
            with self._group.waiting():
                for work in self._works:
                    work.wait()
        return self._finish()

    @staticmethod
    def done(result: torch.Tensor | None) -> "Pending":
        return Pending((), lambda: result)


def _run(works, finish, async_op: bool, group: Group):
    pending = Pending([w for w in works if w is not None], finish, group)
    return pending if async_op else pending.wait()


# Recent torch names the single-tensor collectives *_single (and deprecates the old names); the
# torch >= 2.7 this package accepts may only have all_gather_into_tensor / reduce_scatter_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(tensor: torch.Tensor, group: Group, dim: int = 0, async_op: bool = False,
               out: torch.Tensor | None = None):
    """Concatenate every rank's `tensor` along `dim`, in group-rank order (a contiguous result).
    `out`: a flat tensor of group.size times a 1-D `tensor`'s elements to gather into (the result)."""
    if out is not None and (tensor.dim() != 1 or out.shape != (group.size * tensor.numel(),)):
        raise ValueError(f"all_gather into a buffer takes a 1-D tensor and a buffer of {group.size} times its "
                         f"elements; got {tuple(tensor.shape)} into {tuple(out.shape)}")
    if group.size == 1:
        result = tensor if out is None else out.copy_(tensor)
        return Pending.done(result) if async_op else result
    dim %= tensor.dim()
    tensor = tensor.contiguous()
    out = tensor.new_empty((group.size, *tensor.shape)) if out is None else out.view(group.size, -1)
    group._record("all_gather", out)
    # gloo wants flat buffers for the single-tensor form.
    with group.blocking(async_op):
        work = _all_gather_single(out.view(-1), tensor.view(-1), group=group.process_group, async_op=async_op)
    return _run([work], lambda: out.movedim(0, dim).flatten(dim, dim + 1), async_op, group)


def reduce_scatter(tensor: torch.Tensor, group: Group, dim: int = 0, async_op: bool = False,
                   out: torch.Tensor | None = None):
    """Sum `tensor` over the group and keep this rank's 1/g slice along `dim` (a contiguous result:
    the attention kernels and GEMMs that read it need unit stride on the last dim). `out` may be
    this rank's own slice of `tensor` (dim 0): reduced in place, as NCCL allows."""
    if group.size == 1:
        return Pending.done(tensor) if async_op else tensor
    g = group.size
    dim %= tensor.dim()
    if tensor.shape[dim] % g:
        raise ValueError(f"reduce_scatter over {group.name}: dim {dim} of size {tensor.shape[dim]} is not divisible "
                         f"by {g}")
    chunks = tensor.unflatten(dim, (g, -1)).movedim(dim, 0).contiguous()  # chunks[j] goes to rank j
    group._record("reduce_scatter", chunks)
    if group.is_gloo:
        received = torch.empty_like(chunks)
        with group.blocking(async_op):
            work = dist.all_to_all_single(received, chunks, group=group.process_group, async_op=async_op)
        return _run([work], lambda: torch.sum(received, 0, out=out), async_op, group)
    out = chunks.new_empty(chunks.shape[1:]) if out is None else out
    with group.blocking(async_op):
        work = _reduce_scatter_single(out, chunks, group=group.process_group, async_op=async_op)
    return _run([work], lambda: out, async_op, group)


def all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """Reduce `tensor` in place over the group (sum by default) and return it."""
    if group.size == 1:
        return Pending.done(tensor) if async_op else tensor
    group._record("all_reduce", tensor)
    with group.blocking(async_op):
        work = dist.all_reduce(tensor, op=op, group=group.process_group, async_op=async_op)
    return _run([work], lambda: tensor, async_op, group)


def all_to_all(tensor: torch.Tensor, group: Group, async_op: bool = False):
    """Send chunk j of `tensor` (split along dim 0) to group rank j; returns the received chunks."""
    if group.size == 1:
        return Pending.done(tensor) if async_op else tensor
    if tensor.shape[0] % group.size:
        raise ValueError(f"all_to_all over {group.name}: dim 0 of size {tensor.shape[0]} is not divisible "
                         f"by {group.size}")
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    group._record("all_to_all", tensor)
    with group.blocking(async_op):
        work = dist.all_to_all_single(out, tensor, group=group.process_group, async_op=async_op)
    return _run([work], lambda: out, async_op, group)


def all_to_all_rows(tensor: torch.Tensor, group: Group, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
    """Send rows [sum(send[:j]), sum(send[:j+1])) of `tensor` to group rank j, receiving recv[j] rows
    from rank j, in rank order (uneven splits: a mixture's token dispatch). Recorded as the bytes
    this rank really sends to the others ("all_to_all_v"), its own rows excluded."""
    if group.size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    row = math.prod(tensor.shape[1:]) * tensor.element_size()  # (an empty tensor has rows of a size too)
    group.ledger.record(group.name, "all_to_all_v", Fraction((sum(send) - send[group.rank]) * row))
    with group.waiting():
        dist.all_to_all_single(out, tensor, output_split_sizes=list(recv), input_split_sizes=list(send),
                               group=group.process_group)
    return out


def gather_to_first(tensor: torch.Tensor, group: Group) -> torch.Tensor | None:
    """Every rank's `tensor` stacked in group-rank order on the group's first rank; None on the
    others (a report's few numbers a rank: no rank but the first receives them all)."""
    if group.size == 1:
        return tensor[None]
    tensor = tensor.contiguous()
    out = tensor.new_empty((group.size, *tensor.shape)) if group.rank == 0 else None  # (one buffer, its rows received)
    group.ledger.record(group.name, "gather", Fraction(tensor.numel() * tensor.element_size() if group.rank else 0))
    with group.waiting():
        dist.gather(tensor, list(out.unbind(0)) if out is not None else None, dst=group.ranks[0],
                    group=group.process_group)
    return out


def reduce_to_first(tensor: torch.Tensor, group: Group) -> torch.Tensor | None:
    """The sum of every rank's `tensor` on the group's first rank (in place there); None on the others."""
    if group.size == 1:
        return tensor
    tensor = tensor.contiguous()
    group.ledger.record(group.name, "reduce", Fraction(tensor.numel() * tensor.element_size()))  # (a tree's: once)
    with group.waiting():
        dist.reduce(tensor, dst=group.ranks[0], group=group.process_group)
    return tensor if group.rank == 0 else None


def send(tensor: torch.Tensor, peer: int, group: Group) -> None:
    """Blocking send to group rank `peer`."""
    group._record("send", tensor)
    with group.waiting():
        dist.send(tensor.contiguous(), dst=group.ranks[peer], group=group.process_group)


def recv(tensor: torch.Tensor, peer: int, group: Group) -> torch.Tensor:
    """Blocking receive from group rank `peer` into `tensor`."""
    with group.waiting():
        dist.recv(tensor, src=group.ranks[peer], group=group.process_group)
    return tensor


@dataclass(frozen=True)
class P2P:
    """One point-to-point transfer of a batch: `kind` is 'send' or 'recv', `peer` a group rank."""

    kind: str
    tensor: torch.Tensor
    peer: int


def batch_p2p(transfers: Sequence[P2P], group: Group, async_op: bool = False):
    """Launch sends and receives together (no ordering deadlocks); returns the received tensors."""
    ops = []
    for t in transfers:
        if t.kind not in ("send", "recv"):
            raise ValueError(f"P2P kind {t.kind!r} must be 'send' or 'recv'")
        if t.peer == group.rank:
            raise ValueError(f"P2P {t.kind} to itself (group rank {t.peer} of {group.name}); copy the tensor instead")
        if t.kind == "send":
            group._record("send", t.tensor)
        func = dist.isend if t.kind == "send" else dist.irecv
        ops.append(dist.P2POp(func, t.tensor, group.ranks[t.peer], group.process_group))
    works = dist.batch_isend_irecv(ops) if ops else []
    received = [t.tensor for t in transfers if t.kind == "recv"]
    return _run(works, lambda: received, async_op, group)


def host_group() -> dist.ProcessGroup:
    """A gloo group of every rank for host-side work beside the device collectives (the async
    checkpoint's coordination, the stop agreement), connected on first use between the ranks that
    talk, not every pair at creation (16,384 ranks would open 16,383 sockets each)."""
    lazy = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        return dist.new_group(backend="gloo")
    finally:
        if lazy is None:
            del os.environ["TORCH_GLOO_LAZY_INIT"]
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = lazy
