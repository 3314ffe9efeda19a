"""Data parallelism over dp*cp: bucketed gradient reduction launched during backward.

Each parameter's gradient is reduced over dp and cp, plus the tensor dims its layout names in
`grad_sum` (a norm weight's tokens were split over z too), so one collective per bucket does
both; an expert's weight under expert parallelism over its replicas only (`Grid.expert_group`).
An expert's bias is summed over tensor dims too (GPT-OSS's: its tokens split over z, its slice
filled by one x or y rank): no group spans the expert replicas and those dims, so its bucket is first
all-reduced over the tensor dims, then reduced over the replicas (two small collectives a step).
Buckets fill in the order gradients become final in backward (the order layers really run), each
launched asynchronously when full; the rest are launched by `finish()`. Under
gradient accumulation, hooks only accumulate until the micro-batch that is run with `sync=True`.

Memory (as Megatron's distributed optimizer): once the buckets are known, each owns one flat fp32
buffer and its parameters' accumulators are views into it, so a bucket is reduced in place (the
reduce-scatter writes this rank's shard over its own slice); the optimizer (fourfold.parallel.optimizer)
reads the reduced shard there and `release` zeroes the buffer for the next step. No copy of the
gradients is ever made. With ZeRO-1 the parameters too are views of one flat buffer a bucket, in
their own dtype, into which the updated shards are all-gathered (`set_params`): no copy either.

The parameter all-gather can be hidden (`set_params(..., overlap=True)`, Megatron's
overlap_param_gather, FSDP2's prefetch): each bucket's gather is launched after the update in
forward order (the last bucket filled in backward holds the first layers), and a module's forward
waits only for the buckets of its own parameters (a forward pre-hook; a z weight's prefetch waits
for its bucket too), so the gathers run behind the layers before them. Whatever reads parameters
outside a forward (a checkpoint, a pipeline's tied copy) calls `wait_for` or `flush` first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from fourfold.parallel import comm
from fourfold.parallel.comm import Group, Pending, at_least_fp32
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.linear import ParallelLinear
from fourfold.parallel.tensor.params import layouts


@dataclass
class Bucket:
    group: Group
    params: list[nn.Parameter] = field(default_factory=list)
    ids: set[int] = field(default_factory=set)
    numel: int = 0
    pending: Pending | None = None
    reduced: torch.Tensor | None = None  # this rank's shard (ZeRO-1) or the whole bucket
    buffer: torch.Tensor | None = None  # the accumulators, padded to the group (main_grads are views)
    weights: torch.Tensor | None = None  # ZeRO-1: the parameters, padded to the group (they are views)
    gathering: Pending | None = None  # the updated parameters' all-gather in flight
    tensor_sum: Group | None = None  # an expert bias bucket's tensor dims, summed before `group`

    def padded(self) -> int:
        return -(-self.numel // self.group.size) * self.group.size

    def shard_range(self, sharded: bool) -> tuple[int, int]:
        if not sharded:
            return 0, self.padded()
        n = self.padded() // self.group.size
        return self.group.rank * n, (self.group.rank + 1) * n

    def segments(self, lo: int, hi: int) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """Each parameter's part of the bucket's flat range [lo, hi) (its parameters laid end to
        end): (parameter, start and end within the parameter, start within the range)."""
        offset = 0
        for p in self.params:
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b:
                yield p, a - offset, b - offset, a - lo
            offset += p.numel()


class GradientSync:
    """Owns the gradient accumulators (`main_grads[param]`, fp32 at least) and reduces them in buckets.

    The first synchronised backward is traced: buckets are filled in the order gradients become
    final and each parameter's number of gradient arrivals is counted (a tied weight gets two);
    everything is reduced at `finish()`. From then on a bucket is launched, async, as soon as
    each of its parameters has had all its arrivals."""

    def __init__(self, model: nn.Module, grid: Grid, *, bucket_mb: float = 25.0, shard: bool = True):
        self.grid, self.shard = grid, shard
        self.bucket_bytes = bucket_mb * 2**20
        self.layouts = layouts(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main_grads = {p: torch.zeros_like(p, dtype=at_least_fp32(p.dtype)) for p in self.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        # Deferred weight gradients land after autograd's hooks have run (fourfold.parallel.overlap);
        # a prefetched z weight block is gathered from its parameter once that is up to date.
        for layer in model.modules():  # (a tied head's copy on the last stage, a buffer, keeps its own: vocab.py)
            if isinstance(layer, ParallelLinear) and isinstance(layer.weight, nn.Parameter):
                layer.overlap.on_grad_landed = self._on_grad
                if shard:
                    layer.overlap.before_read = self.wait_for
        # With ZeRO-1 a forward waits for its own parameters' gathers (`set_params`); replicated, none is
        # gathered. A module that reads its submodules' parameters without calling their forwards (a
        # block compiled whole: a wait inside would break its graph; a mixture's experts, run as one
        # GEMM per linear) says so (`reads_all_parameters`): it waits for all of them, its modules not again.
        inside = {id(m) for outer in model.modules() if getattr(outer, "reads_all_parameters", False)
                  for m in outer.modules() if m is not outer}
        for module in model.modules() if shard else ():
            if id(module) not in inside and next(self._own(module), None) is not None:
                module.register_forward_pre_hook(self._before_forward)
        self._gathering: dict[int, Bucket] = {}  # parameter id -> its bucket, while its gather is in flight
        # Groups are created collectively by every rank; pipeline stages hold different
        # parameters, so each rank creates every group a bucket might use, now, in one order.
        for r in range(4):
            for dims in itertools.combinations(("x", "y", "z"), r):
                grid.group(("dp", "cp", *dims))
                if dims and grid.layout.ep > 1:  # an expert bias bucket's tensor sum
                    grid.group(dims)
        grid.expert_group("edp")
        self.sync = True
        self.buckets: list[Bucket] = []
        self._expected: dict[int, int] = {}  # arrivals per parameter, from the traced backward
        self._arrived: dict[int, int] = {}
        self._open: dict[tuple[str, ...], Bucket] = {}
        self._traced = False

    def _on_grad(self, p: nn.Parameter, grad: torch.Tensor | None = None) -> None:
        """A gradient of `p` arrived: autograd's, in `p.grad`, or a z-reduced one handed over in
        fp32 (`grad`, from `overlap.Overlapper`)."""
        grad = p.grad if grad is None else grad
        if grad is None:  # autograd calls the hook even when a layer handed its gradient over
            return
        self.main_grads[p] += grad
        p.grad = None
        if not self.sync:
            return
        self._arrived[id(p)] = self._arrived.get(id(p), 0) + 1
        if not self._traced:
            if self._arrived[id(p)] == 1:
                self._place(p)
            return
        for bucket in self.buckets:
            if bucket.pending is None and id(p) in bucket.ids and all(
                    self._arrived.get(i, 0) == self._expected[i] for i in bucket.ids):
                self._launch(bucket)

    def _place(self, p: nn.Parameter) -> None:
        layout = self.layouts[p]
        key = ("edp", *layout.grad_sum) if layout.expert else ("dp", "cp", *layout.grad_sum)
        bucket = self._open.get(key)
        if bucket is None:
            group = self.grid.expert_group("edp") if layout.expert else self.grid.group(key)
            tensor_sum = self.grid.group(layout.grad_sum) if layout.expert and layout.grad_sum else None
            bucket = self._open[key] = Bucket(group, tensor_sum=tensor_sum)
            self.buckets.append(bucket)
        bucket.params.append(p)
        bucket.ids.add(id(p))
        bucket.numel += p.numel()
        if bucket.numel * 4 >= self.bucket_bytes:
            del self._open[key]

    def _launch(self, bucket: Bucket) -> None:
        if bucket.tensor_sum is not None:
            comm.all_reduce(bucket.buffer, bucket.tensor_sum)
        if self.shard:
            lo, hi = bucket.shard_range(True)
            bucket.pending = comm.reduce_scatter(bucket.buffer, bucket.group, async_op=True, out=bucket.buffer[lo:hi])
        else:
            bucket.pending = comm.all_reduce(bucket.buffer, bucket.group, async_op=True)

    def _allocate_buffer(self, bucket: Bucket) -> None:
        """Move the bucket's accumulators into one flat buffer (after the traced backward), and with
        ZeRO-1 its parameters into another, in their dtype (the all-gather's output)."""
        first = self.main_grads[bucket.params[0]]
        bucket.buffer = torch.zeros(bucket.padded(), dtype=first.dtype, device=first.device)
        if self.shard:
            param = bucket.params[0]
            bucket.weights = torch.zeros(bucket.padded(), dtype=param.dtype, device=param.device)
        for p, _, numel, at in bucket.segments(0, bucket.numel):  # whole parameters
            view = bucket.buffer[at : at + numel].view_as(p)
            view.copy_(self.main_grads[p])
            self.main_grads[p] = view  # the old accumulator is freed here, one bucket at a time
            if self.shard:
                weights = bucket.weights[at : at + numel].view_as(p)
                weights.copy_(p.detach())
                p.data = weights  # (the same Parameter: hooks, optimizer and layers keep it)

    def finish(self) -> list[Bucket]:
        """Launch what is left and wait for every bucket; `bucket.reduced` is then its reduced
        gradient (this rank's shard with ZeRO-1), valid until `release(bucket)`."""
        if not self._traced:
            for p in self.params:  # parameters that got no gradient still need a bucket
                if id(p) not in self._arrived:
                    self._place(p)
            self._expected = {id(p): self._arrived.get(id(p), 0) for p in self.params}
            self._traced = True
            self._open.clear()
            for bucket in self.buckets:
                self._allocate_buffer(bucket)
        for bucket in self.buckets:
            if bucket.pending is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.reduced = bucket.pending.wait()
            bucket.pending = None
        self._arrived.clear()
        return self.buckets

    @torch.no_grad()
    def set_params(self, masters: list[torch.Tensor], overlap: bool = False) -> None:
        """The parameters := the updated fp32 `masters` (one a bucket: this rank's shard with ZeRO-1,
        all-gathered into the bucket's parameters in their dtype, half the bytes of fp32 for bf16).
        `overlap`: the gathers are left in flight, in forward order; each module's forward waits for
        its own (the class docstring)."""
        self.flush()
        for bucket, master in reversed(list(zip(self.buckets, masters))):  # the first layers' bucket first
            if not self.shard:
                for p, _, numel, at in bucket.segments(0, bucket.numel):  # whole parameters
                    p.copy_(master[at : at + numel].view_as(p))
                continue
            pending = comm.all_gather(master.to(bucket.weights.dtype), bucket.group, async_op=True, out=bucket.weights)
            if overlap:
                bucket.gathering = pending
                self._gathering.update((id(p), bucket) for p in bucket.params)
            else:
                pending.wait()

    def wait_for(self, params) -> None:
        """Finish the all-gathers in flight of these parameters' buckets (a parameter or an iterable)."""
        if not self._gathering:
            return
        for p in [params] if isinstance(params, torch.Tensor) else params:
            bucket = self._gathering.get(id(p))
            if bucket is not None:
                bucket.gathering.wait()
                bucket.gathering = None
                for q in bucket.params:
                    del self._gathering[id(q)]

    def flush(self) -> None:
        """Finish every parameter all-gather in flight (before parameters are read outside a forward)."""
        self.wait_for([b.params[0] for b in self.buckets if b.gathering is not None])

    def _before_forward(self, module: nn.Module, args) -> None:
        if self._gathering:
            self.wait_for(self._own(module))

    @staticmethod
    def _own(module: nn.Module):
        """The parameters a module's forward pre-hook waits for: its own, or all it reads (see __init__)."""
        return module.parameters(recurse=getattr(module, "reads_all_parameters", False))

    @staticmethod
    def release(bucket: Bucket) -> None:
        """The reduced gradient is used: zero the accumulators for the next step."""
        bucket.reduced = None
        bucket.buffer.zero_()
