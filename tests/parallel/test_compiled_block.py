"""train.compile compiles each block whole (`ParallelBlock.compile_whole`, as torchtitan compiles per
block) where it traces whole (`block.traces_whole`): one graph, no graph break as torch._dynamo counts
them, forward and backward equal to eager. Here with the aot_eager backend (torch's own decompositions
and autograd, no C++ compiler; inductor's numerics are tests/parallel/test_data_parallel.py's, in the
training steps)."""

import pytest
import torch

from fourfold.parallel.context import Documents
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import ParallelBlock, TensorOptions, traces_whole
from fourfold.spec.blockspec import BlockConfig
from fourfold.spec.layout import Layout

LLAMA = BlockConfig(hidden=64, heads=4, kv_heads=2, ffn=128)
GPT2 = BlockConfig(hidden=64, heads=4, kv_heads=4, ffn=128, norm="layer", activation="gelu_tanh", qkv_bias=True,
                   out_bias=True, mlp_bias=True, rope=False)
GEMMA3_GLOBAL = BlockConfig(hidden=64, heads=4, kv_heads=2, head_size=16, ffn=128, norm="rms_plus_one",
                           activation="geglu_tanh", post_norms=True, qk_norm=True)


def _compiled_against_eager(cfg: BlockConfig, selective: bool):
    """(graphs compiled, graph breaks, the largest of max |compiled - eager| / max |eager| over the output and every
    gradient) of one block, float32."""
    from torch._dynamo.utils import counters

    grid = Grid(Layout())
    eager, compiled = (ParallelBlock(grid, cfg, TensorOptions(compile=compile), seed=0, selective_recompute=selective)
                       for compile in (False, True))
    compiled.compile_whole(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    h = torch.randn(2, 16, cfg.hidden, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, block in (("eager", eager), ("compiled", compiled)):
        x = h.clone().requires_grad_()
        y = block(x, torch.arange(16))
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out[name] = [y.detach(), x.grad, *(p.grad for p in block.parameters())]
    error = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(out["eager"], out["compiled"]))
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), error


@pytest.mark.parametrize("cfg", [LLAMA, GPT2, GEMMA3_GLOBAL], ids=["llama", "gpt2", "gemma3"])
@pytest.mark.parametrize("selective", [False, True], ids=["none", "selective"])
def test_a_block_compiles_whole_with_no_graph_break(ranks, cfg, selective):
    graphs, breaks, error = ranks.run(_compiled_against_eager, 1, cfg, selective)[0]
    assert (graphs, breaks) == (1, 0)
    assert error < 1e-5  # float32 rounding of differently fused arithmetic


def test_blocks_with_collectives_or_a_mixture_keep_the_compiled_pieces():
    grid = Grid.__new__(Grid)  # (traces_whole reads the layout's sizes only)
    for sizes, cfg, whole in [(dict(dp=8, pp=2), LLAMA, True), (dict(x=2), LLAMA, False), (dict(cp=2), LLAMA, False),
                              (dict(dp=2), BlockConfig(hidden=64, heads=4, kv_heads=2, ffn=32, experts=4, top_k=2),
                               False),
                              (dict(dp=2), BlockConfig(hidden=64, heads=4, kv_heads=2, ffn=128, window=8), False)]:
        grid.layout = Layout(**sizes)
        assert traces_whole(grid, cfg) is whole, sizes


def _documents_run_eagerly():
    """(graph breaks, the graphs compiled by the last batches, max |compiled - eager|) of a block compiled
    whole given document ids, a new split each batch."""
    from torch._dynamo.utils import counters

    grid = Grid(Layout())
    eager, compiled = (ParallelBlock(grid, LLAMA, TensorOptions(compile=compile), seed=0) for compile in (False, True))
    compiled.compile_whole(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    graphs, error = [], 0.0
    for split in range(3, 9):
        ids = torch.zeros(2, 16, dtype=torch.long)
        ids[:, split:] = 1
        h = torch.randn(2, 16, LLAMA.hidden, generator=torch.Generator().manual_seed(split))
        ys = [block(h, torch.arange(16), Documents(ids)) for block in (eager, compiled)]
        error = max(error, (ys[0] - ys[1]).abs().max().item())
        graphs.append(counters["stats"]["unique_graphs"])
    return sum(counters["graph_break"].values()), graphs[-1] - graphs[1], error


def test_a_block_compiled_whole_runs_documents_eagerly(ranks):
    """Document masks are planned on the host: such a micro-batch runs the block eagerly (its compiled
    pieces), with no graph break and nothing compiled again for the next batch's split."""
    breaks, recompiled, error = ranks.run(_documents_run_eagerly, 1)[0]
    assert (breaks, recompiled) == (0, 0)
    assert error < 1e-5
