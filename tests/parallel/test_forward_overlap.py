"""A linear's forward with its collectives pipelined behind its GEMM (`OverlapOptions.forward_chunks`,
`tensor.linear._pipelined_forward`): output, input gradient and weight gradient equal the unchunked
forward's, in every layer form the block plans use, for one and two sequences a micro-batch, keeping
the gathered input or not; the bytes sent are the same and the reductions ran chunk by chunk."""

import pytest
import torch

from fourfold.parallel.grid import Grid
from fourfold.parallel.overlap import OverlapOptions, Overlapper
from fourfold.parallel.tensor.linear import ParallelLinear
from fourfold.spec.blockspec import LINEAR_KINDS, RowSource
from fourfold.spec.layout import Layout

K, N, SEQ = 16, 32, 8


def _part(t: torch.Tensor, grid: Grid, dim: str, axis: int) -> torch.Tensor:
    return t.chunk(grid.size(dim), dim=axis)[grid.coords[dim]]


def _chunked_against_whole(sizes: dict, kind: str, reduction: str, input_gather: str, fp8: str = ""):
    """Per (batch, keep_gathered_input): (largest difference of output and gradients between 2 chunks and
    1, relative to their largest, the ledger bytes equal, the in-dim reduction's calls with chunks and
    without). With `fp8`, float32 (float8's GEMMs emulated)."""
    grid = Grid(Layout(**sizes))
    in_dim, out_dim = LINEAR_KINDS[kind]
    op = "all_reduce" if reduction == "all_reduce" else "reduce_scatter"
    results = []
    for batch in (1, 2):
        for keep in (False, True):
            g = torch.Generator().manual_seed(batch)
            dtype = torch.float32 if fp8 else torch.float64
            x = torch.randn(batch, SEQ, K, generator=g, dtype=dtype)
            dy = torch.randn(batch, SEQ, N, generator=g, dtype=dtype)
            local = _part(x, grid, in_dim, -1)
            local = (_part(local, grid, out_dim, 1) if input_gather == "tokens" else
                     _part(local, grid, out_dim, -1) if input_gather == "features" else local)
            local_dy = _part(dy, grid, out_dim, -1)
            local_dy = (_part(local_dy, grid, in_dim, 1) if reduction == "scatter_tokens" else
                        _part(local_dy, grid, in_dim, -1) if reduction == "scatter_features" else local_dy)
            out, sent, calls = [], [], []
            for chunks in (1, 2):
                layer = ParallelLinear(grid, K, [RowSource("w", 0, N)], kind, seed=0, std=0.5, bias=True,
                                       reduction=reduction, input_gather=input_gather, keep_gathered_input=keep,
                                       dtype=x.dtype, fp8=fp8,
                                       overlap=Overlapper(OverlapOptions(forward_chunks=chunks), grid.group("z")))
                grid.ledger.reset()
                xi = local.clone().requires_grad_()
                y = layer(xi)
                y.backward(local_dy)
                out.append([y.detach(), xi.grad, layer.weight.grad, layer.bias.grad])
                sent.append(grid.ledger.bytes())
                calls.append(grid.ledger.calls().get((in_dim, op), 0))
            error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*out))
            results.append((error, sent[0] == sent[1], tuple(calls)))
    return results


FORMS = [  # (kind, reduction, input_gather): the block plans' linears (blockspec.block_plan)
    ("x-in", "all_reduce", "tokens"),  # QKV, gate/up under sequence parallelism
    ("x-in", "scatter_features", "tokens"),  # the same on the non-redundant path (whole heads per rank)
    ("y-in", "scatter_tokens", "none"),  # out, down under sequence parallelism
    ("y-in", "scatter_tokens", "features"),  # the same on the non-redundant path
    ("x-in", "all_reduce", "none"),  # without sequence parallelism
    ("y-in", "all_reduce", "features"),
    ("x-in", "scatter_tokens", "tokens"),  # the LM head under sequence parallelism (vocab.LMHead)
]


@pytest.mark.parametrize("sizes", [dict(x=2, y=2), dict(y=2)], ids=["x2y2", "y2"])
@pytest.mark.parametrize("kind, reduction, input_gather", FORMS, ids=lambda v: v)
def test_a_pipelined_forward_equals_the_whole(ranks, sizes, kind, reduction, input_gather):
    world = Layout(**sizes).world_size
    in_size = sizes.get(LINEAR_KINDS[kind][0], 1)
    for rank in ranks.run(_chunked_against_whole, world, sizes, kind, reduction, input_gather):
        for error, same_bytes, (whole, chunked) in rank:
            assert error < 1e-12 and same_bytes
            if in_size > 1:
                assert chunked == 2 * whole, (whole, chunked)  # (the reduction did run chunk by chunk)


def test_a_pipelined_forward_with_fp8_rowwise_equals_the_whole(ranks):
    """Rowwise, each token's scale is its own and the weight's the same in every chunk: the float8 GEMMs
    chunk exactly (tensorwise, a chunk's scale would not be the whole input's: not chunked)."""
    pytest.importorskip("torchao")
    for rank in ranks.run(_chunked_against_whole, 4, dict(x=2, y=2), "x-in", "all_reduce", "tokens", "rowwise"):
        for error, _, (whole, chunked) in rank:
            assert error < 1e-6 and chunked == 2 * whole


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """The sizes of the tensors copy operators wrote (clone, copy_, _to_copy), in elements."""

    COPIES = {"clone.default", "copy_.default", "_to_copy.default"}

    def __init__(self):
        super().__init__()
        self.sizes = []

    @property
    def largest(self) -> int:
        return max(self.sizes, default=0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__ in self.COPIES:
            self.sizes.append(out.numel())
        return out


def _largest_copy(chunks: int, batch: int) -> int:
    grid = Grid(Layout(x=2))
    layer = ParallelLinear(grid, K, [RowSource("w", 0, N)], "x-in", seed=0, std=0.5, bias=False,
                           reduction="scatter_features", input_gather="none", dtype=torch.float64,
                           overlap=Overlapper(OverlapOptions(forward_chunks=chunks), grid.group("z")))
    x = torch.randn(batch, SEQ, K // 2, dtype=torch.float64)  # (K over x)
    with _Copies() as copies:
        layer(x)
    return copies.largest


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_feature_reduce_scatter_sends_its_gemms_output_as_it_is(ranks, chunks):
    """A linear reducing its output features over x runs its GEMM as one GEMM per rank's columns, into
    the [x, ..., N/x] order the reduce-scatter sends: no copy of the output (before, `comm.reduce_scatter`
    reordered the whole [b, s, N] output over its last dim), whole or in chunks."""
    for batch in (1, 2):
        for largest in ranks.run(_largest_copy, 2, chunks, batch):
            assert largest < batch * SEQ * N // 2, largest  # not even one rank's share of it


def _input_gradient_copies(batch: int) -> list[int]:
    grid = Grid(Layout(x=2))
    layer = ParallelLinear(grid, K, [RowSource("w", 0, N)], "y-in", seed=0, std=0.5, bias=False,
                           reduction="all_reduce", input_gather="features", keep_gathered_input=True,
                           dtype=torch.float64, overlap=Overlapper(OverlapOptions(), grid.group("z")))
    x = torch.randn(batch, SEQ, K // 2, dtype=torch.float64, requires_grad=True)  # (K's features over x)
    y = layer(x)
    with _Copies() as copies:
        y.backward(torch.ones_like(y))
    return copies.sizes


def test_the_input_gradients_reduce_scatter_over_features_sends_its_gemms_output_as_it_is(ranks):
    """The backward of a linear whose input features were gathered over x: dX = dY W, reduce-scattered
    over those features, runs as one GEMM per rank's columns into the order the collective sends, so
    no copy the size of dX is made (3 sequences: no other tensor of the step has its size)."""
    for sizes in ranks.run(_input_gradient_copies, 2, 3):
        assert 3 * SEQ * K not in sizes, sizes


def _token_collective_copies(kind: str, reduction: str, input_gather: str, chunks: int) -> list[int]:
    grid = Grid(Layout(y=2))
    layer = ParallelLinear(grid, K, [RowSource("w", 0, N)], kind, seed=0, std=0.5, bias=False, reduction=reduction,
                           input_gather=input_gather, dtype=torch.float64,
                           overlap=Overlapper(OverlapOptions(forward_chunks=chunks), grid.group("z")))
    tokens = SEQ // 2 if input_gather == "tokens" else SEQ
    x = torch.randn(2, tokens, K // 2 if kind == "y-in" else K, dtype=torch.float64, requires_grad=True)
    with _Copies() as copies:
        y = layer(x)
        y.backward(torch.ones_like(y))
    return copies.sizes


TOKEN_FORMS = [form for form in FORMS if any("tokens" in v for v in form[1:])]


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("kind, reduction, input_gather", TOKEN_FORMS, ids=lambda v: v)
def test_token_collectives_copy_no_activation_whatever_the_batch(ranks, kind, reduction, input_gather, chunks):
    """Two sequences a micro-batch, tokens gathered or reduce-scattered over y (sequence parallelism), in
    forward and backward, whole or in chunks: a rank's share of the tokens is a contiguous range of them
    flattened (`regions.token_rows`), and a chunk's GEMM runs block by block where its tokens are slices
    of each rank's, so nothing the size of an input, output or gradient is copied (before, every one of
    these collectives reordered its whole tensor: a slice of each sequence is strided in [b, s, f])."""
    for sizes in ranks.run(_token_collective_copies, 2, kind, reduction, input_gather, chunks):
        assert max(sizes, default=0) < 2 * SEQ * min(K, N) // 2, sizes
