"""Sliding-window attention (Mistral's, Gemma 3's local layers): each query sees the keys less than
`window` positions before it. Ring attention over cp 2 and 4 and the 1-rank banded path equal SDPA
with the whole [s, s] mask (float64, GQA, forward and backward) for windows of one token, shorter
than a cp chunk, longer, and longer than the sequence, alone and with document ids; the ring skips
the blocks no query can see, and where some rank reaches only part of the ring the blocks reached are
fetched instead of passed round it (the bytes sent are the volumes'). GPT-OSS's sinks through the
ring, on one rank too. (tests/models/test_model_families.py: Mistral with a window equals transformers
on the 3D, cp, dp and pp grids; Gemma 3 and GPT-OSS in their own tests.)"""

import pytest
import torch

from fourfold.parallel import comm, context
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import masked_attention
from fourfold.spec.blockspec import BlockConfig
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import ledger_bytes, ring_attention_passes

SEQ = 32
WINDOWS = (1, 3, 4, 9, 17, 40)  # cp4's chunk: 4 tokens; cp2's: 8


def _expected(q, k, v, documents, window, grad):
    at = torch.arange(q.shape[2])
    distance = at[:, None] - at[None, :]
    mask = ((distance >= 0) & (distance < window))[None]
    if documents is not None:
        mask = mask & (documents[:, :, None] == documents[:, None, :])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    out.backward(grad)
    return out.detach()


def _windows(cp: int):
    """(largest error of the ring's and the banded path's output, dQ, dK, dV, {(window, documents):
    ring steps skipped on this rank}, {window: (bytes this rank sent, the volumes' bytes)})."""
    grid = Grid(Layout(cp=cp))
    group = grid.group("cp")
    g = torch.Generator().manual_seed(3)
    errors, skipped, sent = [], {}, {}
    for window in WINDOWS:
        for documents in (None, (torch.arange(SEQ) // 5)[None].expand(2, -1)):
            q = torch.randn(2, 4, SEQ, 8, generator=g, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(2, 2, SEQ, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
            grad = torch.randn(2, 4, SEQ, 8, generator=g, dtype=torch.float64)
            expected = _expected(q, k, v, documents, window, grad)
            local = [context.shard_sequence(t.detach(), group, dim=2).requires_grad_() for t in (q, k, v)]
            mine = None if documents is None else context.shard_sequence(documents, group)
            grid.ledger.reset()
            out = context.ring_attention(*local, group, mine, window)
            out.backward(context.shard_sequence(grad, group, dim=2))
            if documents is None:
                block = BlockConfig(32, 4, 2, 8, head_size=8, window=window)
                sizes = dict(dp=1, pp=1, cp=cp, x=1, y=1, z=1)
                volumes = ledger_bytes(ring_attention_passes(block, sizes, 2, SEQ // cp, cp_rank=group.rank).all(),
                                       sizes, 8)
                sent[window] = (grid.ledger.bytes().get(("cp", "send"), 0), volumes.get(("cp", "send"), 0))
            errors.append((out - context.shard_sequence(expected, group, 2)).abs().max().item())
            errors += [(t.grad - context.shard_sequence(full.grad, group, 2)).abs().max().item()
                       for t, full in zip(local, (q, k, v))]
            banded = [t.detach().requires_grad_() for t in (q, k, v)]
            out = masked_attention(*banded, documents, window, enable_gqa=True)
            out.backward(grad)
            errors.append((out - expected).abs().max().item())
            errors += [(t.grad - full.grad).abs().max().item() for t, full in zip(banded, (q, k, v))]
            if window < SEQ:
                plan = context.Documents(mine).ring(group, SEQ // cp, window, q.device)
                skipped[window, documents is not None] = plan.count(None)
    return max(errors), skipped, sent


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_with_a_sliding_window(ranks, cp):
    results = ranks.run(_windows, cp, cp)
    assert max(r[0] for r in results) < 1e-12
    # the bytes each rank sent are the volumes' (a window within a chunk on cp4: the blocks it reaches
    # fetched, not the whole ring's), and fewer than causal attention's ring (the longest window's)
    for r in results:
        assert all(mine == expected for mine, expected in r[2].values()), r[2]
    ring = sum(r[2][40][0] for r in results)
    fetched = sum(r[2][3][0] for r in results)
    assert (fetched < ring / 2) if cp == 4 else fetched == ring, (fetched, ring)
    skipped = {key: sum(r[1][key] for r in results) for key in results[0][1]}
    chunk = SEQ // (2 * cp)
    # a window of one token: each query sees itself only, every other block is skipped; one within a
    # chunk: a query sees its own chunk and the one before it, so of a rank's cp - 1 other blocks only
    # those holding a chunk just before one of its own are attended
    needed = sum(len({j for j in range(cp) if j != i and {j, 2 * cp - 1 - j} & {i - 1, 2 * cp - 2 - i}})
                 for i in range(cp))
    assert skipped[1, False] == skipped[1, True] == cp * (cp - 1), skipped
    for window in WINDOWS:
        if 1 < window <= chunk:
            assert skipped[window, False] == cp * (cp - 1) - needed, (window, skipped)
        if window < SEQ:
            assert skipped[window, True] >= skipped[window, False]
    shorter = [skipped[w, False] for w in WINDOWS if w < SEQ]
    assert shorter == sorted(shorter, reverse=True), shorter  # a longer window skips no more


def _sink_reference(q, k, v, documents, window, sinks, grad):
    """GPT-OSS's eager attention (transformers' eager_attention_forward): the sink a last column of
    every row's softmax, dropped after it."""
    at = torch.arange(q.shape[2])
    distance = at[:, None] - at[None, :]
    mask = ((distance >= 0) & (distance < (window or q.shape[2])))[None]
    if documents is not None:
        mask = mask & (documents[:, :, None] == documents[:, None, :])
    kk, vv = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ kk.transpose(2, 3) / q.shape[-1] ** 0.5).masked_fill(~mask[:, None], float("-inf"))
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    out = torch.softmax(logits, dim=-1)[..., :-1] @ vv
    out.backward(grad)
    return out.detach()


def _sinks(cp: int):
    """Largest error of the output and of dQ, dK, dV and d(sinks) (summed over the cp ranks) against
    the reference, over windows and documents."""
    group = Grid(Layout(cp=cp)).group("cp")
    g = torch.Generator().manual_seed(5)
    errors = []
    for window, documents in ((0, None), (3, None), (9, (torch.arange(SEQ) // 5)[None].expand(2, -1))):
        q = torch.randn(2, 4, SEQ, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, 2, SEQ, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
        sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(2, 4, SEQ, 8, generator=g, dtype=torch.float64)
        expected = _sink_reference(q, k, v, documents, window, sinks, grad)
        local = [context.shard_sequence(t.detach(), group, dim=2).requires_grad_() for t in (q, k, v)]
        mine = sinks.detach().clone().requires_grad_()
        ids = None if documents is None else context.shard_sequence(documents, group)
        out = context.ring_attention(*local, group, ids, window, sinks=mine)
        out.backward(context.shard_sequence(grad, group, dim=2))
        errors.append((out - context.shard_sequence(expected, group, 2)).abs().max().item())
        errors += [(t.grad - context.shard_sequence(full.grad, group, 2)).abs().max().item()
                   for t, full in zip(local, (q, k, v))]
        errors.append((comm.all_reduce(mine.grad, group) - sinks.grad).abs().max().item())
    return max(errors)


@pytest.mark.parametrize("cp", [1, 4])
def test_attention_sinks(ranks, cp):
    """GPT-OSS's sinks through the ring (on one rank, its own block), with windows and documents,
    forward and backward (the sinks' gradient included), against transformers' eager formula."""
    assert max(ranks.run(_sinks, cp, cp)) < 1e-12
