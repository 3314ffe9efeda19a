"""Context parallelism: the sequence split over cp with causal load balancing, and ring attention.

The sequence is cut into 2*cp chunks; cp rank i holds chunks i and 2cp-1-i, so every rank has
the same amount of causal attention work. Ring attention: each rank keeps its queries and passes
its keys and values around the cp ring; every arriving block is attended to while the next one
is in flight, and the partial results are merged with the log-sum-exp (online softmax) rule.
Backward runs the ring again, with each block's dK and dV accumulators travelling alongside it
and returning to their owner at the end.
"""

from __future__ import annotations

import math

import torch

from fourfold.parallel import comm
from fourfold.parallel.comm import P2P, Group


def check_sequence(seq: int, cp: int) -> None:
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} must be divisible by 2*cp = {2 * cp} for load-balanced context "
                         f"parallelism; choose a sequence length that is a multiple of {2 * cp} or a smaller cp")


def shard_sequence(t: torch.Tensor, cp: Group, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks (i and 2cp-1-i) of a full-sequence tensor, concatenated."""
    if cp.size == 1:
        return t
    check_sequence(t.shape[dim], cp.size)
    chunks = t.chunk(2 * cp.size, dim=dim)
    return torch.cat([chunks[cp.rank], chunks[2 * cp.size - 1 - cp.rank]], dim=dim)


def positions(local_seq: int, cp: Group, device=None) -> torch.Tensor:
    """The global positions of this rank's `local_seq` tokens (RoPE and the causal mask use them)."""
    return shard_sequence(torch.arange(local_seq * cp.size, device=device), cp, dim=0)


def check_flash_inputs(q, k, v, lse=None) -> None:
    """What torch's flash kernels assume, checked on every device so that CPU runs go through the
    GPU's contract: q, k, v with unit stride on the last dim (row slices of [b, h, s, d] are
    fine), a contiguous log-sum-exp (the CUDA backward indexes it as (batch*heads + head)*seq +
    row, whatever its strides), and on CUDA bf16 or fp16 only (`rules` refuses cp > 1 in fp32)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise RuntimeError(f"flash attention reads {name} by rows: its last dim needs unit stride, got "
                               f"strides {t.stride()}")
    if lse is not None and not lse.is_contiguous():
        raise RuntimeError(f"the flash backward indexes the log-sum-exp as a contiguous [batch, heads, rows] "
                           f"tensor; got shape {tuple(lse.shape)} with strides {lse.stride()} (make it contiguous)")
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"CUDA's flash attention takes bf16 or fp16, not {q.dtype}; use precision bf16")


def attend_block(q, k, v, causal: bool, scale: float):
    """One block with torch's fused flash kernel: (output in q's dtype, log-sum-exp per query row,
    what the CUDA backward needs). Grouped-query attention is native (k, v have fewer heads)."""
    check_flash_inputs(q, k, v)
    if q.is_cuda:
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def attend_block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, extra):
    """(dq, dk, dv) of one block, given the rows' *final* output and log-sum-exp (the kernel forms
    P = exp(S - lse) and the row sums of dout * out from them, as ring attention needs)."""
    check_flash_inputs(q, k, v, lse)
    if q.is_cuda:
        seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _visible(step: int, cp: Group, seq: int) -> tuple[slice, slice, bool]:
    """(query rows, block keys, causal) of the block arriving at `step`, for cp rank i holding
    chunks i and 2cp-1-i and the block of rank j holding chunks j and 2cp-1-j. j == i: causal
    within (local positions increase, so it is the plain lower triangle); j < i: chunk j precedes
    both of ours and chunk 2cp-1-j follows both, so all our queries see the block's first half
    only; j > i: both its chunks follow our first and precede our second, so only our second half
    sees it, all of it. Masked parts are never computed: every rank does the same work per step."""
    owner, half, everything = (cp.rank - step) % cp.size, seq // 2, slice(None)
    if owner == cp.rank:
        return everything, everything, True
    if owner < cp.rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _merge(out, lse, o_b, lse_b):
    """Two partial attentions of the same rows, combined by the log-sum-exp rule (in place)."""
    merged = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(o_b * torch.exp(lse_b - merged).unsqueeze(-1))
    lse.copy_(merged)


def _exchange(tensors: list[torch.Tensor], cp: Group):
    """Send `tensors` to the next cp rank and receive the previous rank's, asynchronously."""
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    transfers = [P2P("send", t, (cp.rank + 1) % cp.size) for t in tensors]
    transfers += [P2P("recv", r, (cp.rank - 1) % cp.size) for r in received]
    return comm.batch_p2p(transfers, cp, async_op=True)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: Group):
        scale = 1.0 / math.sqrt(q.shape[-1])
        seq, acc = q.shape[2], comm.at_least_fp32(q.dtype)
        out = lse = extra = None
        block_k, block_v = k, v
        for step in range(cp.size):
            pending = _exchange([block_k, block_v], cp) if step + 1 < cp.size else None
            rows, keys, causal = _visible(step, cp, seq)
            o_b, lse_b, extra = attend_block(q[:, :, rows], block_k[:, :, keys], block_v[:, :, keys], causal, scale)
            if out is None:  # step 0, the own block: its diagonal makes every row's lse finite
                out, lse = o_b.to(acc), lse_b.to(acc)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            if pending is not None:
                block_k, block_v = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.extra = cp, extra
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        scale = 1.0 / math.sqrt(q.shape[-1])
        seq, acc = q.shape[2], comm.at_least_fp32(q.dtype)
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=acc)
        block_k, block_v = k, v
        incoming = None  # the dK, dV accumulators of the block held now, from the previous rank
        for step in range(cp.size):
            pending_kv = _exchange([block_k, block_v], cp) if step + 1 < cp.size else None
            rows, keys, causal = _visible(step, cp, seq)
            # a later rank's block is seen by the second half of the rows: that lse slice is a strided
            # view, which the CUDA backward would misread
            dq_b, dk_b, dv_b = attend_block_backward(grad_out[:, :, rows], q[:, :, rows], block_k[:, :, keys],
                                                     block_v[:, :, keys], out[:, :, rows],
                                                     lse[:, :, rows].contiguous(), causal, scale, ctx.extra)
            dq[:, :, rows] += dq_b
            dk = torch.zeros_like(block_k, dtype=acc)
            dv = torch.zeros_like(block_v, dtype=acc)
            dk[:, :, keys] += dk_b
            dv[:, :, keys] += dv_b
            if incoming is not None:
                dk_in, dv_in = incoming.wait()
                dk += dk_in
                dv += dv_in
            # pass the accumulators on, in fp32 at least (as torch's own ring attention): rounded
            # to bf16 at each hop, cp partial sums would lose bits; after the last step they
            # reach the block's owner
            incoming = _exchange([dk, dv], cp)
            if pending_kv is not None:
                block_k, block_v = pending_kv.wait()
        dk, dv = incoming.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Group) -> torch.Tensor:
    """Causal attention of this rank's queries [b, heads, s, d] to the whole sequence's keys and
    values, of which this rank holds [b, kv_heads, s, d] (its two chunks, as `shard_sequence`)."""
    if cp.size == 1:
        raise ValueError("ring attention needs cp > 1; use plain causal attention on one rank")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return _RingAttention.apply(q, k, v, cp)
