"""How 3D-parallel parameters are laid out, and whole-module helpers: loading, gathering,
replicated gradients.

Every layer owning parameters is a `ParallelModule`: it loads them from serial tensors, gathers
them back, and describes each one with a `ParamLayout` (which serial elements it holds, which
tensor dims replicate it, which dims its gradient is summed over). Gradient synchronisation, the
optimizer's global norm and checkpoints read these layouts; nothing is stored on the parameters.

Loading goes through a `Read`: a function giving a slice of a *serial* tensor by fourfold's name,
`read(name, rows, cols)` (cols is None for vectors). Each layer asks only for the block it owns.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fourfold.parallel import comm
from fourfold.parallel.grid import Grid

Read = Callable[[str, slice, "slice | None"], torch.Tensor]
Put = Callable[[nn.Parameter, torch.Tensor], None]
Pick = Callable[[nn.Parameter], torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """A run of a local flat parameter that holds elements of one serial tensor.

    The serial elements are a row-major window of `window` = (rows, cols) at `offset` = (row, col)
    of the serial tensor `name` (vectors are [n, 1]: cols 1); the piece holds the window's
    flattened elements [flat[0], flat[1]), at [local_start, local_start + flat[1] - flat[0]) of
    the local flat parameter."""

    name: str
    serial_shape: tuple[int, ...]
    offset: tuple[int, int]
    window: tuple[int, int]
    flat: tuple[int, int]
    local_start: int


@dataclass(frozen=True)
class ParamLayout:
    """`grad_sum`: the tensor dims a parameter's gradient must be summed over (its tokens, or its
    filled slice, were split over them); `replicated`: the tensor dims holding identical copies of
    it; `pieces`: the serial elements it holds (elements in no piece are padding, always zero);
    `expert`: an expert's weight under expert parallelism, replicated over the expert replicas
    (`Grid.expert_group("edp")`) instead of the dp*cp ranks."""

    grad_sum: tuple[str, ...]
    replicated: tuple[str, ...]
    pieces: tuple[Piece, ...]
    expert: bool = False


def vector_piece(name: str, size: int, start: int, count: int) -> Piece:
    """Elements [start, start + count) of the serial vector `name` of `size`, held whole."""
    return Piece(name, (size,), (start, 0), (count, 1), (0, count), 0)


class ParallelModule(nn.Module, ABC):
    """A layer owning parallel parameters (each parameter belongs to one such layer, or to
    several for a tied weight)."""

    @abstractmethod
    def load(self, read: Read, put: Put) -> None:
        """Give each parameter's local value, read from serial tensors, to `put` (see `load`)."""

    @abstractmethod
    def full_weights(self, pick: Pick) -> dict[str, torch.Tensor]:
        """Serial name -> full tensor of `pick(param)`, gathered onto every rank (see `full_weights`)."""

    @abstractmethod
    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        """The layout of each of this layer's parameters on this rank."""

    @abstractmethod
    def reset_parameters(self) -> None:
        """Set this rank's elements of the serial model's initial values, in place (a layer built
        on the meta device and materialised with `to_empty` gets its values here)."""

    def initialise(self) -> None:
        """The constructor's last step: initial values, unless built on the meta device (nothing to
        set there; `pipeline.stage_model` initialises what it keeps after pruning)."""
        if not self.weight.is_meta:
            self.reset_parameters()


def parallel_layers(module: nn.Module) -> list[ParallelModule]:
    return [layer for layer in module.modules() if isinstance(layer, ParallelModule)]


class ExpertShard(nn.ModuleList):
    """The experts [first, first + len) of a mixture held by this rank of its expert group (expert
    parallelism): their parameters are replicated over the expert replicas only (`ParamLayout.expert`),
    and gathering the model's weights gathers the other ranks' experts over the expert group."""

    def __init__(self, experts, first: int, group: comm.Group):
        super().__init__(experts)
        self.first, self.group = first, group

    def full_weights(self, pick: Pick) -> dict[str, torch.Tensor]:
        """Serial name -> full tensor of every expert of the mixture (this rank's and the group's)."""
        mine = [{} for _ in self]
        for j, expert in enumerate(self):
            for layer in parallel_layers(expert):
                mine[j].update(layer.full_weights(pick))
        out = {}
        tag = f"experts.{self.first}."
        for name in sorted(mine[0]):  # expert `first`'s names; the others' differ by the index only
            local = torch.stack([mine[j][name.replace(tag, f"experts.{self.first + j}.")] for j in range(len(self))])
            everyone = comm.all_gather(local, self.group)  # [ep * len, ...] in expert order
            for e, tensor in enumerate(everyone):
                out[name.replace(tag, f"experts.{e}.")] = tensor
        return out


def layouts(module: nn.Module) -> dict[nn.Parameter, ParamLayout]:
    """Every parallel parameter of `module` (a tied weight once, as its first layer lays it out)."""
    experts = {id(layer) for shard in module.modules() if isinstance(shard, ExpertShard)
               for layer in parallel_layers(shard)}
    out: dict[nn.Parameter, ParamLayout] = {}
    for layer in parallel_layers(module):
        for p, layout in layer.param_layouts().items():
            out.setdefault(p, dataclasses.replace(layout, expert=True) if id(layer) in experts else layout)
    return out


def buffer_layouts(module: nn.Module) -> dict[torch.Tensor, ParamLayout]:
    """Every checkpointed buffer of `module` (DeepSeek-V3's balancing biases: state beside the parameters
    that no gradient or optimizer touches), laid out as a parameter is."""
    out: dict[torch.Tensor, ParamLayout] = {}
    for layer in parallel_layers(module):
        out.update(getattr(layer, "buffer_layouts", dict)())
    return out


def dict_reader(weights: dict[str, torch.Tensor]) -> Read:
    """A `Read` over serial tensors held in memory."""

    def read(name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        t = weights[name]
        return t[rows] if cols is None else t[rows, cols]

    return read


def copy_into(param: nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


@dataclass(frozen=True)
class Replicas:
    """The ranks holding the same parameters, which share a checkpoint's or a Hugging Face
    directory's reading and writing: `dense`, the dp*cp group; `experts`, the ranks holding the
    same experts under expert parallelism (`Grid.expert_group("edp")`; the dp*cp group without)."""

    dense: comm.Group
    experts: comm.Group

    @classmethod
    def of_grid(cls, grid: Grid) -> "Replicas":
        return cls(grid.replica_group(), grid.expert_group("edp"))

    @classmethod
    def one_group(cls, group: comm.Group) -> "Replicas":
        """A model without expert parallelism whose replicas are `group`."""
        return cls(group, group)

    def of(self, layout: ParamLayout) -> comm.Group:
        return self.experts if layout.expert else self.dense

    @property
    def shared(self) -> bool:
        """Whether any parameter has another rank to share its reading with."""
        return self.dense.size > 1 or self.experts.size > 1


def assigned_by_group(items: list[tuple[int, bool]], replicas: "Replicas | None") -> set[int]:
    """`assigned` of items (size, whether an expert's) over their own replicas: the dense ones over
    the dp*cp ranks, the experts' over the expert replicas. Returns the indices of this rank's."""
    if replicas is None:
        return set(range(len(items)))
    out = set()
    for expert in (False, True):
        index = [i for i, (_, e) in enumerate(items) if e == expert]
        group = replicas.experts if expert else replicas.dense
        out |= {index[j] for j in assigned([items[i][0] for i in index], group)}
    return out


def assigned(sizes: list[int], replicas: comm.Group | None) -> set[int]:
    """Which of some items (parameters, layers) of these `sizes` this rank of `replicas` reads or
    writes for the group (a checkpoint's, a Hugging Face directory's): each whole item to the
    replica with the fewest elements so far, largest first. Every replica computes the same
    assignment: they hold the same shapes in the same order."""
    if replicas is None or replicas.size == 1:
        return set(range(len(sizes)))
    loads, owners = [0] * replicas.size, {}
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = loads.index(min(loads))
        loads[owner] += sizes[i]
        owners[i] = owner
    return {i for i in range(len(sizes)) if owners[i] == replicas.rank}


def load(module: nn.Module, read: Read, put: Put = copy_into) -> None:
    """Set every parallel layer of `module` from serial tensors; with `put`, hand each parameter's
    local value to `put(param, value)` instead (to restore optimizer state the same way)."""
    for layer in parallel_layers(module):
        layer.load(read, put)


def load_full(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    load(module, dict_reader(weights))


def full_weights(module: nn.Module, grads: bool = False, pick: Pick | None = None) -> dict[str, torch.Tensor]:
    """Serial name -> full tensor, gathered onto every rank: the parameters, their gradients
    (`grads`), or any tensor laid out like each parameter (`pick(param)`, e.g. optimizer state)."""
    pick = pick or ((lambda p: p.grad) if grads else (lambda p: p))
    shards = [shard for shard in module.modules() if isinstance(shard, ExpertShard)]
    theirs = {id(layer) for shard in shards for layer in parallel_layers(shard)}
    out = {}
    for layer in parallel_layers(module):
        if id(layer) not in theirs:
            out.update(layer.full_weights(pick))
    for shard in shards:
        out.update(shard.full_weights(pick))
    return out
