"""Vocabulary-parallel embedding, LM head and cross-entropy against the serial ones (float64)."""

import pytest
import torch
import torch.nn.functional as F

from fourfold.parallel import comm
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.params import full_weights, layouts, load_full
from fourfold.parallel.tensor.regions import all_gather
from fourfold.parallel.tensor.vocab import LMHead, ParallelEmbedding, vocab_parallel_cross_entropy
from fourfold.spec.layout import Layout
from fourfold.spec.rules import padded_vocab
from serial_reference import sum_replicated_grads

VOCAB, HIDDEN, SEQ = 40, 24, 8
GRIDS = [dict(x=1), dict(y=2), dict(x=2, y=2), dict(y=4, z=2), dict(x=2, y=2, z=2), dict(x=2, z=4), dict(y=8),
         dict(dp=2, y=2, z=2)]


def _check_lm(sizes, tied, seq_parallel, vocab=VOCAB):
    layout = Layout(**sizes)
    grid = Grid(layout)
    g = torch.Generator().manual_seed(0)
    batch = 2 * layout.dp * layout.z
    ids = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
    table = torch.randn(vocab, HIDDEN, generator=g, dtype=torch.float64)
    serial_head = torch.randn(vocab, HIDDEN, generator=g, dtype=torch.float64)
    mix = torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5  # so hidden features interact
    # serial: embed, a fixed feature mix, head, mean cross-entropy over every token
    t = table.clone().requires_grad_()
    hd = t if tied else serial_head.clone().requires_grad_()
    logits = (F.embedding(ids[:, :-1], t) @ mix) @ hd.T
    loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    # parallel
    c = grid.coords
    opts = dict(seed=0, std=0.02, dtype=torch.float64)
    embed = ParallelEmbedding(grid, vocab, HIDDEN, seq_parallel=seq_parallel, **opts)
    head = LMHead(grid, HIDDEN, vocab, input_gather="tokens" if seq_parallel else "none", **opts)
    if tied:
        head.weight = embed.weight
    modules = torch.nn.ModuleList([embed, head])
    load_full(modules, {"embed": table, "lm_head": table if tied else serial_head})
    local_ids = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
    h = _mix(embed(local_ids[:, :-1]), mix, grid)
    logits = head(h)
    per_token = vocab_parallel_cross_entropy(logits, local_ids[:, 1:], grid)
    # (before backward, which writes the logits' gradient over them)
    rows = padded_vocab(vocab, layout.y) // layout.y
    assert logits.shape == (1, local_ids[:, 1:].numel() // layout.x, rows)  # 1/(x*y) of the (padded) logits
    real = max(0, min(rows, vocab - c["y"] * rows))  # this y rank's columns of real tokens
    assert logits[..., :real].isfinite().all() and (logits[..., real:] == float("-inf")).all()
    local_loss = per_token.sum() / (batch * SEQ)
    local_loss.backward()
    total = comm.all_reduce(local_loss.detach().clone(), grid.group(("dp", "z")))
    sum_replicated_grads(modules, grid)
    for p in modules.parameters():
        comm.all_reduce(p.grad, grid.group("dp"))
    grads = full_weights(modules, grads=True)
    assert abs(total.item() - loss.item()) < 1e-12 * loss.item()
    assert (grads["embed"] - t.grad).abs().max() < 1e-10 * t.grad.abs().max()
    if not tied:
        assert (grads["lm_head"] - hd.grad).abs().max() < 1e-10 * hd.grad.abs().max()
    assert per_token.shape == local_ids[:, 1:].shape  # every token's loss on every rank
    for p, param_layout in layouts(modules).items():  # padding (vocabulary and z) is zero and stays zero
        padding = torch.ones(p.numel(), dtype=torch.bool)
        for piece in param_layout.pieces:
            padding[piece.local_start : piece.local_start + piece.flat[1] - piece.flat[0]] = False
        assert not p.detach()[padding].any() and not p.grad[padding].any()
    return True


def _mix(h, mix, grid):
    """Stands for the blocks: h [.., H/x] -> (h @ mix)[.., H/x], features gathered over x."""
    x = grid.group("x")
    full = all_gather(h, x, dim=-1) @ mix
    return full.chunk(x.size, -1)[x.rank]


@pytest.mark.parametrize("seq_parallel", [False, True], ids=["", "sp"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sizes", GRIDS, ids=lambda s: ",".join(f"{k}{v}" for k, v in s.items()))
def test_embedding_head_and_loss_match_serial(ranks, sizes, tied, seq_parallel):
    n = Layout(**sizes).world_size
    assert ranks.run(_check_lm, n, sizes, tied, seq_parallel) == [True] * n


ODD_GRIDS = [dict(y=2), dict(x=2, y=2, z=2), dict(dp=2, y=2, z=2), dict(y=4, z=2), dict(y=8)]


@pytest.mark.parametrize("tied, seq_parallel", [(False, False), (True, True)], ids=["untied", "tied,sp"])
@pytest.mark.parametrize("sizes", ODD_GRIDS, ids=lambda s: ",".join(f"{k}{v}" for k, v in s.items()))
def test_a_vocabulary_that_y_does_not_divide_is_padded(ranks, sizes, tied, seq_parallel):
    """61 (prime) rows padded to a multiple of y: the padded logits are -inf, the padded rows zero
    with zero gradients, and loss and gradients are the serial model's."""
    n = Layout(**sizes).world_size
    assert ranks.run(_check_lm, n, sizes, tied, seq_parallel, 61) == [True] * n


def test_a_y_rank_holding_only_padding(ranks):
    """5 rows on y=4: padded to 8, the last y rank holds two padded rows and no real one."""
    assert ranks.run(_check_lm, 4, dict(y=4), True, False, 5) == [True] * 4


def test_padded_vocab():
    assert [padded_vocab(50257, y) for y in (1, 2, 4, 8)] == [50257, 50258, 50260, 50264]
    assert padded_vocab(128, 8) == 128
