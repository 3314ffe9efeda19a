"""A rank's experts as one grouped GEMM (`torch._grouped_mm`, `parallel.tensor.experts`) against their
loop, the float64 reference path (exact against transformers in tests/models/test_moe.py): the same
model, float32, on the mixture's grids. Tolerance: float32 rounding of a different summation order
inside the GEMMs, 1e-5 relative (measured: about 1e-6)."""

import dataclasses

import pytest
import torch

from fourfold.models.config import load_config
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.experts import grouped_gemm_runs
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout

MOE = dataclasses.replace(load_config("mixtral-8x7b"), hidden=32, layers=2, heads=4, kv_heads=2, ffn=16, vocab=64,
                          max_positions=64, experts=4, top_k=2)


def _grads(cfg, sizes: dict, options: dict, grouped: bool) -> tuple[float, dict, list[bool]]:
    """(loss, every local gradient, whether each layer's experts ran grouped) of one forward and backward."""
    layout = Layout(**sizes)
    grid = Grid(layout)
    opts = TensorOptions(dtype=torch.float32, **options)
    model = Transformer(grid, cfg, opts, seed=3)
    for layer in model.layers.values():
        layer.mlp.grouped_gemm = grouped
    ids = torch.randint(0, cfg.vocab, (4, 17), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(layout.dp)[grid.coords["dp"]].chunk(layout.z)[grid.coords["z"]]
    loss = model(local[:, :-1], local[:, 1:]).sum() / 64 + model.router_loss()
    loss.backward()
    ran = [layer.mlp._routed.grouped for layer in model.layers.values()]
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, ran


def _both(cfg, sizes, options):
    return _grads(cfg, sizes, options, True), _grads(cfg, sizes, options, False)


GRIDS = [
    (dict(), {}),
    (dict(x=2, y=2), dict(seq_parallel=True)),  # the gate/up reduce-scattered, the down's input gathered, over x
    (dict(x=2, y=2), dict(seq_parallel=False, keep_weights=True)),
    (dict(dp=2, z=2), {}),  # each expert's weight gathered over z into the stack
    (dict(dp=4, x=2, ep=2), {}),  # the rows exchanged, two experts a rank
]


@pytest.mark.parametrize("sizes, options", GRIDS, ids=[f"{s}-{o}" for s, o in GRIDS])
def test_grouped_experts_equal_their_loop(ranks, sizes, options):
    world = Layout(**sizes).world_size
    for (loss, grads, ran), (ref_loss, ref_grads, ref_ran) in ranks.run(_both, world, MOE, sizes, options):
        assert all(ran) and not any(ref_ran)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_grouped_gemm_runs_where_its_kernel_does():
    """bf16 anywhere, float32 on CPU; never float64 (the loop); features 16-byte aligned."""
    assert grouped_gemm_runs(torch.zeros(2, 8, dtype=torch.bfloat16), 8, 16)
    assert grouped_gemm_runs(torch.zeros(2, 8), 8, 16)
    assert not grouped_gemm_runs(torch.zeros(2, 8, dtype=torch.float64), 8, 16)
    assert not grouped_gemm_runs(torch.zeros(2, 6, dtype=torch.bfloat16), 6, 16)  # 12 bytes a row
