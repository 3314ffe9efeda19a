"""RMSNorm and LayerNorm over features split across x, with statistics over the full hidden size.

The published implementation normalised each rank's feature slice on its own (not the serial
model when x > 1); here the per-token sums are all-reduced over x ([tokens, 1]: negligible).
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold import comm
from fourfold.grid import Grid
from fourfold.layout import GridError
from fourfold.tensor.params import ParallelModule, ParamLayout, vector_piece
from fourfold.tensor.regions import all_reduce_partial


class ParallelNorm(ParallelModule):
    def __init__(self, grid: Grid, hidden: int, kind: str, eps: float, *, seq_parallel: bool, dtype: torch.dtype, name: str):
        super().__init__()
        if hidden % grid.size("x"):
            raise GridError(f"{name}: hidden={hidden} is not divisible by x={grid.size('x')}; choose x dividing {hidden}")
        self.grid, self.hidden, self.kind, self.eps, self.name = grid, hidden, kind, eps, name
        self.seq_parallel = seq_parallel
        local = hidden // grid.size("x")
        self.weight = nn.Parameter(torch.empty(local, dtype=dtype))
        if kind == "layer":
            self.bias = nn.Parameter(torch.empty(local, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.initialise()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1)
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x_group = self.grid.group("x")
        if self.kind == "layer":
            mean = all_reduce_partial(h.sum(-1, keepdim=True), x_group) / self.hidden
            centred = h - mean
            var = all_reduce_partial((centred * centred).sum(-1, keepdim=True), x_group) / self.hidden
            return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias
        mean_square = all_reduce_partial((h * h).sum(-1, keepdim=True), x_group) / self.hidden
        return h * torch.rsqrt(mean_square + self.eps) * self.weight

    def load(self, read, put) -> None:
        local = self.weight.numel()
        features = slice(self.grid.coords["x"] * local, (self.grid.coords["x"] + 1) * local)
        for suffix, p in (("weight", self.weight), ("bias", self.bias)):
            if p is not None:
                put(p, read(f"{self.name}.{suffix}", features, None))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        # Tokens are split over z (and over y with sequence parallelism); without it the y ranks
        # compute the same gradient, so it must not be summed over y.
        grad_sum = ("z", "y") if self.seq_parallel else ("z",)
        local = self.weight.numel()
        out = {}
        for suffix, p in (("weight", self.weight), ("bias", self.bias)):
            if p is not None:
                piece = vector_piece(f"{self.name}.{suffix}", self.hidden, self.grid.coords["x"] * local, local)
                out[p] = ParamLayout(grad_sum, ("y", "z"), (piece,))
        return out

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        out = {}
        for suffix, p in (("weight", self.weight), ("bias", self.bias)):
            if p is not None:
                t = pick(p).detach()
                out[f"{self.name}.{suffix}"] = comm.all_gather(t, self.grid.group("x"))
        return out
