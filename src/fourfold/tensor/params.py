"""Whole-module helpers for 3D-parallel layers: loading, gathering, replicated gradients.

Loading goes through a `Read`: a function giving a slice of a *serial* tensor by fourfold's name,
`read(name, rows, cols)` (cols is None for vectors). Each layer asks only for the block it owns.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from fourfold import comm
from fourfold.grid import Grid

Read = Callable[[str, slice, "slice | None"], torch.Tensor]


def describe(p: nn.Parameter, *, grad_sum: tuple[str, ...] = (), replicated: tuple[str, ...] = ()) -> None:
    """Say how a parallel parameter is laid out, for gradient synchronisation and global norms:
    `grad_sum`, the tensor dims its gradient must be summed over (its tokens, or its filled
    slice, were split over them); `replicated`, the tensor dims holding identical copies of it."""
    p.grad_sum_dims = grad_sum
    p.replicated_dims = replicated


def dict_reader(weights: dict[str, torch.Tensor]) -> Read:
    """A `Read` over serial tensors held in memory."""

    def read(name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        t = weights[name]
        return t[rows] if cols is None else t[rows, cols]

    return read


def _parallel_layers(module: nn.Module) -> Iterator[nn.Module]:
    """The layers that own parallel parameters (each once, tied ones too)."""
    seen = set()
    for layer in module.modules():
        if layer is not module and hasattr(layer, "full_weights") and id(layer) not in seen:
            seen.add(id(layer))
            yield layer


def _copy_into(param: nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


def load(module: nn.Module, read: Read, put: Callable[[nn.Parameter, torch.Tensor], None] = _copy_into) -> None:
    """Set every parallel layer of `module` from serial tensors; with `put`, hand each parameter's
    local value to `put(param, value)` instead (to restore optimizer state the same way)."""
    for layer in _parallel_layers(module):
        layer.load(read, put)


def load_full(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    load(module, dict_reader(weights))


def full_weights(module: nn.Module, grads: bool = False,
                 pick: Callable[[nn.Parameter], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Serial name -> full tensor, gathered onto every rank: the parameters, their gradients
    (`grads`), or any tensor laid out like each parameter (`pick(param)`, e.g. optimizer state)."""
    pick = pick or ((lambda p: p.grad) if grads else (lambda p: p))
    out = {}
    for layer in _parallel_layers(module):
        out.update(layer.full_weights(pick))
    return out


def sum_replicated_grads(module: nn.Module, grid: Grid) -> None:
    """All-reduce the gradient of each replicated parameter over its `grad_sum_dims` (the dims
    its tokens or its filled slice were split over). Weight shards need nothing here."""
    for p in module.parameters():
        if p.grad is not None and p.grad_sum_dims:
            comm.all_reduce(p.grad, grid.group(p.grad_sum_dims))
