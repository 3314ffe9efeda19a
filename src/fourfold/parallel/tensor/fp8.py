"""FP8 GEMMs of the 3D linear (train.fp8: "tensorwise" or "rowwise"), through torchao's float8 training.

Each of a linear's three GEMMs (Y = X W^T, dX = dY W, dW = dY^T X) casts its two operands to float8
as torchao's `Float8Linear` casts them for the same recipe (`Float8LinearConfig.from_recipe_name`:
the dtypes, which operand scales along which dim, power-of-two scales), and multiplies them with
torchao's `Float8TrainingTensor` (`torch._scaled_mm` on GPUs with FP8, emulated in high precision on
CPU). What the grid adds is the scales' reach: a scale is the float8 maximum over the operand's
amax, and where the dims the amax spans are split over ranks, the amax is reduced (MAX) over them,
so every rank casts with the scale one device holding the whole operand would use:

    operand           dims               tensorwise amax over       rowwise amax over
    X (input)         [tokens, K]        K's ranks (the in-dim)     K (per token)
    W^T (weight)      [K, N]             K's and N's ranks          K (per output row), or N for dX
    dY                [tokens, N]        N's ranks (the out-dim)    N (per token), or tokens for dW

Tokens are this rank's own (as torchao under FSDP scales each data-parallel rank's): the ranks that
split a micro-batch's tokens (dp, cp, z) cast with their own scales. A fused matrix (QKV, gate/up)
is one operand, with one tensorwise scale, as Transformer Engine scales a fused layer. The reductions
are one small all-reduce each (a scalar, or a row of scales), counted in the ledger.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fourfold.parallel import comm
from fourfold.parallel.grid import Grid

RECIPES = ("tensorwise", "rowwise")


def gpu_takes_fp8(device: torch.device) -> bool:
    """Whether this GPU's tensor cores take FP8 (compute capability 8.9: Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Float8GEMMs:
    """The float8 form of one `ParallelLinear`'s GEMMs on `grid`: its in-dim splits K, its out-dim N."""

    def __init__(self, recipe: str, grid: Grid, in_dim: str, out_dim: str, emulate: bool):
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        if recipe not in RECIPES:
            raise ValueError(f"fp8 recipe {recipe!r} must be one of {', '.join(RECIPES)}")
        self.config = c = Float8LinearConfig.from_recipe_name(recipe)
        self.mm = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, c.pad_inner_dim)
                                   for g in (c.gemm_config_output, c.gemm_config_grad_input,
                                             c.gemm_config_grad_weight)))
        self.recipe, self.grid, self.in_dim, self.out_dim = recipe, grid, in_dim, out_dim
        if grid.size(in_dim) > 1 and grid.size(out_dim) > 1:
            # the weight's tensorwise amax group, created now, as every rank builds every layer: NCCL's
            # split that creates it is collective, and a pipeline's stages run their first forwards apart
            grid.group((in_dim, out_dim))

    def _cast(self, t: torch.Tensor, cast, role, axis: int, dims: tuple[str | None, str | None]):
        """`t` (2D) as torchao casts it for `cast` (its CastConfig), scaling along `axis` if rowwise;
        `dims`: the grid dim splitting each of t's two dims (None: not split)."""
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        if cast.scaling_type is ScalingType.DISABLED:
            return t
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=axis if rowwise else None)
        spanned = [dims[axis]] if rowwise else list(dims)
        split = tuple(d for d in spanned if d is not None and self.grid.size(d) > 1)
        if split:
            amax = comm.all_reduce(amax, self.grid.group(split), op=dist.ReduceOp.MAX)
        scale = amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, self.mm, role, axis if rowwise else None)

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x W^T, x [..., K] (the GEMM's input, gathered), weight the block [N, K]."""
        from torchao.float8.float8_training_tensor import GemmInputRole

        c, shape = self.config, x.shape
        x2 = self._cast(x.reshape(-1, shape[-1]), c.cast_config_input, GemmInputRole.INPUT, -1, (None, self.in_dim))
        w_t = self._cast(weight.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0, (self.in_dim, self.out_dim))
        return torch.mm(x2, w_t).reshape(*shape[:-1], -1)

    def grad_input(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """dY W, dy [..., N]."""
        from torchao.float8.float8_training_tensor import GemmInputRole

        c, shape = self.config, dy.shape
        d = self._cast(dy.reshape(-1, shape[-1]), c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1,
                       (None, self.out_dim))
        w_t = self._cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1,
                         (self.in_dim, self.out_dim))
        return torch.mm(d, w_t.t()).reshape(*shape[:-1], -1)

    def grad_weight(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dY^T X, [N, K], from dy [..., N] and x [..., K] (this rank's tokens)."""
        from torchao.float8.float8_training_tensor import GemmInputRole

        c = self.config
        d = self._cast(dy.reshape(-1, dy.shape[-1]), c.cast_config_grad_output_for_grad_weight,
                       GemmInputRole.GRAD_OUTPUT, 0, (None, self.out_dim))
        x2 = self._cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0,
                        (None, self.in_dim))
        return torch.mm(d.t(), x2)
