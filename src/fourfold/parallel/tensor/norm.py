"""RMSNorm and LayerNorm over features split across x, with statistics over the full hidden size.

The published implementation normalised each rank's feature slice on its own (not the serial
model when x > 1); here the per-token sums are all-reduced over x ([tokens, 1]: negligible).
The arithmetic is fp32 whatever the input's dtype (as transformers and Megatron do: bf16 sums of
squares over thousands of features lose most of their bits), and backward keeps only the input
and the per-token statistics. With `compile` (train.compile) the elementwise work between the
collectives runs under torch.compile; the arithmetic is the same. The same statistics serve the q/k
norms: per head (Qwen3's `HeadNorm`, nothing to sum) and over all heads (OLMoE's `AllHeadsNorm`, summed over
the ranks holding the other heads). Gemma's RMSNorm (`rms_plus_one`) scales by 1 + weight (stored
as transformers stores it: zeros are the identity) and casts after scaling.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fourfold.parallel import comm
from fourfold.parallel.comm import Group
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.params import ParallelModule, ParamLayout, vector_piece
from fourfold.spec.layout import GridError

# The elementwise work between the collectives, as functions that torch.compile can fuse.

def _centre(h, mean):
    f = h.to(torch.promote_types(h.dtype, torch.float32))
    return f - mean if mean is not None else f


def _sum(f):
    return f.sum(-1, keepdim=True)


def _square_sum(f):
    return f.square().sum(-1, keepdim=True)


def _output(f, square_sum, weight, bias, hidden: int, eps: float, dtype: torch.dtype, plus_one: bool):
    rstd = torch.rsqrt(square_sum / hidden + eps)
    return _scaled(f, rstd, weight, bias, dtype, plus_one), rstd


def _scaled(f, rstd, weight, bias, dtype: torch.dtype, plus_one: bool = False):
    if plus_one:  # Gemma's: scaled by 1 + weight in fp32 at least, then cast (Llama casts, then scales)
        return ((f * rstd) * (1 + weight.to(f.dtype))).to(dtype)
    out = (f * rstd).to(dtype) * weight
    return out + bias if bias is not None else out


def _backward_sums(h, mean, rstd, weight, grad, has_bias: bool, plus_one: bool):
    acc = rstd.dtype
    n = (h.to(acc) - mean if mean is not None else h.to(acc)) * rstd  # the normalised input
    tokens = tuple(range(grad.dim() - 1))
    g = grad.to(acc)
    grad_weight = (g * n).sum(tokens).to(weight.dtype)
    grad_bias = g.sum(tokens).to(weight.dtype) if has_bias else None
    gn = g * (1 + weight.to(acc) if plus_one else weight.to(acc))
    ones_projection = gn.sum(-1, keepdim=True) if mean is not None else None  # (LayerNorm's)
    return n, gn, grad_weight, grad_bias, (gn * n).sum(-1, keepdim=True), ones_projection


def _grad_input(n, gn, rstd, n_projection, ones_projection, hidden: int, dtype: torch.dtype):
    # d/dh of n = (h - mean) * rstd: the projections on n and (LayerNorm) on 1, over all features
    dh = gn - n * n_projection / hidden
    if ones_projection is not None:
        dh = dh - ones_projection / hidden
    return (dh * rstd).to(dtype)


_EAGER = dict(centre=_centre, sum=_sum, square_sum=_square_sum, output=_output, backward_sums=_backward_sums,
              grad_input=_grad_input)


@functools.cache
def compiled(fn):
    """`fn` under torch.compile, compiled once per process (TensorOptions.compile, train.compile)."""
    return torch.compile(fn, dynamic=False)


@functools.cache
def _compiled() -> dict:
    return {name: compiled(fn) for name, fn in _EAGER.items()}


class _Normalise(torch.autograd.Function):
    """(h - mean) / rms (LayerNorm, `centred`) or h / rms (RMSNorm) over the features of all x
    ranks, times weight (plus bias; `plus_one`: times 1 + weight), in fp32 at least."""

    @staticmethod
    def forward(ctx, h, weight, bias, x: Group, eps: float, hidden: int, centred: bool, use_compile: bool,
                stats: list | None, plus_one: bool = False):
        k = _compiled() if use_compile else _EAGER
        mean = comm.all_reduce(k["sum"](k["centre"](h, None)), x) / hidden if centred else None
        f = k["centre"](h, mean)
        out, rstd = k["output"](f, comm.all_reduce(k["square_sum"](f), x), weight, bias, hidden, eps, h.dtype,
                                plus_one)
        ctx.save_for_backward(h, weight, mean, rstd)
        if stats is not None:  # for `ParallelNorm.rebuilt`
            stats.append((mean, rstd))
        ctx.x, ctx.hidden, ctx.has_bias, ctx.use_compile, ctx.plus_one = x, hidden, bias is not None, use_compile, \
            plus_one
        return out

    @staticmethod
    def backward(ctx, grad):
        h, weight, mean, rstd = ctx.saved_tensors
        k = _compiled() if ctx.use_compile else _EAGER
        n, gn, grad_weight, grad_bias, n_projection, ones_projection = k["backward_sums"](h, mean, rstd, weight, grad,
                                                                                           ctx.has_bias, ctx.plus_one)
        n_projection = comm.all_reduce(n_projection, ctx.x)
        ones_projection = comm.all_reduce(ones_projection, ctx.x) if mean is not None else None
        dh = k["grad_input"](n, gn, rstd, n_projection, ones_projection, ctx.hidden, h.dtype)
        return dh, grad_weight, grad_bias, None, None, None, None, None, None, None


class ParallelNorm(ParallelModule):
    def __init__(self, grid: Grid, hidden: int, kind: str, eps: float, *, seq_parallel: bool, dtype: torch.dtype,
                 name: str, compile: bool = False):
        super().__init__()
        self.compile = compile
        if hidden % grid.size("x"):
            raise GridError(f"{name}: hidden={hidden} is not divisible by x={grid.size('x')}; "
                            f"choose x dividing {hidden}")
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
        self.weight.fill_(0 if self.kind == "rms_plus_one" else 1)  # (the identity either way)
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, h: torch.Tensor, stats: list | None = None) -> torch.Tensor:
        """The normalised h; `stats` (a list) gets its (mean, rstd), from which `rebuilt` makes it again."""
        return _Normalise.apply(h, self.weight, self.bias, self.grid.group("x"), self.eps, self.hidden,
                                self.kind == "layer", self.compile, stats, self.kind == "rms_plus_one")

    def rebuilt(self, h: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor) -> torch.Tensor:
        """forward(h) again from its statistics, without their collectives (the eager operations:
        the same values as the eager forward's)."""
        return _scaled(_centre(h, mean), rstd, self.weight, self.bias, h.dtype, self.kind == "rms_plus_one")

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


class _QKNorm(ParallelModule):
    """An RMSNorm of queries or keys over `features` (fp32 statistics as `ParallelNorm`'s, reduced over
    `group`), whose weight is this rank's slice [offset, offset + local) of the serial one: what
    `HeadNorm` and `AllHeadsNorm` share. `grad_sum` and `replicated`: its `ParamLayout`."""

    def __init__(self, grid: Grid, name: str, eps: float, compile: bool, dtype: torch.dtype, *, features: int,
                 group: Group, offset: int, local: int, grad_sum: tuple[str, ...], replicated: tuple[str, ...],
                 plus_one: bool = False):
        super().__init__()
        self.grid, self.name, self.eps, self.compile, self.plus_one = grid, name, eps, compile, plus_one
        self.features, self.group, self.offset, self.local = features, group, offset, local
        self.grad_sum, self.replicated = grad_sum, replicated
        self.weight = nn.Parameter(torch.empty(local, dtype=dtype))
        self.initialise()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(0 if self.plus_one else 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _Normalise.apply(h, self.weight, None, self.group, self.eps, self.features, False, self.compile,
                                None, self.plus_one)

    def load(self, read, put) -> None:
        put(self.weight, read(f"{self.name}.weight", slice(self.offset, self.offset + self.local), None))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        piece = vector_piece(f"{self.name}.weight", self.features, self.offset, self.local)
        return {self.weight: ParamLayout(self.grad_sum, self.replicated, (piece,))}


class HeadNorm(_QKNorm):
    """RMSNorm over each head's features (Qwen3's q_norm and k_norm: [..., head_dim] by a [head_dim]
    weight), fp32 statistics as `ParallelNorm`'s. A rank holds whole heads, so the statistics need no
    collective; the weight is held whole on every rank. Its gradient is summed over the ranks that hold
    other heads (x*y on the non-redundant path, y on the published one, where the x ranks compute the
    same heads) and other tokens (z; dp and cp by the gradient sync). Sequence parallelism does not
    change it: attention runs after the QKV projection has gathered the tokens over y."""

    def __init__(self, grid: Grid, head_dim: int, eps: float, *, own_heads: bool, dtype: torch.dtype, name: str,
                 compile: bool = False, plus_one: bool = False):
        # no reduction of the statistics: a group of this rank alone (its collectives cost and record nothing)
        alone = Group(f"{name}.alone", None, (grid.rank,), 0, grid.ledger)
        super().__init__(grid, name, eps, compile, dtype, features=head_dim, group=alone, offset=0, local=head_dim,
                         grad_sum=("x", "y", "z") if own_heads else ("y", "z"), replicated=("x", "y", "z"),
                         plus_one=plus_one)

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        return {f"{self.name}.weight": pick(self.weight).detach()}


class AllHeadsNorm(_QKNorm):
    """RMSNorm over the features of all heads of a token (OLMoE's q_norm and k_norm: [..., heads * head_dim]
    by a weight of that size, before the split into heads), fp32 statistics as `ParallelNorm`'s. A rank holds
    chunk `chunk` of the heads (`BlockPlan.attention_chunks`), so, as `ParallelNorm` over x, the per-token sum
    of squares is all-reduced over the ranks holding the other heads (`BlockPlan.head_group`: x*y on the
    non-redundant path, y on the published one), and backward's projection likewise: one number per token
    each way. Each rank holds its heads' slice of the weight; its gradient is summed over z (other tokens; dp
    and cp by the gradient sync); the x ranks of the published path compute the same heads on the same tokens
    (a replicated slice, not summed); sequence parallelism changes nothing (attention runs on the tokens the
    QKV projection gathered over y)."""

    def __init__(self, grid: Grid, features: int, chunks: int, eps: float, *, own_heads: bool, dtype: torch.dtype,
                 name: str, compile: bool = False):
        c, local = grid.coords, features // chunks
        # QKV's rows: y blocks of chunks/y chunks each, split over x on the non-redundant path
        chunk = c["y"] * grid.size("x") + c["x"] if own_heads else c["y"]
        group = grid.group(("x", "y")) if own_heads else grid.group("y")
        # named as the block plan's `head_group` whatever the placement order (the volumes' name)
        group = Group("x_y" if own_heads else "y", group.process_group, group.ranks, group.rank, grid.ledger,
                      grid.clock)
        super().__init__(grid, name, eps, compile, dtype, features=features, group=group, offset=chunk * local,
                         local=local, grad_sum=("z",), replicated=("z",) if own_heads else ("x", "z"))
        self.own_heads = own_heads

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        t = pick(self.weight).detach()
        if self.own_heads:  # chunk y * x_size + x: over x within a y block, then the y blocks
            t = comm.all_gather(t, self.grid.group("x"))
        return {f"{self.name}.weight": comm.all_gather(t, self.grid.group("y"))}
