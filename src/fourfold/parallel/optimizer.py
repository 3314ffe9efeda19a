"""AdamW (decoupled weight decay) on fp32 master weights over GradientSync's buckets: sharded
(ZeRO-1) or replicated, with exact global-norm clipping.

With ZeRO-1 each rank updates its shard of each reduced bucket (fourfold.parallel.data) and the
updated parameters are all-gathered, in their dtype, into the bucket's parameter buffer; with
`overlap_gather` the gathers stay in flight behind the next forward
(`GradientSync.set_params`). The update is torch's fused AdamW kernel over all shards at once
(`torch.optim.adamw.adamw(fused=True)`, CPU and CUDA). Whether a step is skipped (a non-finite
gradient norm or loss) is decided on the device, so a step needs no host sync. The global norm
counts every element once: each is weighted by 1/(number of ranks holding it), from the
parameter layouts' `replicated` dims.

Weight decay applies to the matrices only (every parameter whose serial tensor has two dims or
more: linears, embeddings, experts), not to norms' weights and biases, as Megatron-Core and
Hugging Face's Trainer do; `decay_vectors=True` decays every parameter (fourfold before
2026-12-04). The decay is decoupled, applied to the decayed runs of each shard before the fused
update (which then runs without decay): the same arithmetic as torch's AdamW, in one more pass
over those runs of the master weights, and no per-element mask in memory.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.optim.adamw import adamw

from fourfold.parallel import comm
from fourfold.parallel.comm import at_least_fp32
from fourfold.parallel.data import Bucket, GradientSync


class AdamW:
    """AdamW (decoupled weight decay) on fp32 master weights, bucket by bucket: with ZeRO-1 each
    rank updates its shard of each bucket and the updated parameters are all-gathered."""

    def __init__(self, sync: GradientSync, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay_vectors: bool = False, clip_norm: float | None = None,
                 skip_non_finite: bool = True, overlap_gather: bool = False):
        self.sync, self.lr, self.betas, self.eps, self.wd, self.clip = sync, lr, betas, eps, weight_decay, clip_norm
        self.decay_vectors = decay_vectors
        # True: step returns with the updated parameters' all-gathers in flight, each waited by the
        # first forward that uses it (GradientSync.set_params); read them otherwise after sync.flush()
        self.overlap_gather = overlap_gather
        # False: update even from a non-finite gradient (it then reaches the moments); for callers
        # whose values are not real (FakeTensorMode), which need no check.
        self.skip_non_finite = skip_non_finite
        self.state: list[dict[str, torch.Tensor]] = []
        self.norm: torch.Tensor | None = None  # the last step's global gradient norm, on the device
        self._steps = 0  # the updates made, until the state (which counts them on the device) exists
        self._restore: Callable[[], None] | None = None  # reads the state at the first step

    @property
    def step_count(self) -> int:
        """Updates made (skipped steps do not count); a host sync on GPUs once the state exists."""
        return int(self.state[0]["step"].item()) if self.state else self._steps

    @property
    def last_norm(self) -> float:
        """The global gradient norm of the last step (read on demand: a host sync on GPUs)."""
        return math.nan if self.norm is None else self.norm.item()

    def _shard(self, bucket: Bucket, tensor_of, lo: int, hi: int) -> torch.Tensor:
        """Range [lo, hi) of the bucket's flat (padded) layout, filled from `tensor_of(param)`,
        fp32 at least; built segment by segment, never the whole bucket."""
        first = bucket.params[0]
        out = torch.zeros(hi - lo, dtype=at_least_fp32(first.dtype), device=first.device)
        for p, a, b, at in bucket.segments(lo, hi):
            out[at : at + b - a] = tensor_of(p).detach().reshape(-1)[a:b]
        return out

    def _copies(self, bucket: Bucket, lo: int, hi: int) -> list[tuple[int, int, float]]:
        """(start, end, copies) segments of this rank's range [lo, hi) of the bucket: how many
        ranks of the world hold each element after reduction. Its tensor-grid copies times dp*cp
        replicas (an expert's: its expert replicas); with ZeRO-1 one rank of the bucket's group (dp,
        cp and the dims its gradient was summed over; an expert's replicas) holds it. Padding is
        counted once (it is zero)."""
        grid, out = self.sync.grid, []
        for p, a, b, at in bucket.segments(lo, hi):
            layout = self.sync.layouts[p]
            replicas = (grid.expert_group("edp") if layout.expert else grid.replica_group()).size
            out.append((at, at + b - a, grid.size(layout.replicated) * replicas
                        / (bucket.group.size if self.sync.shard else 1)))
        return out

    def _decayed(self, bucket: Bucket, lo: int, hi: int) -> list[tuple[int, int]]:
        """The (start, end) runs of this rank's range [lo, hi) of the bucket that weight decay
        applies to: its matrices' elements (all of them with `decay_vectors`), adjacent ones merged."""
        runs: list[tuple[int, int]] = []
        for p, a, b, at in bucket.segments(lo, hi):
            pieces = self.sync.layouts[p].pieces
            if self.decay_vectors or all(len(piece.serial_shape) >= 2 for piece in pieces):
                if runs and runs[-1][1] == at:
                    runs[-1] = (runs[-1][0], at + b - a)
                else:
                    runs.append((at, at + b - a))
        return runs

    def global_norm(self, buckets: list[Bucket]) -> torch.Tensor:
        """Exact global gradient norm: each element counted once over every shard and replica."""
        total = torch.zeros((), dtype=torch.float64, device=self.sync.grid.device)
        for bucket, state in zip(buckets, self.state):
            for a, b, copies in state["copies"]:  # accumulated in float64, no float64 copy made
                total += torch.linalg.vector_norm(bucket.reduced[a:b], dtype=torch.float64).square() / copies
        comm.all_reduce(total, self.sync.grid.world_group())
        return total.sqrt()

    STATE = ("master", "m", "v")

    def restore(self, read: Callable[[], None], step_count: int) -> None:
        """Continue from a checkpoint: `read()` fills this rank's state in place (collective:
        every rank calls it), at the first step, once the buckets are traced."""
        self._restore, self._steps = read, step_count

    def _init_state(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            lo, hi = bucket.shard_range(self.sync.shard)
            s = {"master": self._shard(bucket, lambda p: p, lo, hi), "copies": self._copies(bucket, lo, hi),
                 "decayed": self._decayed(bucket, lo, hi)}
            s["m"], s["v"] = torch.zeros_like(s["master"]), torch.zeros_like(s["master"])
            # The fused kernel's bias-correction count, one per shard (it increments each).
            s["step"] = torch.full((), self._steps, dtype=torch.float32, device=s["master"].device)
            self.state.append(s)
        if self._restore is not None:
            self._restore()  # overwrites master, m and v with the checkpoint's
            self._restore = None

    @torch.no_grad()
    def step(self, loss_finite: torch.Tensor | None = None) -> torch.Tensor:
        """Update from this step's gradients. Returns, on the device, whether it did: nothing
        changes (master weights, moments, step count) when the global norm is not finite (a
        finite loss can still overflow a gradient: inf * 0 would write NaN into the Adam moments)
        or `loss_finite` is False."""
        self.sync.flush()  # (the last step's gathers read the master weights updated below)
        buckets = self.sync.finish()
        if not self.state:  # (and a checkpoint's, when resuming) from the first step on, skipped or not
            self._init_state(buckets)
        self.norm = self.global_norm(buckets)
        updated = torch.isfinite(self.norm)
        if loss_finite is not None:
            updated &= loss_finite
        grads = [bucket.reduced for bucket in buckets]
        if self.clip is not None:  # as a tensor (torch's clip_grad_norm_ rule), in the gradients' dtype (a
            # float64 scalar on fp32 gradients takes CUDA's slow path)
            torch._foreach_mul_(grads, (self.clip / (self.norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
        if self.wd:  # decoupled: p *= 1 - lr * wd on the decayed runs (not on a skipped step)
            runs = [s["master"][a:b] for s in self.state for a, b in s["decayed"]]
            if runs:
                decay = torch.full((), 1 - self.lr * self.wd, dtype=runs[0].dtype, device=runs[0].device)
                keep = torch.where(updated, decay, 1.0)  # (a Python float in where would make it float32)
                torch._foreach_mul_(runs, keep)
        b1, b2 = self.betas
        adamw([s["master"] for s in self.state], grads, [s["m"] for s in self.state], [s["v"] for s in self.state],
              [], [s["step"] for s in self.state], fused=True, amsgrad=False, beta1=b1, beta2=b2, lr=self.lr,
              weight_decay=0.0, eps=self.eps, maximize=False,
              found_inf=(~updated).float() if self.skip_non_finite else None)
        for bucket in buckets:
            self.sync.release(bucket)
        self.sync.set_params([s["master"] for s in self.state], overlap=self.overlap_gather)
        return updated
