"""The rectangles of serial tensors a rank holds, and DCP planners that write and read only those.

A rank's local parameter (or a ZeRO-1 slice of its optimizer state) is a flat run of elements;
its `ParamLayout` pieces say which row-major window of which serial tensor each part is. A
contiguous range of a row-major window is at most three rectangles (the rest of a first row,
whole rows, the start of a last row), each a view of the local flat tensor: saving copies nothing
and gathers nothing, and loading reads each rectangle straight into the local tensor from a
checkpoint written on any grid (torch.distributed.checkpoint reshards). Replicas offer identical
rectangles, which DCP writes once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fourfold.parallel.tensor.params import ParamLayout, Piece


class ShardError(ValueError):
    """A checkpoint whose tensors do not cover what this rank holds."""


@dataclass(frozen=True)
class Rectangle:
    """Elements [offsets, offsets + sizes) of the serial tensor `name` of shape `shape`, held in
    `data` (a view of a local tensor, shaped `sizes`)."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor


def _piece_rectangles(piece: Piece, flat: torch.Tensor, lo: int, hi: int, prefix: str) -> list[Rectangle]:
    """The rectangles of the piece's elements among local elements [lo, hi), held in `flat`
    (whose element 0 is local element lo)."""
    rows, cols = piece.window
    start, stop = piece.flat
    # the part of the piece inside the local range [lo, hi), in window coordinates
    a = start + max(0, lo - piece.local_start)
    b = min(stop, start + hi - piece.local_start)
    out = []
    while a < b:
        row, col = divmod(a, cols)
        if col or b - a < cols:  # a partial row
            n = min(cols - col, b - a)
            offsets, sizes = (row, col), (1, n)
        else:  # whole rows
            n = (b - a) // cols * cols
            offsets, sizes = (row, 0), (n // cols, cols)
        local = piece.local_start + a - start - lo  # where these elements are in `flat`
        view = flat[local : local + n]
        r0, c0 = piece.offset
        if len(piece.serial_shape) == 1:
            out.append(Rectangle(prefix + piece.name, piece.serial_shape, (r0 + offsets[0],), (n,), view))
        else:
            out.append(Rectangle(prefix + piece.name, piece.serial_shape, (r0 + offsets[0], c0 + offsets[1]), sizes,
                                 view.view(sizes)))
        a += n
    return out


def rectangles(layout: ParamLayout, flat: torch.Tensor, lo: int = 0, prefix: str = "") -> list[Rectangle]:
    """The serial rectangles of a local parameter's flat elements [lo, lo + len(flat)) (the whole
    parameter by default; a ZeRO-1 slice of its optimizer state otherwise). Padding is in none."""
    hi = lo + flat.numel()
    out = []
    for piece in layout.pieces:
        out += _piece_rectangles(piece, flat, lo, hi, prefix)
    return out


def _index(r: Rectangle) -> MetadataIndex:
    return MetadataIndex(r.name, torch.Size(r.offsets))


class RectangleSavePlanner(DefaultSavePlanner):
    """Writes each rectangle as a chunk of its serial tensor (identical replicas deduplicated)."""

    def __init__(self, rects: list[Rectangle]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.rects = {_index(r): r for r in rects}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(r.offsets), torch.Size(r.sizes)),
                    properties=TensorProperties(dtype=r.data.dtype), size=torch.Size(r.shape)))
                 for index, r in self.rects.items()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.rects[dataclasses.replace(write_item.index, index=None)].data.detach()


class RectangleLoadPlanner(DefaultLoadPlanner):
    """Reads each rectangle straight into its local view, from whatever chunks were saved."""

    def __init__(self, rects: list[Rectangle]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.by_name: dict[str, list[Rectangle]] = {}
        for r in rects:
            self.by_name.setdefault(r.name, []).append(r)

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items = []
        for name, rects in self.by_name.items():
            if name not in saved:
                raise ShardError(f"the checkpoint has no tensor {name!r}: it was written for a different model")
            shape = tuple(saved[name].size)
            if shape != rects[0].shape:
                raise ShardError(f"the checkpoint's {name} has shape {shape}, this model's {rects[0].shape}; load it "
                                 f"into the model config it was trained with")
            chunks = [ChunkStorageMetadata(torch.Size(r.offsets), torch.Size(r.sizes)) for r in rects]
            items += create_read_items_for_chunk_list(name, saved[name], chunks)
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item) -> torch.Tensor:
        rect = self.by_name[read_item.dest_index.fqn][read_item.dest_index.index]
        view = rect.data.detach()
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # the data was read into the local tensor's own storage
