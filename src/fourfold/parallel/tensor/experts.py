"""A rank's experts run together: each of the expert MLP's two linears is one autograd function over
every local expert, on their tokens concatenated in expert order (`counts` rows each).

Each expert keeps its own `ParallelLinear` (its parameters, z shard, checkpoint and export names are
unchanged); what is shared is the work around the GEMMs. The activation collectives of the 3D linear
(tensor3d.md: the input's feature gather, the output's all-reduce or feature reduce-scatter, and
their backward twins) are linear in the tokens, so they run once on all experts' rows: the same bytes
as one collective per expert, in one call instead of `experts`. The GEMMs are one `torch._grouped_mm`
where the device and dtype allow (bf16, as its CUDA kernel and fake-tensor rule take; float32 too on
CPU), with the experts' offsets on the device (no host read); otherwise, and in float64, a loop of
GEMMs, the reference path. The weights are stacked for the grouped GEMM ([experts, N, K], a copy of
this layer's expert blocks held for the GEMM only: storing them stacked would save it).

Only feature-dim collectives run here: a token-dim gather or scatter would mix experts' rows across
ranks (the mixture gathers the stream's tokens itself; `spec.blockspec` gives experts none).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from fourfold.parallel import comm
from fourfold.parallel.tensor.linear import ParallelLinear


def grouped_gemm_runs(x: torch.Tensor, *features: int) -> bool:
    """Whether `torch._grouped_mm` takes `x`'s dtype on its device, with rows of `features` 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    # (float32 only eagerly on CPU: the kernel's fake-tensor rule, which tracing uses, takes bf16 alone)
    cpu_float32 = x.dtype == torch.float32 and x.device.type == "cpu"
    takes = x.dtype == torch.bfloat16 or (cpu_float32 and not is_fake(x) and not torch.compiler.is_compiling())
    return takes and all(f * x.element_size() % 16 == 0 for f in features)


class Routed:
    """The rows of a rank's experts, concatenated in expert order: how many each has, as device
    offsets (the grouped GEMM's, with no host read) and, where a loop needs them, host counts."""

    def __init__(self, offsets: torch.Tensor, counts: list[int] | None, grouped: bool):
        self.offsets, self._counts, self.grouped = offsets, counts, grouped

    @classmethod
    def from_counts(cls, counts: torch.Tensor | list[int], device: torch.device, grouped: bool) -> "Routed":
        """`counts`: rows per expert, on the device (kept there when grouped) or a host list."""
        if isinstance(counts, list):
            offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
            return cls(offsets, counts, grouped)
        return cls(counts.cumsum(0).to(torch.int32), None if grouped else counts.tolist(), grouped)

    @property
    def counts(self) -> list[int]:
        """Rows per expert on the host (one read of the offsets if they were kept on the device)."""
        if self._counts is None:
            ends = self.offsets.tolist()
            self._counts = [b - a for a, b in zip([0] + ends[:-1], ends)]
        return self._counts


def _weights(layers, shards: list[torch.Tensor], routed: Routed):
    """The experts' weight blocks [N, K], gathered over z from their `shards`: stacked [experts, N, K]
    for the grouped GEMM (each block copied into its place as it comes, so at most one besides the
    stack is alive), else a list."""
    blocks = (layer.gather_weight(shard) for layer, shard in zip(layers, shards))
    if not routed.grouped:
        return list(blocks)
    stacked = None
    for e, block in enumerate(blocks):
        if stacked is None:
            stacked = block.new_empty(len(layers), *block.shape)
        stacked[e] = block
    return stacked


def _gemm(x: torch.Tensor, weights, routed: Routed, transpose: bool) -> torch.Tensor:
    """Each expert's rows of `x` [rows, K] times its weight block [N, K] (`_weights`): x W^T (or x W when
    `transpose` is False: the input gradient's)."""
    if routed.grouped:
        b = weights.transpose(-2, -1) if transpose else weights  # (either major order: the kernel takes both)
        return torch._grouped_mm(x, b, offs=routed.offsets)
    parts = x.split(routed.counts)
    return torch.cat([p @ (w.t() if transpose else w) for p, w in zip(parts, weights)])


def _weight_grads(dy: torch.Tensor, x: torch.Tensor, routed: Routed) -> list[torch.Tensor]:
    """Each expert's dW = dy_e^T x_e, [N, K]."""
    if routed.grouped:
        return list(torch._grouped_mm(dy.t(), x, offs=routed.offsets).unbind(0))
    return [d.t() @ p for d, p in zip(dy.split(routed.counts), x.split(routed.counts))]


class _Experts3D(torch.autograd.Function):
    """`ParallelLinear`'s forward and backward (linear._Linear3D) for all of a rank's experts at once."""

    @staticmethod
    def forward(ctx, x, routed: Routed, layers: tuple[ParallelLinear, ...], *shards):
        first = layers[0]
        grid, m = first.grid, first.matrix
        in_group, out_group = grid.group(m.in_dim), grid.group(m.out_dim)
        local = x
        if first.input_gather == "features":
            x = comm.all_gather(x, out_group, dim=-1)
        weights = _weights(layers, shards, routed)
        y = _gemm(x, weights, routed, transpose=True)
        if first.reduction == "all_reduce":
            y = comm.all_reduce(y, in_group)
        else:
            y = comm.reduce_scatter(y, in_group, dim=-1)
        ctx.routed, ctx.layers = routed, layers
        kept = (([weights] if routed.grouped else weights) if first.keep_weight else shards)
        ctx.save_for_backward(x if first.keep_gathered_input else local, *kept)
        return y

    @staticmethod
    def backward(ctx, dy):
        layers, routed = ctx.layers, ctx.routed
        first = layers[0]
        grid, m = first.grid, first.matrix
        in_group, out_group = grid.group(m.in_dim), grid.group(m.out_dim)
        x, *saved = ctx.saved_tensors
        overlap = first.overlap.options.input_grad
        regather = first.input_gather == "features" and not first.keep_gathered_input
        if regather:  # in flight while dY is gathered and the dX GEMMs run
            x = comm.all_gather(x, out_group, dim=-1, async_op=overlap)
        if first.reduction != "all_reduce":
            dy = comm.all_gather(dy, in_group, dim=-1)
        if first.keep_weight:
            weights = saved[0] if routed.grouped else saved
        else:
            weights = _weights(layers, saved, routed)
        dx = _gemm(dy, weights, routed, transpose=False)
        del weights  # (before the weight gradients, as large)
        if first.input_gather == "none":
            pending = comm.all_reduce(dx, out_group, async_op=overlap)
        else:
            pending = comm.reduce_scatter(dx, out_group, dim=-1, async_op=overlap)
        if regather and overlap:
            x = x.wait()
        # With overlap on, the dW GEMMs run while the input-gradient collective is in flight.
        dweights = _weight_grads(dy, x, routed)
        dshards = [layer.overlap.weight_grad(layer.weight, layer.matrix.pad(dw)) for layer, dw in zip(layers, dweights)]
        return pending.wait() if overlap else pending, None, None, *dshards


def experts_linear(x: torch.Tensor, routed: Routed, layers: list[ParallelLinear],
                   expert_of_row: torch.Tensor | None) -> torch.Tensor:
    """The linears `layers` (one an expert, the same plan) on `x` [rows, K_local], rows in expert order;
    `expert_of_row` [rows]: each row's expert, for the biases (None: the layers have none)."""
    first = layers[0]
    if first.input_gather not in ("none", "features") or first.reduction == "scatter_tokens":
        raise ValueError(f"{first.matrix.rows[0].name}: experts run feature-dim collectives only, "
                         f"not {first.input_gather} / {first.reduction}")
    y = _Experts3D.apply(x, routed, tuple(layers), *(layer.weight for layer in layers))
    if first.bias is None:
        return y
    biases = torch.stack([layer.bias for layer in layers])  # [experts, N_local]
    if first.reduction == "scatter_features":
        in_group = first.grid.group(first.matrix.in_dim)
        biases = biases.chunk(in_group.size, dim=-1)[in_group.rank]
    return y + biases[expert_of_row]


def run_experts(experts, rows: torch.Tensor, routed: Routed) -> torch.Tensor:
    """The rank's expert MLPs (`ParallelMLP`s of one plan, in order) on `rows` [rows, hidden_local],
    concatenated in expert order."""
    expert_of_row = None
    if experts[0].up.bias is not None:
        ids = torch.arange(len(experts), device=rows.device)
        expert_of_row = torch.repeat_interleave(ids, torch.diff(routed.offsets, prepend=routed.offsets.new_zeros(1)),
                                                output_size=len(rows))
    ups, downs = [e.up for e in experts], [e.down for e in experts]
    return experts[0].run(rows, lambda t: experts_linear(t, routed, ups, expert_of_row),
                          lambda t: experts_linear(t, routed, downs, expert_of_row))
