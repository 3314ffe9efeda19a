"""What a 3D-parallel module's parameters need beyond their own layers' collectives."""

from __future__ import annotations

from torch import nn

from fourfold import comm
from fourfold.grid import Grid


def sum_replicated_grads(module: nn.Module, grid: Grid) -> None:
    """All-reduce the gradient of each replicated parameter over its `grad_sum_dims` (the dims
    its tokens or its filled slice were split over). Weight shards need nothing here."""
    for p in module.parameters():
        if p.grad is not None and p.grad_sum_dims:
            comm.all_reduce(p.grad, grid.group(p.grad_sum_dims))


def full_weights(module: nn.Module, grads: bool = False) -> dict:
    """Serial name -> full tensor (or gradient) for every parallel layer in `module`."""
    out = {}
    for layer in module.modules():
        if layer is not module and hasattr(layer, "full_weights"):
            out.update(layer.full_weights(grads))
    return out


def load_full(module: nn.Module, weights: dict) -> None:
    """Set every parallel layer of `module` from serial tensors named as `full_weights` names them."""
    for layer in module.modules():
        if layer is not module and hasattr(layer, "load_full"):
            layer.load_full(weights)
