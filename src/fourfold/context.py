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

from fourfold import comm
from fourfold.comm import P2P, Group


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


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, kv_heads, (heads/kv_heads)*s, d]: each kv head with its query heads."""
    b, h, s, d = t.shape
    return t.reshape(b, kv_heads, (h // kv_heads) * s, d)


def _block_forward(q, k, v, mask, scale):
    """Attention of grouped queries to one key/value block: (output, log-sum-exp) per query row.
    Rows that see no key in this block get output 0 and lse -inf."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    out = (p @ v) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return out, top + torch.log(total)


def _second_half(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """View [b, kv_heads, group, s/2, x] of the grouped rows of this rank's second chunk."""
    b, h, rows, x = t.shape
    s = rows // group_size
    return t.view(b, h, group_size, 2, s // 2, x)[:, :, :, 1]


def _merge(out, lse, o_b, lse_b):
    """Two partial attentions of the same rows, combined by the log-sum-exp rule."""
    merged = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - merged) + o_b * torch.exp(lse_b - merged), merged


def _exchange(tensors: list[torch.Tensor], cp: Group):
    """Send `tensors` to the next cp rank and receive the previous rank's, asynchronously."""
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    transfers = [P2P("send", t, (cp.rank + 1) % cp.size) for t in tensors]
    transfers += [P2P("recv", r, (cp.rank - 1) % cp.size) for r in received]
    return comm.batch_p2p(transfers, cp, async_op=True)


# Which part of a block is visible, for cp rank i holding chunks i and 2cp-1-i and a block from
# rank j holding chunks j and 2cp-1-j: j == i, causal within; j < i, chunk j precedes both of
# ours and chunk 2cp-1-j follows both: all our queries see the block's first half only; j > i,
# both of its chunks follow our first and precede our second: only our second half sees it, all
# of it. Masked parts are never computed, so every rank does the same work per step.


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos, cp: Group):
        kv_heads = k.shape[1]
        g = q.shape[1] // kv_heads
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = _grouped(q, kv_heads)
        half = k.shape[2] // 2
        out = lse = None
        block_k, block_v = k, v
        for step in range(cp.size):
            owner = (cp.rank - step) % cp.size
            pending = _exchange([block_k, block_v], cp) if step + 1 < cp.size else None
            if owner == cp.rank:  # step 0: the diagonal makes every row's lse finite
                causal = pos.repeat(g)[:, None] >= pos[None, :]
                out, lse = _block_forward(qg, block_k, block_v, causal, scale)
            elif owner < cp.rank:
                o_b, lse_b = _block_forward(qg, block_k[:, :, :half], block_v[:, :, :half], None, scale)
                out, lse = _merge(out, lse, o_b, lse_b)
            else:
                rows = _second_half(qg, g).reshape(qg.shape[0], kv_heads, -1, qg.shape[-1])
                o_b, lse_b = _block_forward(rows, block_k, block_v, None, scale)
                o_half, lse_half = _second_half(out, g), _second_half(lse, g)
                merged_o, merged_lse = _merge(o_half, lse_half, o_b.view_as(o_half), lse_b.view_as(lse_half))
                o_half.copy_(merged_o)
                lse_half.copy_(merged_lse)
            if pending is not None:
                block_k, block_v = pending.wait()
        ctx.save_for_backward(q, k, v, pos, out, lse)
        ctx.cp = cp
        return out.reshape(q.shape)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, pos, out, lse = ctx.saved_tensors
        cp = ctx.cp
        kv_heads = k.shape[1]
        g = q.shape[1] // kv_heads
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg, dout = _grouped(q, kv_heads), _grouped(grad_out.contiguous(), kv_heads)
        delta = (dout * out).sum(-1, keepdim=True)
        acc_dtype = torch.promote_types(k.dtype, torch.float32)
        dq = torch.zeros_like(qg, dtype=acc_dtype)
        half = k.shape[2] // 2

        def second(t):
            return _second_half(t, g).reshape(t.shape[0], kv_heads, -1, t.shape[-1])

        block_k, block_v = k, v
        incoming = None  # the dK, dV accumulators of the block held now, from the previous rank
        for step in range(cp.size):
            owner = (cp.rank - step) % cp.size
            pending_kv = _exchange([block_k, block_v], cp) if step + 1 < cp.size else None
            mask, keys = None, slice(None)
            rows = (qg, dout, lse, delta)
            if owner == cp.rank:
                mask = pos.repeat(g)[:, None] >= pos[None, :]
            elif owner < cp.rank:
                keys = slice(0, half)
            else:
                rows = tuple(second(t) for t in rows)
            q_b, dout_b, lse_b, delta_b = rows
            k_b, v_b = block_k[:, :, keys], block_v[:, :, keys]
            scores = (q_b @ k_b.transpose(-1, -2)) * scale
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            p = torch.exp(scores - lse_b)
            dv_b = p.transpose(-1, -2) @ dout_b
            ds = p * (dout_b @ v_b.transpose(-1, -2) - delta_b) * scale
            dk_b = ds.transpose(-1, -2) @ q_b
            if owner > cp.rank:
                _second_half(dq, g).add_((ds @ k_b).view_as(_second_half(dq, g)))
            else:
                dq += ds @ k_b
            if owner < cp.rank:  # the block's second half got no gradient
                dk_b = torch.cat([dk_b, torch.zeros_like(dk_b)], dim=2)
                dv_b = torch.cat([dv_b, torch.zeros_like(dv_b)], dim=2)
            if incoming is not None:
                dk, dv = incoming.wait()
                dk_b, dv_b = dk.to(acc_dtype) + dk_b, dv.to(acc_dtype) + dv_b
            # pass the accumulators on (in the input dtype, like the keys and values); after the
            # last step they reach the block's owner
            incoming = _exchange([dk_b.to(k.dtype), dv_b.to(k.dtype)], cp)
            if pending_kv is not None:
                block_k, block_v = pending_kv.wait()
        dk, dv = incoming.wait()
        return dq.to(q.dtype).reshape(q.shape), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cp: Group) -> torch.Tensor:
    """Causal attention of this rank's queries [b, heads, s, d] to the whole sequence's keys and
    values, of which this rank holds [b, kv_heads, s, d]; `pos` are its tokens' global positions."""
    if cp.size == 1:
        raise ValueError("ring attention needs cp > 1; use plain causal attention on one rank")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return _RingAttention.apply(q, k, v, pos, cp)
