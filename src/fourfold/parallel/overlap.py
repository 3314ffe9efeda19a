"""Hiding the tensor-parallel collectives behind compute; one switch per kind, all on by default.

- `input_grad`: in a linear layer's backward, the all-reduce (or reduce-scatter) of dX runs
  while the dW GEMM computes.
- `prefetch_weights`: the z all-gather of the next weight block is launched as soon as the
  current one is consumed, in the order the blocks were gathered in the previous pass (traced:
  forward, backward and recompute as they really ran, not the order of registration).
- `defer_weight_grads`: the reduce-scatter of dW over z is launched async and waited only when
  the next one is launched or when backward ends, after autograd's hooks have run.
- `forward_chunks`: a linear's forward runs its GEMM in chunks, the input all-gather of the next
  chunk and the output reduction of the last in flight while it computes
  (`tensor.linear._pipelined_forward`).
Either way a reduced dW goes to `on_grad_landed(param, grad)` (GradientSync sets it) in the fp32
(at least) it was summed in, never rounded to the parameter's bf16 on its way to the fp32
accumulator; with no one to take it, it lands in `param.grad`.
None of them changes a value or a byte sent (tests hold both equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fourfold.parallel import comm
from fourfold.parallel.comm import Group, Pending
from fourfold.spec.volumes import FORWARD_CHUNKS


@dataclass(frozen=True)
class OverlapOptions:
    input_grad: bool = True
    prefetch_weights: bool = True
    defer_weight_grads: bool = True
    # a linear's forward GEMM in chunks, their collectives behind other chunks' GEMMs (1: off)
    forward_chunks: int = FORWARD_CHUNKS

    @classmethod
    def off(cls) -> "OverlapOptions":
        """Every collective waited where it is issued (train.overlap false)."""
        return cls(False, False, False, 1)


class Overlapper:
    """Shared by the linear layers of one model: the weight-gather prefetch and deferred dW."""

    def __init__(self, options: OverlapOptions, z: Group):
        self.options, self.z = options, z
        self._order: list = []  # the linear layers in the order of the previous pass's gathers
        self._calls: list = []
        self._ahead: tuple[int, object, Pending] | None = None
        self._deferred: list[tuple[torch.Tensor, Pending]] = []
        self._callback_queued = False
        self._tracing = False  # prefetching starts once a model announces its passes
        self.on_grad_landed: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        # called with a weight shard before its prefetch reads it (GradientSync: its all-gather in flight)
        self.before_read: Callable[[torch.Tensor], None] | None = None

    # ----- weight gathers --------------------------------------------------------------------
    def new_pass(self) -> None:
        """Called when a pass starts (a whole model's forward, or a pipeline stage's schedule
        step, whose micro-batches interleave): the calls of the pass that ended become the order."""
        self._discard_ahead()
        self._tracing = True
        if self._calls:
            self._order, self._calls = self._calls, []

    def gather(self, layer, shard: torch.Tensor) -> torch.Tensor:
        """The weight block of `layer` (a ParallelLinear) from `shard`, its z shard (its weight, or
        the weight saved for backward). The prefetch reads the next layer's weight as it is now: a
        tensor kept from an earlier pass may alias a storage since replaced (GradientSync's buffers)."""
        matrix = layer.matrix
        if not (self.options.prefetch_weights and self._tracing) or self.z.size == 1:
            return matrix.gather_block(shard)
        index = len(self._calls)
        self._calls.append(layer)
        if self._ahead is not None and self._ahead[0] == index and self._ahead[1] is layer:
            block = matrix.unpad(self._ahead[2].wait())
            self._ahead = None
        else:  # first pass, or the graph changed: gather now
            self._discard_ahead()
            block = matrix.gather_block(shard)
        if index + 1 < len(self._order):
            following = self._order[index + 1]
            if self.before_read is not None:
                self.before_read(following.weight)
            self._ahead = (index + 1, following, comm.all_gather(following.weight.detach(), self.z, async_op=True))
        return block

    def _discard_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead[2].wait()  # every rank issued it; finish it before anything else on z
            self._ahead = None

    # ----- weight gradients -----------------------------------------------------------------
    def weight_grad(self, param: torch.Tensor, flat_grad: torch.Tensor) -> torch.Tensor | None:
        """Reduce-scatter dW over z: now, or deferred. The sum runs in fp32 at least (bf16 partial
        gradients are not rounded at each addition, as torchtitan's FSDP reduce_dtype and Megatron's
        fp32 reduction), and the shard goes to `on_grad_landed` so (None returned); only without
        one is it returned (now) or put in `param.grad` (deferred) in the parameter's dtype."""
        if self.z.size == 1:
            return flat_grad
        wide = flat_grad.to(comm.at_least_fp32(flat_grad.dtype))
        if not self.options.defer_weight_grads:
            shard = comm.reduce_scatter(wide, self.z)
            if self.on_grad_landed is None:
                return shard.to(flat_grad.dtype)
            self.on_grad_landed(param, shard)
            return None
        if self._deferred:
            self._land(*self._deferred.pop(0))
        self._deferred.append((param, comm.reduce_scatter(wide, self.z, async_op=True)))
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._land_all)
            self._callback_queued = True
        return None

    def _land(self, param: torch.Tensor, pending: Pending) -> None:
        grad = pending.wait()
        if self.on_grad_landed is not None:
            self.on_grad_landed(param, grad)
        else:
            grad = grad.to(param.dtype)
            param.grad = grad if param.grad is None else param.grad + grad

    def _land_all(self) -> None:
        while self._deferred:
            self._land(*self._deferred.pop(0))
        self._callback_queued = False
