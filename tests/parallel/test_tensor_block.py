"""3D-parallel block against the serial block in float64: every (x, y, z) with x*y*z <= 8."""

import itertools

import pytest
import torch

import serial_reference as ref
from fourfold.parallel import comm
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import ParallelBlock, TensorOptions
from fourfold.parallel.tensor.params import full_weights, load_full
from fourfold.spec.blockspec import BlockConfig
from fourfold.spec.layout import GridError, Layout
from fourfold.spec.volumes import block_collectives, ledger_bytes
from serial_reference import sum_replicated_grads

TOL = 1e-10
SEQ = 24  # divisible by every y up to 8 that the configs allow
LLAMA_MHA = BlockConfig(hidden=48, heads=12, kv_heads=12, ffn=96)
LLAMA_GQA = BlockConfig(hidden=48, heads=12, kv_heads=4, ffn=96)
GPT_MHA = BlockConfig(hidden=48, heads=12, kv_heads=12, ffn=192, norm="layer", activation="gelu_tanh", qkv_bias=True,
                      out_bias=True, mlp_bias=True, rope=False)
GPT_GQA = BlockConfig(hidden=48, heads=12, kv_heads=4, ffn=192, norm="layer", activation="gelu", qkv_bias=True,
                     out_bias=True, mlp_bias=True)
CONFIGS = [LLAMA_MHA, LLAMA_GQA, GPT_MHA, GPT_GQA]

GRIDS = [(x, y, z) for x, y, z in itertools.product(range(1, 9), repeat=3) if x * y * z <= 8]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _local(t, grid, seq_parallel, batch_dim=0):
    """This rank's slice of a full [batch, seq, hidden] activation."""
    c, L = grid.coords, grid.layout
    t = t.chunk(L.dp, 0)[c["dp"]].chunk(L.z, 0)[c["z"]]
    if seq_parallel:  # the y rank's share of the tokens, flattened in order (regions.own_tokens)
        t = t.reshape(1, -1, t.shape[-1]).chunk(L.y, 1)[c["y"]].view(t.shape[0], -1, t.shape[-1])
    return t.chunk(L.x, -1)[c["x"]]


def _allowed(cfg, x, y):
    return cfg.hidden % x == 0 and cfg.heads % y == 0 and cfg.kv_heads % y == 0 and cfg.ffn % y == 0 and SEQ % y == 0


def _check_block(sizes: dict):
    """For every config and option: output, input gradient, parameter gradients and the ledger."""
    layout = Layout(**sizes)
    grid = Grid(layout)
    batch = 2 * layout.dp * layout.z
    report = []
    # (sequence parallel, non-redundant attention/MLP): fourfold's paths and the published one;
    # the non-redundant path without sequence parallelism keeps its gathered inputs (features),
    # with it they are gathered again in backward (tokens and features)
    paths = [(False, True), (True, True), (False, False)]
    for cfg, (seq_parallel, non_redundant) in itertools.product(CONFIGS, paths):
        keep_inputs = non_redundant and not seq_parallel
        opts = TensorOptions(seq_parallel=seq_parallel, keep_weights=seq_parallel, non_redundant=non_redundant,
                             keep_gathered_inputs=keep_inputs, dtype=torch.float64)
        if not _allowed(cfg, layout.x, layout.y):
            with pytest.raises(GridError):
                ParallelBlock(grid, cfg, opts, seed=0)
            continue
        weights = ref.random_block_weights(cfg, seed=1)
        g = torch.Generator().manual_seed(2)
        h = torch.randn(batch, SEQ, cfg.hidden, generator=g, dtype=torch.float64)
        upstream = torch.randn(batch, SEQ, cfg.hidden, generator=g, dtype=torch.float64)
        # serial
        serial_w = {k: v.clone().requires_grad_() for k, v in weights.items()}
        h_serial = h.clone().requires_grad_()
        out_serial = ref.block(h_serial, serial_w, cfg)
        (out_serial * upstream).sum().backward()
        # parallel
        block = ParallelBlock(grid, cfg, opts, seed=0)
        load_full(block, weights)
        grid.ledger.reset()
        h_local = _local(h, grid, seq_parallel).clone().requires_grad_()
        out = block(h_local, torch.arange(SEQ))
        (out * _local(upstream, grid, seq_parallel)).sum().backward()
        expected = ledger_bytes(
            block_collectives(cfg, layout.sizes, batch // (layout.dp * layout.z), SEQ, seq_parallel=seq_parallel,
                              keep_weights=seq_parallel, keep_inputs=keep_inputs, non_redundant=non_redundant),
            layout.sizes, 8)
        assert grid.ledger.bytes() == expected, (cfg, seq_parallel, grid.ledger.bytes(), expected)
        sum_replicated_grads(block, grid)
        for p in block.parameters():
            comm.all_reduce(p.grad, grid.group("dp"))
        errors = {"out": rel_err(out, _local(out_serial, grid, seq_parallel)),
                  "dx": rel_err(h_local.grad, _local(h_serial.grad, grid, seq_parallel))}
        grads = full_weights(block, grads=True)
        assert grads.keys() == weights.keys()
        # Without RoPE the key bias's gradient is zero in exact arithmetic (softmax ignores a
        # constant added to every score): both sides are rounding noise, checked against a scale.
        zero_grad = set() if cfg.rope or not cfg.qkv_bias else {"block.attn.k.bias"}
        errors.update({name: rel_err(grads[name], serial_w[name].grad) for name in weights if name not in zero_grad})
        for name in zero_grad:
            scale = serial_w["block.attn.q.bias"].grad.abs().max()
            assert grads[name].abs().max() < TOL * scale and serial_w[name].grad.abs().max() < TOL * scale
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOL, (cfg, seq_parallel, worst, errors[worst])
        report.append((cfg.kv_heads, cfg.norm, seq_parallel, block.attn.own_heads, errors[worst]))
    return report


@pytest.mark.parametrize("x,y,z", GRIDS, ids=[f"x{x}y{y}z{z}" for x, y, z in GRIDS])
def test_block_matches_serial(ranks, x, y, z):
    ranks.run(_check_block, x * y * z, dict(x=x, y=y, z=z))


def test_both_attention_paths_are_exercised(ranks):
    # (kv_heads, norm, seq_parallel, own_heads, worst error) per variant, from rank 0
    own = {r[3] for r in ranks.run(_check_block, 4, dict(x=2, y=2))[0]}
    fallback = {r[3] for r in ranks.run(_check_block, 8, dict(x=2, y=4))[0]}
    assert own == {True, False} and fallback == {False}  # x2y2 runs the published path on request


DP_GRIDS = [(x, y, z) for x, y, z in GRIDS if x * y * z <= 4]


@pytest.mark.parametrize("x,y,z", DP_GRIDS, ids=[f"dp2x{x}y{y}z{z}" for x, y, z in DP_GRIDS])
def test_block_with_data_parallel_matches_serial(ranks, x, y, z):
    ranks.run(_check_block, 2 * x * y * z, dict(dp=2, x=x, y=y, z=z))


def _init_matches_serial(sizes):
    grid = Grid(Layout(**sizes))
    cfg = LLAMA_GQA
    block = ParallelBlock(grid, cfg, TensorOptions(dtype=torch.float64), seed=7, std=0.02, out_std=0.01)
    from fourfold.parallel.tensor.init import normal

    for name, value in full_weights(block).items():
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value))
            continue
        std = 0.01 if name.endswith((".o", ".down")) else 0.02
        expected = normal(7, name, torch.arange(value.numel()), std, torch.float64).view(value.shape)
        assert torch.equal(value, expected), name
    return True


@pytest.mark.parametrize("sizes", [dict(x=2, y=2, z=2), dict(x=4, z=2), dict(y=4, z=2), dict(z=8), dict(x=2, y=4)])
def test_initialisation_is_the_serial_models_on_any_grid(ranks, sizes):
    assert all(ranks.run(_init_matches_serial, Layout(**sizes).world_size, sizes))
