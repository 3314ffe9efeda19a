"""Data parallelism over dp*cp: bucketed gradient reduction launched during backward, a sharded
(ZeRO-1) or replicated AdamW with fp32 master weights, and exact global-norm clipping.

Each parameter's gradient is reduced over dp and cp, plus the tensor dims named in its
`grad_sum_dims` (a norm weight's tokens were split over z too), so one collective per bucket
does both. Buckets fill in the order gradients become final in backward (the order layers
really run), each launched asynchronously when full; the rest are launched by `finish()`.
Under gradient accumulation, hooks only accumulate until the micro-batch that is run with
`sync=True`.

Memory (as Megatron's distributed optimizer): once the buckets are known, each owns one flat fp32
buffer and its parameters' accumulators are views into it, so a bucket is reduced in place (the
reduce-scatter writes this rank's shard over its own slice); the optimizer reads the reduced shard
there and `release` zeroes the buffer for the next step. No copy of the gradients is ever made.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from fourfold import comm
from fourfold.comm import Group, Pending
from fourfold.grid import Grid


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """Gradients accumulate and master weights live in fp32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class Bucket:
    group: Group
    params: list[nn.Parameter] = field(default_factory=list)
    ids: set[int] = field(default_factory=set)
    numel: int = 0
    pending: Pending | None = None
    reduced: torch.Tensor | None = None  # this rank's shard (ZeRO-1) or the whole bucket
    buffer: torch.Tensor | None = None  # the accumulators, padded to the group (main_grads are views)

    def padded(self) -> int:
        return -(-self.numel // self.group.size) * self.group.size

    def shard_range(self, sharded: bool) -> tuple[int, int]:
        if not sharded:
            return 0, self.padded()
        n = self.padded() // self.group.size
        return self.group.rank * n, (self.group.rank + 1) * n


class GradientSync:
    """Owns the gradient accumulators (`p.main_grad`, fp32 at least) and reduces them in buckets.

    The first synchronised backward is traced: buckets are filled in the order gradients become
    final and each parameter's number of gradient arrivals is counted (a tied weight gets two);
    everything is reduced at `finish()`. From then on a bucket is launched, async, as soon as
    each of its parameters has had all its arrivals."""

    def __init__(self, model: nn.Module, grid: Grid, *, bucket_mb: float = 25.0, shard: bool = True):
        self.grid, self.shard = grid, shard
        self.bucket_bytes = bucket_mb * 2**20
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.main_grad = torch.zeros_like(p, dtype=_at_least_fp32(p.dtype))
            p.register_post_accumulate_grad_hook(self._on_grad)
            p.grad_ready = self._on_grad  # for gradients that land later (fourfold.overlap)
        if grid.size("pp") > 1:
            # Groups are created collectively by every rank; pipeline stages hold different
            # parameters, so each rank creates every group a bucket might use, now, in one order.
            for r in range(4):
                for dims in itertools.combinations(("x", "y", "z"), r):
                    grid.group(("dp", "cp", *dims))
        self.sync = True
        self.buckets: list[Bucket] = []
        self._expected: dict[int, int] = {}  # arrivals per parameter, from the traced backward
        self._arrived: dict[int, int] = {}
        self._open: dict[tuple[str, ...], Bucket] = {}
        self._traced = False

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # autograd calls the hook even when a layer deferred its gradient
            return
        p.main_grad += p.grad
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
        key = ("dp", "cp", *p.grad_sum_dims)
        bucket = self._open.get(key)
        if bucket is None:
            bucket = self._open[key] = Bucket(self.grid.group(key))
            self.buckets.append(bucket)
        bucket.params.append(p)
        bucket.ids.add(id(p))
        bucket.numel += p.numel()
        if bucket.numel * 4 >= self.bucket_bytes:
            del self._open[key]

    def _launch(self, bucket: Bucket) -> None:
        if self.shard:
            lo, hi = bucket.shard_range(True)
            bucket.pending = comm.reduce_scatter(bucket.buffer, bucket.group, async_op=True, out=bucket.buffer[lo:hi])
        else:
            bucket.pending = comm.all_reduce(bucket.buffer, bucket.group, async_op=True)

    def _allocate_buffer(self, bucket: Bucket) -> None:
        """Move the bucket's accumulators into one flat buffer (after the traced backward)."""
        first = bucket.params[0].main_grad
        bucket.buffer = torch.zeros(bucket.padded(), dtype=first.dtype, device=first.device)
        offset = 0
        for p in bucket.params:
            view = bucket.buffer[offset : offset + p.numel()].view_as(p)
            view.copy_(p.main_grad)
            p.main_grad = view  # the old accumulator is freed here, one bucket at a time
            offset += p.numel()

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

    @staticmethod
    def release(bucket: Bucket) -> None:
        """The reduced gradient is used: zero the accumulators for the next step."""
        bucket.reduced = None
        bucket.buffer.zero_()


class AdamW:
    """AdamW (decoupled weight decay) on fp32 master weights, bucket by bucket: with ZeRO-1 each
    rank updates its shard of each bucket and the updated parameters are all-gathered."""

    def __init__(self, sync: GradientSync, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, clip_norm: float | None = None):
        self.sync, self.lr, self.betas, self.eps, self.wd, self.clip = sync, lr, betas, eps, weight_decay, clip_norm
        self.step_count = 0
        self.state: list[dict[str, torch.Tensor]] = []
        self._norm: torch.Tensor | None = None

    @property
    def last_norm(self) -> float:
        """The global gradient norm of the last step (read on demand: a host sync on GPUs)."""
        return math.nan if self._norm is None else self._norm.item()

    def _shard(self, bucket: Bucket, tensor_of, lo: int, hi: int) -> torch.Tensor:
        """Range [lo, hi) of the bucket's flat (padded) layout, filled from `tensor_of(param)`,
        fp32 at least; built segment by segment, never the whole bucket."""
        first = bucket.params[0]
        out = torch.zeros(hi - lo, dtype=_at_least_fp32(first.dtype), device=first.device)
        offset = 0
        for p in bucket.params:
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b:
                out[a - lo : b - lo] = tensor_of(p).detach().reshape(-1)[a - offset : b - offset]
            offset += p.numel()
        return out

    def _copies(self, bucket: Bucket, lo: int, hi: int) -> list[tuple[int, int, float]]:
        """(start, end, copies) segments of this rank's range [lo, hi) of the bucket: how many
        ranks of the world hold each element after reduction. Its tensor-grid copies times dp*cp
        replicas; with ZeRO-1 one rank of the bucket's group (dp, cp and the dims its gradient
        was summed over) holds it. Padding is counted once (it is zero)."""
        grid = self.sync.grid
        factor = grid.size(("dp", "cp")) / (bucket.group.size if self.sync.shard else 1)
        segments, offset = [], 0
        for p in bucket.params:
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b:
                segments.append((a - lo, b - lo, grid.size(p.replicated_dims) * factor))
            offset += p.numel()
        return segments

    def global_norm(self, buckets: list[Bucket]) -> torch.Tensor:
        """Exact global gradient norm: each element counted once over every shard and replica."""
        total = torch.zeros((), dtype=torch.float64, device=self.sync.grid.device)
        for bucket, state in zip(buckets, self.state):
            for a, b, copies in state["copies"]:  # accumulated in float64, no float64 copy made
                total += torch.linalg.vector_norm(bucket.reduced[a:b], dtype=torch.float64).square() / copies
        comm.all_reduce(total, self.sync.grid.group(("dp", "pp", "cp", "x", "y", "z")))
        return total.sqrt()

    STATE = ("master", "m", "v")

    def per_param_state(self) -> dict[str, dict[int, torch.Tensor]]:
        """{"master"|"m"|"v": {id(param): tensor shaped like the param}}, gathered over each
        bucket's group; empty before the first step (the buckets are traced then)."""
        out: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in self.STATE}
        for bucket, s in zip(self.sync.buckets, self.state):
            for kind in self.STATE:
                full = comm.all_gather(s[kind], bucket.group) if self.sync.shard else s[kind]
                offset = 0
                for p in bucket.params:
                    out[kind][id(p)] = full[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
        return out

    def restore(self, state: dict[str, dict[int, torch.Tensor]], step_count: int) -> None:
        """Take `per_param_state()`'s form back; applied when the first step has traced the buckets."""
        self._restore, self.step_count = state, step_count

    def _init_state(self, buckets: list[Bucket]) -> None:
        restore = getattr(self, "_restore", None)
        for bucket in buckets:
            lo, hi = bucket.shard_range(self.sync.shard)
            s = {"master": self._shard(bucket, lambda p: p, lo, hi), "copies": self._copies(bucket, lo, hi)}
            for kind in self.STATE:
                if restore is not None:
                    s[kind] = self._shard(bucket, lambda p: restore[kind][id(p)], lo, hi)
                elif kind != "master":
                    s[kind] = torch.zeros_like(s["master"])
            self.state.append(s)
        self._restore = None

    @torch.no_grad()
    def skip(self) -> None:
        """Drop this step's gradients without updating anything (a non-finite loss)."""
        for bucket in self.sync.finish():
            self.sync.release(bucket)

    @torch.no_grad()
    def step(self) -> None:
        buckets = self.sync.finish()
        if not self.state:
            self._init_state(buckets)
        self._norm = self.global_norm(buckets)
        # Clipping as a tensor (torch's clip_grad_norm_ rule): no host sync inside the step.
        scale = 1.0 if self.clip is None else (self.clip / (self._norm + 1e-6)).clamp(max=1.0)
        self.step_count += 1
        b1, b2 = self.betas
        step_size = self.lr / (1 - b1**self.step_count)
        root_correction = math.sqrt(1 - b2**self.step_count)
        for bucket, s in zip(buckets, self.state):
            # torch's AdamW arithmetic, with no temporaries: the reduced gradient's own storage
            # (zeroed by release() anyway) holds the scaled gradient, then the denominator.
            g = bucket.reduced.mul_(scale) if self.clip is not None else bucket.reduced
            s["m"].mul_(b1).add_(g, alpha=1 - b1)
            s["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = torch.sqrt(s["v"], out=g).div_(root_correction).add_(self.eps)
            s["master"].mul_(1 - self.lr * self.wd).addcdiv_(s["m"], denom, value=-step_size)
            self.sync.release(bucket)
            # Gather in the parameters' dtype: half the bytes of fp32 for bf16 parameters.
            dtype = bucket.params[0].dtype
            full = comm.all_gather(s["master"].to(dtype), bucket.group) if self.sync.shard else s["master"]
            offset = 0
            for p in bucket.params:
                p.copy_(full[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
