"""train.fp8: a 3D-parallel linear's float8 GEMMs (`parallel.tensor.fp8`) against torchao's own
`Float8Linear` on one device, the same weight and input, emulated on CPU. The scales are reduced over
the ranks that split each operand, so every cast is torchao's: the output, the input gradient and
the weight gradient agree to float32 rounding (the K split's partial sums are added in another order),
where a scale from this rank's part alone would differ at float8's rounding (about 1e-2)."""

import dataclasses

import pytest
import torch

from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.linear import ParallelLinear
from fourfold.spec.blockspec import LINEAR_KINDS, RowSource
from fourfold.spec.layout import Layout

torchao = pytest.importorskip("torchao")

K, N = 32, 64


def _chunk(t: torch.Tensor, grid: Grid, dim: str) -> torch.Tensor:
    return t.chunk(grid.size(dim), dim=-1)[grid.coords[dim]]


def _against_torchao(sizes: dict, kind: str, recipe: str, reduction: str, input_gather: str) -> float:
    """The largest relative difference of output, input gradient and weight gradient from torchao's."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    grid = Grid(Layout(**sizes))
    in_dim, out_dim = LINEAR_KINDS[kind]
    layer = ParallelLinear(grid, K, [RowSource("w", 0, N)], kind, seed=0, std=0.5, reduction=reduction,
                           input_gather=input_gather, fp8=recipe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, K, generator=g) * torch.linspace(0.1, 3, K)  # (columns of different ranges)
    dy = torch.randn(2, 8, N, generator=g)
    local = _chunk(x, grid, in_dim)
    if input_gather == "features":
        local = local.chunk(grid.size(out_dim), dim=-1)[grid.coords[out_dim]]
    local.requires_grad_()
    y = layer(local)
    local_dy = _chunk(dy, grid, out_dim)
    if reduction == "scatter_features":
        local_dy = local_dy.chunk(grid.size(in_dim), dim=-1)[grid.coords[in_dim]]
    y.backward(local_dy)

    reference = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False))
    with torch.no_grad():
        reference[0].weight.copy_(layer.full_weights(lambda p: p)["w"])
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(reference, config=config)
    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(dy)

    want_y = _chunk(y_ref.detach(), grid, out_dim)
    if reduction == "scatter_features":
        want_y = want_y.chunk(grid.size(in_dim), dim=-1)[grid.coords[in_dim]]
    want_dx = _chunk(x_ref.grad, grid, in_dim)
    if input_gather == "features":
        want_dx = want_dx.chunk(grid.size(out_dim), dim=-1)[grid.coords[out_dim]]
    dw = layer.full_weights(lambda p: p.grad)["w"]
    pairs = [(y.detach(), want_y), (local.grad, want_dx), (dw, reference[0].weight.grad)]
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)


GRIDS = [dict(), dict(x=2), dict(y=2), dict(x=2, y=2)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sizes", GRIDS, ids=["1", "x2", "y2", "x2y2"])
@pytest.mark.parametrize("kind, reduction, input_gather", [
    ("x-in", "all_reduce", "none"),  # the published path's
    ("x-in", "scatter_features", "none"),  # the non-redundant path's gate/up: output features reduce-scattered
    ("y-in", "all_reduce", "features"),  # and its down projection: input features gathered first
])
def test_fp8_linear_equals_torchaos_on_one_device(ranks, sizes, recipe, kind, reduction, input_gather):
    world = Layout(**sizes).world_size
    errors = ranks.run(_against_torchao, world, sizes, kind, recipe, reduction, input_gather)
    assert max(errors) < 1e-5, errors


def _scales_against_torchao(sizes: dict, recipe: str) -> list[bool]:
    """For each cast of the three GEMMs: whether this rank's scale is torchao's from the whole operand
    (float8's scales are powers of two under rowwise, where only range, not rounding, shows an error,
    so the scales themselves are compared). Operands span 2^-20 to 1 across their rows and columns."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import GemmInputRole
    from torchao.float8.float8_utils import tensor_to_scale

    grid = Grid(Layout(**sizes))
    layer = ParallelLinear(grid, K, [RowSource("w", 0, N)], "x-in", seed=0, std=0.5, fp8=recipe)
    fp8, c = layer.fp8, layer.fp8.config
    g = torch.Generator().manual_seed(2)
    tokens = 16
    spread = lambda rows, cols: (torch.randn(rows, cols, generator=g) * torch.logspace(-6, 0, cols)  # noqa: E731
                                 * torch.logspace(0, -6, rows)[:, None])
    operands = [  # (full tensor, its dims' grid dims, cast, axis)
        (spread(tokens, K), (None, "x"), c.cast_config_input, -1),
        (spread(K, N), ("x", "y"), c.cast_config_weight, 0),
        (spread(tokens, N), (None, "y"), c.cast_config_grad_output, -1),
        (spread(K, N), ("x", "y"), c.cast_config_weight_for_grad_input, -1),
        (spread(tokens, N), (None, "y"), c.cast_config_grad_output_for_grad_weight, 0),
        (spread(tokens, K), (None, "x"), c.cast_config_input_for_grad_weight, 0),
    ]
    same = []
    for full, dims, cast, axis in operands:
        local = full
        for i, d in enumerate(dims):
            if d is not None:
                local = local.chunk(grid.size(d), dim=i)[grid.coords[d]]
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        mine = fp8._cast(local, cast, GemmInputRole.INPUT, axis, dims)._scale
        want = tensor_to_scale(full, cast.target_dtype, scaling_granularity=cast.scaling_granularity,
                               axiswise_dim=axis if rowwise else None,
                               round_scales_to_power_of_2=c.round_scales_to_power_of_2)
        if rowwise:  # the scales of this rank's rows (or columns)
            kept = 1 if axis == 0 else 0
            if dims[kept] is not None:
                want = want.chunk(grid.size(dims[kept]), dim=kept)[grid.coords[dims[kept]]]
        same.append(torch.equal(mine, want))
    return same


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_casts_scale_is_torchaos_from_the_whole_operand(ranks, recipe):
    for same in ranks.run(_scales_against_torchao, 4, dict(x=2, y=2), recipe):
        assert all(same), same


def test_training_with_fp8_linears_learns_beside_float32(ranks, tmp_path):
    """`fourfold train --train.fp8` (emulated on CPU): rowwise on x2 y2, and tensorwise on pp2 x2 y2 (its
    weights' amax reduced across x and y): the loss falls, and stays within float8's error of the float32
    losses on x2 y2."""
    from runs import prepared_corpus, step_losses, train_run

    (tmp_path / "data").mkdir()
    data = prepared_corpus(tmp_path / "data", 100_000, 512)
    losses = {}
    for fp8, pp in (("", 1), ("rowwise", 1), ("tensorwise", 2)):
        run = tmp_path / (fp8 or "float32")
        ranks.run(train_run, 4 * pp, [*data, "--log.run_dir", str(run), "--log.progress", "false", "--train.steps",
                                      "8", "--batch.global_batch", "4", "--batch.micro_batch", "2", "--batch.seq",
                                      "64", "--optimizer.warmup", "2", "--grid.x", "2", "--grid.y", "2", "--grid.pp",
                                      str(pp), "--train.fp8", fp8])
        losses[fp8] = list(step_losses(run).values())
    for recipe in ("rowwise", "tensorwise"):
        assert losses[recipe][-1] < losses[recipe][0] - 0.5
        gaps = [abs(a - b) / b for a, b in zip(losses[recipe], losses[""])]
        assert 0 < max(gaps) < 0.02, (recipe, losses)  # (not 0: the GEMMs did run in float8)
