"""The 3D-parallel linear layer (tensor3d.md): weight blocks over (x, y), flattened and split over z.

An "x-in" layer splits its input features K over x and output features N over y; a "y-in" layer
the reverse. Activations are [batch/z, seq, features]; a layer that gathers or scatters tokens runs on them
flattened into one row, [1, batch/z*seq, features] (`regions.token_rows`: a rank's share of the
tokens is a contiguous range of them, so the collectives copy nothing whatever the batch). Around
the GEMM, one autograd function carries out, in order:

    forward:  [all-gather of the input over the out-dim (tokens or features)]
              all-gather of the weight over z; GEMM;
              all-reduce, or reduce-scatter (tokens or features), over the in-dim
              (with forward overlap, in chunks: `_pipelined_forward`)
    backward: [all-gather of dY over the in-dim]; the weight again (or the kept copy);
              dX GEMM, then its all-reduce (or reduce-scatter) over the out-dim launched async
              and overlapped with the dW GEMM; reduce-scatter of dW over z.

`RowSource` says which serial parameter each output row comes from, so fused layers (QKV,
gate+up) are initialised and exported as the serial model's separate matrices.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from fourfold.parallel import comm
from fourfold.parallel.grid import Grid
from fourfold.parallel.overlap import OverlapOptions, Overlapper
from fourfold.parallel.tensor import init
from fourfold.parallel.tensor.fp8 import Float8GEMMs, gpu_takes_fp8
from fourfold.parallel.tensor.params import ParallelModule, ParamLayout, Piece
from fourfold.parallel.tensor.regions import token_rows
from fourfold.spec.blockspec import LINEAR_KINDS, RowSource
from fourfold.spec.layout import GridError

SEQ_DIM, FEATURE_DIM = 1, -1
INIT_PIECE = 2**22  # elements initialised at a time
REDUCTIONS = ("all_reduce", "scatter_tokens", "scatter_features")
GATHERS = ("none", "tokens", "features")


class ShardedMatrix:
    """Where the elements of a fused [N, K] matrix live: block (N over out, K over in), flat over z."""

    def __init__(self, grid: Grid, rows: Sequence[RowSource], in_features: int, kind: str, what: str):
        if kind not in LINEAR_KINDS:
            raise ValueError(f"kind {kind!r} must be one of {', '.join(LINEAR_KINDS)}")
        self.grid, self.rows, self.kind = grid, tuple(rows), kind
        self.in_dim, self.out_dim = LINEAR_KINDS[kind]
        self.n, self.k = sum(r.count for r in rows), in_features
        size_in, size_out = grid.size(self.in_dim), grid.size(self.out_dim)
        if self.k % size_in or self.n % size_out:
            raise GridError(
                f"{what}: {self.k} input features over {self.in_dim}={size_in} and {self.n} outputs over "
                f"{self.out_dim}={size_out} must divide evenly; choose {self.in_dim} dividing {self.k} "
                f"and {self.out_dim} dividing {self.n}"
            )
        self.block_shape = (self.n // size_out, self.k // size_in)
        self.block_numel = self.block_shape[0] * self.block_shape[1]
        # The flat block is split over z in equal shards; the last ones are padded with zeros.
        self.shard_numel = -(-self.block_numel // grid.size("z"))

    def init_shard(self, seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of the serial model's initial values (padding stays zero).

        Each piece is a contiguous flat range of the shard: plain integer arithmetic, no
        data-dependent masks (a model can be built under FakeTensorMode to measure its memory).
        """
        shard = torch.zeros(self.shard_numel, dtype=dtype)
        for piece in self.pieces():
            (row0, col0), cols, (lo, hi) = piece.offset, piece.window[1], piece.flat
            # In chunks: the generator's int64/float64 temporaries are several times the values.
            for a in range(lo, hi, INIT_PIECE):
                flat = torch.arange(a, min(a + INIT_PIECE, hi))
                index = (flat // cols + row0) * self.k + flat % cols + col0
                at = piece.local_start + a - lo
                shard[at : at + len(flat)] = init.normal(seed, piece.name, index, std, dtype)
        return shard

    def pieces(self, bias: bool = False) -> tuple[Piece, ...]:
        """The serial elements this rank's weight shard (or bias, NAME.bias) holds: for each
        source, its rows in this (x, y) block, as far as they overlap this rank's z shard (the
        shard is a contiguous flat range of the row-major block; the bias is not split over z)."""
        c, (block_rows, block_cols) = self.grid.coords, self.block_shape
        cols = 1 if bias else block_cols
        row0, col0 = c[self.out_dim] * block_rows, 0 if bias else c[self.in_dim] * block_cols
        start = 0 if bias else c["z"] * self.shard_numel
        stop = block_rows if bias else min(start + self.shard_numel, self.block_numel)
        sizes: dict[str, int] = {}
        for src in self.rows:
            sizes[src.name] = sizes.get(src.name, 0) + src.count
        out, fused = [], 0  # fused: first fused row of the current source
        for src in self.rows:
            first, last = max(fused, row0), min(fused + src.count, row0 + block_rows)
            base = (first - row0) * cols  # where the source's window starts in the flat block
            lo, hi = max(start, base), min(stop, (last - row0) * cols)
            if first < last and lo < hi:
                shape = (sizes[src.name],) if bias else (sizes[src.name], self.k)
                out.append(Piece(src.name + (".bias" if bias else ""), shape, (src.start + first - fused, col0),
                                 (last - first, cols), (lo - base, hi - base), lo - start))
            fused += src.count
        return tuple(out)

    def read_shard(self, read) -> torch.Tensor:
        """This rank's shard, reading only the rows of its block of the serial matrices that its z
        shard overlaps (see params.Read): a z-sharded rank reads about 1/z of the block."""
        n_local, k_local = self.block_shape
        start = self.grid.coords["z"] * self.shard_numel
        stop = min(start + self.shard_numel, self.block_numel)
        if start >= stop:  # a z shard of padding only (a block smaller than z shards)
            return torch.zeros(self.shard_numel)
        r0, r1 = start // k_local, -(-stop // k_local)
        first = self.grid.coords[self.out_dim] * n_local + r0
        cols = slice(self.grid.coords[self.in_dim] * k_local, (self.grid.coords[self.in_dim] + 1) * k_local)
        rows = torch.cat(self._read_rows(read, first, r1 - r0, cols, "")).reshape(-1)
        part = rows[start - r0 * k_local : stop - r0 * k_local]
        return torch.cat([part, part.new_zeros(self.shard_numel - len(part))])  # the last shard's padding

    def read_bias(self, read) -> torch.Tensor:
        n_local = self.block_shape[0]
        return torch.cat(self._read_rows(read, self.grid.coords[self.out_dim] * n_local, n_local, None, ".bias"))

    def _read_rows(self, read, first: int, count: int, cols: slice | None, suffix: str) -> list[torch.Tensor]:
        """Fused rows [first, first + count), read from the serial tensors they come from."""
        pieces, start = [], 0
        for src in self.rows:
            lo, hi = max(start, first), min(start + src.count, first + count)
            if lo < hi:
                pieces.append(read(src.name + suffix, slice(lo - start + src.start, hi - start + src.start), cols))
            start += src.count
        return pieces

    def split_rows(self, fused: torch.Tensor, suffix: str = "") -> dict[str, torch.Tensor]:
        """Cut a full fused matrix (or vector) into the serial ones it is made of."""
        pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        start = 0
        for src in self.rows:
            pieces.setdefault(src.name + suffix, []).append((src.start, fused[start : start + src.count]))
            start += src.count
        return {name: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for name, parts in pieces.items()}

    def gather_block(self, shard: torch.Tensor) -> torch.Tensor:
        return self.unpad(comm.all_gather(shard, self.grid.group("z")))

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The weight block from the concatenated z shards."""
        return gathered[: self.block_numel].view(self.block_shape)

    def pad(self, block: torch.Tensor) -> torch.Tensor:
        """The flat block padded to z shards (for the reduce-scatter of its gradient)."""
        flat = block.reshape(-1)
        padding = self.shard_numel * self.grid.size("z") - self.block_numel
        return torch.nn.functional.pad(flat, (0, padding)) if padding else flat

    def gather_full(self, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        """The serial matrices this shard is part of (every rank gets them all): for export and tests."""
        block = self.gather_block(shard)
        rows = comm.all_gather(block, self.grid.group(self.in_dim), dim=1)
        return self.split_rows(comm.all_gather(rows, self.grid.group(self.out_dim), dim=0))


def _gather_dim(gather: str, x: torch.Tensor) -> int:
    return SEQ_DIM if gather == "tokens" else x.dim() - 1


def _reduce(y: torch.Tensor, layer: "ParallelLinear", group, async_op: bool = False):
    """The GEMM output's sum over the in-dim: all-reduced, or reduce-scattered over tokens or features.
    bf16 partial outputs are summed in bf16 (as Megatron does): on gloo each sum is rounded once
    (comm.reduce_scatter sums in fp32; an all-reduce over 2 ranks is one addition), the same as
    summing in fp32 (tests/parallel/test_bf16.py: equal losses to every digit both ways). fp32 partial
    outputs, unrounded, would cost twice the bytes for a per-token loss error of 1.07-1.13x
    transformers' own instead of 1.18-1.27x (measured there)."""
    if layer.reduction == "all_reduce":
        return comm.all_reduce(y, group, async_op=async_op)
    dim = SEQ_DIM if layer.reduction == "scatter_tokens" else y.dim() - 1
    return comm.reduce_scatter(y, group, dim=dim, async_op=async_op)


def _by_rank_slices(layer: "ParallelLinear", group, scatter: str) -> bool:
    """Whether a reduce-scatter over features (`scatter`: the forward's reduction, or the input
    gather the backward mirrors) takes its chunks straight from the GEMMs (`_features_scattered`):
    a bf16 or float GEMM, over more than one rank."""
    return scatter in ("scatter_features", "features") and group.size > 1 and layer.fp8 is None


def _features_scattered(x: torch.Tensor, blocks: tuple[torch.Tensor, ...], group, async_op: bool = False,
                        out: torch.Tensor | None = None):
    """x @ [blocks[0] | blocks[1] | ...] summed over `group`, rank r keeping the columns of
    blocks[r]: one GEMM per block into its place of a [g, ..., columns/g] buffer, which the
    reduce-scatter sends as it is (over the last dim, `comm.reduce_scatter` would first copy the
    whole product into that order: one more read and write of it). Returns [1, ..., columns/g]
    (`out`, if given: this rank's place, with a leading 1)."""
    y = x.new_empty(len(blocks), *x.shape[:-1], blocks[0].shape[-1])
    for r, block in enumerate(blocks):
        torch.matmul(x, block, out=y[r])
    return comm.reduce_scatter(y, group, dim=0, async_op=async_op, out=out)


def _gemm_by_blocks(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x @ weight.t() into `out`, one GEMM per block of dim 1 ([1, blocks, rows, K] -> [1, blocks,
    rows, N]): each block's rows are contiguous where the whole is not (a chunk of tokens gathered
    or scattered in slices), so neither the input nor the output is copied into order. (A chunk whose
    features are also gathered, the non-redundant path's out and down, is still copied by that gather.)"""
    for r in range(x.shape[1]):
        torch.matmul(x[:, r], weight.t(), out=out[:, r])
    return out


def forward_chunks(layer: "ParallelLinear", x: torch.Tensor) -> int:
    """In how many chunks the forward pipelines its collectives with its GEMM (1: not at all): where
    a collective crosses ranks, the chunks divide evenly (whole sequences, or, for a layer on token
    rows, its row of tokens: slices of each rank's share) and the GEMM is not FP8 tensorwise (a
    chunk's amax is not the input's: its scale would differ; rowwise, each token's is its own)."""
    chunks = layer.overlap.options.forward_chunks
    m, grid = layer.matrix, layer.grid
    gathers_tokens = layer.input_gather == "tokens" and grid.size(m.out_dim) > 1
    tensorwise = layer.fp8 is not None and layer.fp8.recipe == "tensorwise"
    if chunks < 2 or tensorwise or not (grid.size(m.in_dim) > 1 or gathers_tokens):
        return 1
    batch, seq = x.shape[0], x.shape[SEQ_DIM]
    if layer.reduction == "scatter_tokens" and layer.input_gather == "tokens":  # (gathered first: see below)
        seq *= grid.size(m.out_dim)
    slices = chunks * (grid.size(m.in_dim) if layer.reduction == "scatter_tokens" else 1)
    return chunks if batch % chunks == 0 or (batch == 1 and seq % slices == 0) else 1


def _pipelined_forward(x: torch.Tensor, weight: torch.Tensor, layer: "ParallelLinear", in_group, out_group,
                       chunks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, gathered input if kept) of the forward with its collectives in flight behind its GEMM,
    chunk by chunk (`forward_chunks`): while chunk c's GEMM runs, chunk c+1's input all-gather and
    chunk c-1's reduction are in flight (the backward's overlap, `_Linear3D.backward`, for the
    forward). A chunk is whole sequences; of a layer on token rows (one row), a slice of its tokens (of
    each in-dim rank's output tokens, where they are reduce-scattered; of each out-dim rank's input
    tokens, where they are gathered). Each chunk lands in its place of the output as its reduction
    ends: in place where that place is contiguous, or block by block where its GEMM is (gathered tokens
    not reduced over the in-dim: `_gemm_by_blocks`), else copied (gathered tokens reduced over the
    in-dim: the reduction's result holds every gathering rank's slice in turn)."""
    gather, reduction = layer.input_gather, layer.reduction
    if gather == "tokens" and reduction == "scatter_tokens":  # the LM head under sequence parallelism: its
        # input (hidden features a token, against the logits' vocabulary) gathered whole, then chunked as
        # the reduce-scatter splits its tokens
        x = comm.all_gather(x, out_group, dim=SEQ_DIM)
        gather = "none"
    batch, split = x.shape[0], in_group.size
    token_slices = reduction == "scatter_tokens" and split > 1  # a chunk: a slice of each in-dim rank's tokens
    token_gather = gather == "tokens" and out_group.size > 1  # a chunk: a slice of each out-dim rank's tokens
    tokens = x.shape[SEQ_DIM] * (out_group.size if gather == "tokens" else 1)
    out = x.new_empty(batch, tokens // (split if reduction == "scatter_tokens" else 1),
                      weight.shape[0] // (split if reduction == "scatter_features" else 1))
    if batch % chunks == 0:
        pieces, places = x.chunk(chunks), out.chunk(chunks)
    elif token_slices:
        pieces, places = x.unflatten(SEQ_DIM, (split, chunks, -1)).unbind(2), out.chunk(chunks, SEQ_DIM)
    elif token_gather:
        pieces, places = x.chunk(chunks, SEQ_DIM), out.unflatten(SEQ_DIM, (out_group.size, chunks, -1)).unbind(2)
    else:
        pieces, places = x.chunk(chunks, SEQ_DIM), out.chunk(chunks, SEQ_DIM)

    def gathered(piece):
        if gather == "none":
            return comm.Pending.done(piece)
        return comm.all_gather(piece, out_group, dim=_gather_dim(gather, piece), async_op=True)

    def gemm(xc):
        return xc @ weight.t() if layer.fp8 is None else layer.fp8.output(xc, weight)

    def reduced(xc, place):
        """Chunk `xc`'s GEMM and its reduction launched, into `place` where it can land directly."""
        if _by_rank_slices(layer, in_group, reduction):
            return _features_scattered(xc, weight.t().chunk(split, dim=1), in_group, async_op=True,
                                       out=place[None] if place.is_contiguous() else None)
        if split == 1 and not place.is_contiguous() and layer.fp8 is None:  # gathered tokens: [1, ranks, slice, N]
            return comm.Pending.done(_gemm_by_blocks(xc.view(*place.shape[:-1], -1), weight, place))
        if reduction == "all_reduce" or split == 1:
            shape = (*xc.shape[:-1], weight.shape[0])
            direct = place.is_contiguous() and place.shape == shape and layer.fp8 is None
            yc = torch.matmul(xc, weight.t(), out=place) if direct else gemm(xc)
            return comm.all_reduce(yc, in_group, async_op=True)
        if token_slices and layer.fp8 is None:  # xc: [1, in-dim ranks, slice, K], each rank's rows contiguous
            yc = _gemm_by_blocks(xc, weight, xc.new_empty(*xc.shape[:-1], weight.shape[0]))
        else:
            yc = gemm(xc)
        dim = SEQ_DIM if reduction == "scatter_tokens" else yc.dim() - 1
        shape = (*yc.shape[:dim], yc.shape[dim] // split, *yc.shape[dim + 1:])
        return comm.reduce_scatter(yc, in_group, dim=dim, async_op=True,
                                   out=place.view(shape) if place.is_contiguous() else None)

    def land(pending, place):
        result = pending.wait()
        if result is not place and (result.data_ptr() != place.data_ptr() or not place.is_contiguous()):
            place.copy_(result.view(place.shape))

    inputs, arriving, previous = [], gathered(pieces[0]), None
    for c, place in enumerate(places):
        xc = arriving.wait()
        if c + 1 < chunks:
            arriving = gathered(pieces[c + 1])
        current = (reduced(xc, place), place)
        if previous is not None:
            land(*previous)
        previous = current
        inputs.append(xc if layer.keep_gathered_input else None)
    land(*previous)
    if not layer.keep_gathered_input:
        return out, None
    if gather == "none":  # (kept: the input as it came, or the LM head's gathered whole)
        return out, x
    if batch % chunks == 0:
        return out, torch.cat(inputs)
    if token_gather:
        inputs = [t.unflatten(SEQ_DIM, (out_group.size, -1)) for t in inputs]
    if token_gather or token_slices:  # [b, ranks, slice, K] each: in token order
        return out, torch.stack(inputs, dim=2).flatten(1, 3)
    return out, torch.cat(inputs, SEQ_DIM)


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, layer: "ParallelLinear"):
        grid, m = layer.grid, layer.matrix
        in_group, out_group = grid.group(m.in_dim), grid.group(m.out_dim)
        local, ctx.input_shape = x, x.shape
        if layer.on_token_rows:
            x = token_rows(x)
        chunks = forward_chunks(layer, x)
        if chunks > 1:
            weight = layer.gather_weight(shard)
            y, x = _pipelined_forward(x, weight, layer, in_group, out_group, chunks)
        else:
            if layer.input_gather != "none":
                x = comm.all_gather(x, out_group, dim=_gather_dim(layer.input_gather, x))
            weight = layer.gather_weight(shard)
            if _by_rank_slices(layer, in_group, layer.reduction):
                y = _features_scattered(x, weight.t().chunk(in_group.size, dim=1), in_group)[0]
            else:
                y = x @ weight.t() if layer.fp8 is None else layer.fp8.output(x, weight)
                y = _reduce(y, layer, in_group)
        ctx.layer = layer
        # Megatron's rule: keep the local input and gather it again in backward (the memory that
        # sequence parallelism and the non-redundant path save), unless asked to keep the gathered one.
        # The local input is saved as it came (not its one-row view): selective recompute's hooks
        # (`block.rebuilt_in_backward`) know the tensor they drop by identity.
        kept_gathered = layer.keep_gathered_input and layer.input_gather != "none"
        ctx.save_for_backward(x if kept_gathered else local, weight if layer.keep_weight else shard)
        return y  # (on token rows: [1, tokens, N], viewed as [batch, ...] outside, where the loss may
        # write over the logits in place, which autograd forbids on a view made inside a Function)

    @staticmethod
    def backward(ctx, dy):
        layer = ctx.layer
        grid, m = layer.grid, layer.matrix
        in_group, out_group = grid.group(m.in_dim), grid.group(m.out_dim)
        x, saved = ctx.saved_tensors
        if layer.on_token_rows:
            x, dy = token_rows(x), token_rows(dy)
        overlap = layer.overlap.options.input_grad
        regather = layer.input_gather != "none" and not layer.keep_gathered_input
        if regather:  # in flight while dY is gathered and the dX GEMM runs
            x = comm.all_gather(x, out_group, dim=_gather_dim(layer.input_gather, x), async_op=overlap)
        if layer.reduction != "all_reduce":
            dy = comm.all_gather(dy, in_group, dim=SEQ_DIM if layer.reduction == "scatter_tokens" else dy.dim() - 1)
        weight = saved if layer.keep_weight else layer.gather_weight(saved)
        sliced = _by_rank_slices(layer, out_group, layer.input_gather)
        if sliced:  # dX's features, each rank's by its own GEMM
            pending = _features_scattered(dy, weight.chunk(out_group.size, dim=1), out_group, async_op=overlap)
        else:
            dx = dy @ weight if layer.fp8 is None else layer.fp8.grad_input(dy, weight)
            if layer.input_gather == "none":
                pending = comm.all_reduce(dx, out_group, async_op=overlap)
            else:
                pending = comm.reduce_scatter(dx, out_group, dim=_gather_dim(layer.input_gather, dx),
                                              async_op=overlap)
        if regather and overlap:
            x = x.wait()
        # With overlap on, the dW GEMM runs while the input-gradient collective is in flight.
        if layer.fp8 is None:
            dweight = dy.reshape(-1, m.block_shape[0]).t() @ x.reshape(-1, m.block_shape[1])
        else:
            dweight = layer.fp8.grad_weight(dy, x)
        dshard = layer.overlap.weight_grad(layer.weight, m.pad(dweight))
        dx = pending.wait() if overlap else pending
        return (dx[0] if sliced else dx).view(ctx.input_shape), dshard, None


class ParallelLinear(ParallelModule):
    """Y = X W^T (+ b) on the 3D grid; see the module docstring for the collectives.

    `reduction` over the in-dim: "all_reduce" (output replicated over it), "scatter_features"
    (each rank keeps 1/in of the output features) or "scatter_tokens" (1/in of the tokens: a contiguous
    range of them flattened, `regions.token_rows`).
    `input_gather` over the out-dim: "none" (input replicated), "tokens" or "features" (the input
    holds 1/out of them and is gathered first). `keep_weight` keeps the gathered weight from
    forward to backward instead of gathering it again; `keep_gathered_input` likewise the gathered
    input (by default the local input is kept and gathered again in backward). `fp8` ("tensorwise" or
    "rowwise", train.fp8): the three GEMMs in float8 (`tensor.fp8`), emulated where the device has none.
    """

    def __init__(
        self, grid: Grid, in_features: int, rows: Sequence[RowSource], kind: str, *, seed: int, std: float,
        bias: bool = False, reduction: str = "all_reduce", input_gather: str = "none", keep_weight: bool = False,
        keep_gathered_input: bool = False,
        dtype: torch.dtype = torch.float32, name: str = "linear", overlap: Overlapper | None = None, fp8: str = "",
    ):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction {reduction!r} must be one of {', '.join(REDUCTIONS)}")
        if input_gather not in GATHERS:
            raise ValueError(f"input_gather {input_gather!r} must be one of {', '.join(GATHERS)}")
        self.grid, self.reduction, self.input_gather, self.keep_weight = grid, reduction, input_gather, keep_weight
        self.keep_gathered_input = keep_gathered_input
        # its collectives gather or scatter tokens: it runs on them as one row (`regions.token_rows`)
        self.on_token_rows = input_gather == "tokens" or reduction == "scatter_tokens"
        self.matrix = ShardedMatrix(grid, rows, in_features, kind, name)
        self.fp8 = None
        if fp8:
            self.fp8 = Float8GEMMs(fp8, grid, self.matrix.in_dim, self.matrix.out_dim,
                                   emulate=not gpu_takes_fp8(grid.device))
        # Shared with the model's other layers for prefetching; a layer on its own gets its own.
        self.overlap = overlap or Overlapper(OverlapOptions(), grid.group("z"))
        self.seed, self.std = seed, std
        self.weight = nn.Parameter(torch.empty(self.matrix.shard_numel, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.matrix.block_shape[0], dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.initialise()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.copy_(self.matrix.init_shard(self.seed, self.std, self.weight.dtype))
        if self.bias is not None:
            self.bias.zero_()  # GPT-2 starts biases at 0

    def gather_weight(self, shard: torch.Tensor) -> torch.Tensor:
        return self.overlap.gather(self, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Linear3D.apply(x, self.weight, self)
        if self.on_token_rows:
            y = y.view(x.shape[0], -1, y.shape[-1])
        if self.bias is None:
            return y
        bias = self.bias
        if self.reduction == "scatter_features":
            in_group = self.grid.group(self.matrix.in_dim)
            bias = bias.chunk(in_group.size)[in_group.rank]
        return y + bias

    def load(self, read, put) -> None:
        """Give this rank's shards, read from serial tensors, to `put` (see params.load)."""
        put(self.weight, self.matrix.read_shard(read))
        if self.bias is not None:
            put(self.bias, self.matrix.read_bias(read))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        # The weight's gradient is complete after the reduce-scatter over z.
        out = {self.weight: ParamLayout((), (), self.matrix.pieces())}
        if self.bias is not None:
            # The bias is added after the reduction: its gradient is a sum over the local tokens
            # (split over z, and over the in-dim when scattering tokens) and, when scattering
            # features, only this rank's slice is filled.
            grad_sum = ("z",) if self.reduction == "all_reduce" else ("z", self.matrix.in_dim)
            out[self.bias] = ParamLayout(grad_sum, (self.matrix.in_dim, "z"), self.matrix.pieces(bias=True))
        return out

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        """Serial tensors of `pick(param)` (see params.full_weights), gathered from every rank;
        biases as NAME.bias."""
        out = self.matrix.gather_full(pick(self.weight).detach())
        if self.bias is not None:
            bias = pick(self.bias).detach()
            out.update(self.matrix.split_rows(comm.all_gather(bias, self.grid.group(self.matrix.out_dim)), ".bias"))
        return out
