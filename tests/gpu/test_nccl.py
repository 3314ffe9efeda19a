"""Every collective of `fourfold.parallel.comm` on NCCL, and ring attention across GPUs: N processes, one GPU
each, under torchrun (every rank runs the same tests in the same order):

    torchrun --nproc-per-node N -m pytest tests/gpu -m gpu        (N >= 2; 4 or more, even, adds subgroups)

Each rank's tensor holds small integers (exact in bf16, and so are their sums over up to 20 ranks),
so every result is compared for equality with the values it must have. Skipped outside torchrun.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.distributed as dist

from fourfold.parallel import comm, context
from fourfold.parallel.comm import P2P
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.spec.layout import Layout

from .kernel_checks import Shape, compare, plain_bf16, random_inputs, reference

COMMAND = "torchrun --nproc-per-node N -m pytest tests/gpu -m gpu, with N >= 2 GPUs"


def _why_not() -> str | None:
    """Why these tests cannot run in this process (None: they can)."""
    if not torch.cuda.is_available():
        return f"needs CUDA, NCCL and torchrun: {COMMAND}"
    if "RANK" not in os.environ:
        return f"needs torchrun (RANK is not set): {COMMAND}"
    world = int(os.environ["WORLD_SIZE"])
    if world < 2:
        return f"needs 2 or more ranks, torchrun started {world}: {COMMAND}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.device_count() < local:
        return f"needs one GPU per rank: {local} ranks on this node, {torch.cuda.device_count()} GPUs"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
# (grid sizes, dim): the whole world, and with 4+ ranks (even) pairs of neighbours and a strided group
GROUPS = [({"dp": WORLD}, "dp")]
if WORLD >= 4 and WORLD % 2 == 0:
    GROUPS += [({"dp": WORLD // 2, "x": 2}, "x"), ({"dp": WORLD // 2, "x": 2}, "dp")]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def nccl_world():
    init_process_group(timeout_s=120)  # NCCL, this rank's GPU (LOCAL_RANK)
    yield
    dist.barrier()
    dist.destroy_process_group()


@functools.cache
def _grid(sizes: tuple[tuple[str, int], ...]) -> Grid:
    return Grid(Layout(**dict(sizes)))


@pytest.fixture(params=GROUPS, ids=lambda p: f"{p[1]} of {' '.join(f'{d}{n}' for d, n in p[0].items())}")
def grid_group(request):
    sizes, dim = request.param
    grid = _grid(tuple(sizes.items()))
    return grid, grid.group(dim)


def values(rank: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Global rank `rank`'s tensor: element i is i % 3 + rank."""
    return (torch.arange(math.prod(shape), device=device) % 3 + rank).reshape(shape).to(dtype)


def _done(result, async_op: bool):
    return result.wait() if async_op else result


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather(grid_group, dtype, dim, async_op):
    grid, group = grid_group
    mine = values(grid.rank, (3, 5), dtype, grid.device)
    got = _done(comm.all_gather(mine, group, dim=dim, async_op=async_op), async_op)
    expected = torch.cat([values(r, (3, 5), dtype, grid.device) for r in group.ranks], dim)
    assert torch.equal(got, expected)
    assert got.is_contiguous()


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter(grid_group, dtype, dim, async_op):
    grid, group = grid_group
    shape = (2 * group.size, 3) if dim == 0 else (3, 2 * group.size)
    got = _done(comm.reduce_scatter(values(grid.rank, shape, dtype, grid.device), group, dim=dim,
                                    async_op=async_op), async_op)
    total = sum(values(r, shape, dtype, grid.device) for r in group.ranks)
    assert torch.equal(got, total.chunk(group.size, dim)[group.rank])
    assert got.is_contiguous()  # the attention kernels and GEMMs that read it need unit stride


@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_in_place_into_own_slice(grid_group, async_op):
    """GradientSync's ZeRO-1 bucket: the reduced shard is written over this rank's own slice."""
    grid, group = grid_group
    n = 2**20 + 3  # a bucket-sized shard, not a round number
    own = slice(group.rank * n, (group.rank + 1) * n)
    bucket = values(grid.rank, (group.size * n,), torch.float32, grid.device)
    got = _done(comm.reduce_scatter(bucket, group, async_op=async_op, out=bucket[own]), async_op)
    assert got.data_ptr() == bucket[own].data_ptr()
    total = sum(values(r, (group.size * n,), torch.float32, grid.device) for r in group.ranks)
    assert torch.equal(bucket[own], total[own])


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("op", ["SUM", "MAX"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce(grid_group, dtype, op, async_op):
    grid, group = grid_group
    mine = values(grid.rank, (4, 6), dtype, grid.device)
    got = _done(comm.all_reduce(mine, group, op=getattr(dist.ReduceOp, op), async_op=async_op), async_op)
    every = torch.stack([values(r, (4, 6), dtype, grid.device) for r in group.ranks])
    assert got is mine  # in place
    assert torch.equal(got, every.sum(0) if op == "SUM" else every.amax(0))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_to_all(grid_group, dtype, async_op):
    grid, group = grid_group
    shape = (2 * group.size, 3)
    got = _done(comm.all_to_all(values(grid.rank, shape, dtype, grid.device), group, async_op=async_op), async_op)
    expected = torch.cat([values(r, shape, dtype, grid.device).chunk(group.size)[group.rank] for r in group.ranks])
    assert torch.equal(got, expected)


def test_send_recv_in_pairs(grid_group):
    """Blocking send and receive between group ranks 2i and 2i+1 (the lower one sends first)."""
    grid, group = grid_group
    partner = group.rank ^ 1
    if partner >= group.size:
        pytest.skip(f"group rank {group.rank} of an odd group has no partner")
    mine = values(grid.rank, (7,), torch.float32, grid.device)
    received = torch.empty_like(mine)
    if group.rank < partner:
        comm.send(mine, partner, group)
        got = comm.recv(received, partner, group)
    else:
        got = comm.recv(received, partner, group)
        comm.send(mine, partner, group)
    assert got is received
    assert torch.equal(received, values(group.ranks[partner], (7,), torch.float32, grid.device))


@pytest.mark.parametrize("async_op", [False, True])
def test_batch_p2p_round_the_ring(grid_group, async_op):
    """Send to the next group rank and receive from the previous one, in one batch (ring attention's pattern)."""
    grid, group = grid_group
    following, previous = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    mine = values(grid.rank, (5, 3), torch.float32, grid.device)
    received = torch.empty_like(mine)
    got = _done(comm.batch_p2p([P2P("send", mine, following), P2P("recv", received, previous)], group,
                               async_op=async_op), async_op)
    assert len(got) == 1 and got[0] is received
    assert torch.equal(received, values(group.ranks[previous], (5, 3), torch.float32, grid.device))


def test_ring_attention_matches_float32_within_bf16_error():
    """Causal attention over cp = every rank, forward and backward, against the float32 reference of
    the whole sequence cut to this rank's chunks; bounds as in kernel_checks.py."""
    grid = _grid((("cp", WORLD),))
    cp = grid.group("cp")
    shape = Shape(2, 8, 2, 512 * WORLD, 128)  # the sequence divides into 2*cp chunks
    q, k, v, dout = random_inputs(shape, grid.device)  # the same whole sequence on every rank
    shard = functools.partial(context.shard_sequence, cp=cp, dim=2)
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    out = context.ring_attention(q_l, k_l, v_l, cp)
    out.backward(shard(dout))
    got = {"out": out.detach(), "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}
    scale = 1.0 / math.sqrt(shape.head_dim)

    def mine(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: shard(whole[name]) for name in got}

    # Each of the cp blocks' kernels rounds its part to bf16 before the parts are summed, and dK, dV
    # are rounded again at each hop round the ring: up to 2*cp roundings of a result.
    checks = compare(f"ring attention cp={WORLD} {shape} rank {cp.rank}", got,
                     mine(reference(q, k, v, dout, True, scale)), mine(plain_bf16(q, k, v, dout, True, scale)),
                     roundings={name: 2 * cp.size for name in got})
    failed = [f"{c['name']}: error {c['max_error']:.3g} > bound {c['bound']:.3g}" for c in checks if not c["ok"]]
    assert not failed, "\n".join(failed)
