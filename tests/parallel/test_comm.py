"""Each collective's values and ledger bytes on groups of 1, 2 and 4 ranks, blocking and async."""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from fourfold.parallel import comm
from fourfold.parallel.grid import Grid
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import bytes_sent


def _data(rank: int, shape=(4, 6)) -> torch.Tensor:
    """A tensor only `rank` has, different in every element."""
    n = torch.tensor(shape).prod().item()
    return (torch.arange(n, dtype=torch.float64) + 100 * rank).reshape(shape) / 7


def _finish(result, async_op):
    return result.wait() if async_op else result


def _check_ops(g: int, async_op: bool):
    grid = Grid(Layout(x=g, dp=8 // g))
    group = grid.group("x")
    members = group.ranks
    me = _data(grid.rank)
    expected_bytes: dict = {}

    def expect(op, message_numel):
        if g > 1:
            key = ("x", op)
            expected_bytes[key] = expected_bytes.get(key, 0) + bytes_sent(op, g, message_numel * 8)

    # all-gather along dim 0 and dim 1
    for dim in (0, 1):
        out = _finish(comm.all_gather(me, group, dim=dim, async_op=async_op), async_op)
        assert torch.equal(out, torch.cat([_data(r) for r in members], dim=dim))
        assert out.is_contiguous()  # fused attention kernels need unit stride on the last dim
        expect("all_gather", out.numel())

    # reduce-scatter along dim 0 and dim 1: the sum over ranks, this rank's slice
    for dim in (0, 1):
        full = _data(grid.rank, shape=(4 * g, 6) if dim == 0 else (4, 6 * g))
        total = sum(_data(r, shape=full.shape) for r in members)
        out = _finish(comm.reduce_scatter(full, group, dim=dim, async_op=async_op), async_op)
        torch.testing.assert_close(out, total.chunk(g, dim=dim)[group.rank], rtol=1e-15, atol=0)
        assert out.is_contiguous()
        expect("reduce_scatter", full.numel())

    # reduce-scatter in place: this rank's slice of the input is the output
    full = _data(grid.rank, shape=(4 * g, 6))
    total = sum(_data(r, shape=full.shape) for r in members)
    mine = full[4 * group.rank : 4 * (group.rank + 1)]
    out = _finish(comm.reduce_scatter(full, group, async_op=async_op, out=mine), async_op)
    assert g == 1 or out.data_ptr() == mine.data_ptr()
    torch.testing.assert_close(mine if g > 1 else out, total.chunk(g)[group.rank], rtol=1e-15, atol=0)
    expect("reduce_scatter", full.numel())

    # all-reduce in place, sum and max
    t = me.clone()
    out = _finish(comm.all_reduce(t, group, async_op=async_op), async_op)
    assert out is t
    torch.testing.assert_close(t, sum(_data(r) for r in members), rtol=1e-15, atol=0)
    t = me.clone()
    _finish(comm.all_reduce(t, group, op=dist.ReduceOp.MAX, async_op=async_op), async_op)
    assert torch.equal(t, _data(max(members)))
    expect("all_reduce", 2 * me.numel())

    # all-to-all: chunk j goes to group rank j
    send = _data(grid.rank, shape=(2 * g, 3))
    out = _finish(comm.all_to_all(send, group, async_op=async_op), async_op)
    assert torch.equal(out, torch.cat([_data(r, shape=(2 * g, 3)).chunk(g)[group.rank] for r in members]))
    expect("all_to_all", send.numel())

    # batched P2P around the ring, and blocking send/recv to the right neighbour
    right, left = (group.rank + 1) % g, (group.rank - 1) % g
    if g > 1:
        received = torch.empty_like(me)
        transfers = [comm.P2P("send", me, right), comm.P2P("recv", received, left)]
        out = _finish(comm.batch_p2p(transfers, group, async_op=async_op), async_op)
        assert out[0] is received and torch.equal(received, _data(members[left]))
        expected_bytes[("x", "send")] = Fraction(me.numel() * 8)
        got = torch.empty_like(me)
        if group.rank % 2 == 0:
            comm.send(me, right, group)
            comm.recv(got, left, group)
        else:
            comm.recv(got, left, group)
            comm.send(me, right, group)
        assert torch.equal(got, _data(members[left]))
        expected_bytes[("x", "send")] += me.numel() * 8

    assert grid.ledger.bytes() == expected_bytes
    grid.ledger.reset()
    assert grid.ledger.bytes() == {} and grid.ledger.total() == 0
    return True


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_collectives_values_and_ledger(ranks, g, async_op):
    assert ranks.run(_check_ops, 8, g, async_op) == [True] * 8


def _ledger_table():
    grid = Grid(Layout(x=2, dp=2))
    comm.all_reduce(torch.ones(2**18, dtype=torch.float32), grid.group("dp"))
    comm.all_gather(torch.ones(2**18, dtype=torch.float32), grid.group(("dp", "x")))
    return grid.ledger.table(), grid.ledger.calls()


def test_ledger_table_and_calls(ranks):
    table, calls = ranks.run(_ledger_table, 4)[0]
    assert calls == {("dp", "all_reduce"): 1, ("x_dp", "all_gather"): 1}
    # all-reduce of 1 MiB on 2 ranks sends 2*(1/2)*1 MiB; all-gather of 4 MiB on 4 ranks sends 3 MiB
    assert "dp       all_reduce           1       1.0000" in table
    assert "x_dp     all_gather           1       3.0000" in table
    assert table.splitlines()[-1].split() == ["total", "2", "4.0000"]


def test_ring_volumes():
    assert bytes_sent("all_gather", 4, 400) == 300
    assert bytes_sent("reduce_scatter", 8, 800) == 700
    assert bytes_sent("all_reduce", 4, 400) == 600
    assert bytes_sent("all_reduce", 3, 10) == Fraction(40, 3)
    assert bytes_sent("all_to_all", 2, 10) == 5
    assert bytes_sent("send", 5, 10) == 10
    assert bytes_sent("all_gather", 1, 10) == 0
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        bytes_sent("broadcast", 2, 10)


def _indivisible():
    grid = Grid(Layout(x=2))
    with pytest.raises(ValueError, match="reduce_scatter over x: dim 0 of size 3 is not divisible by 2"):
        comm.reduce_scatter(torch.ones(3), grid.group("x"))
    with pytest.raises(ValueError, match=r"P2P send to itself \(group rank \d of x\)"):
        comm.batch_p2p([comm.P2P("send", torch.ones(1), grid.group("x").rank)], grid.group("x"))
    return True


def test_indivisible_reduce_scatter_is_refused(ranks):
    assert ranks.run(_indivisible, 2) == [True, True]
