"""Context parallelism: the sequence split over cp with causal load balancing, and ring attention.

The sequence is cut into 2*cp chunks; cp rank i holds chunks i and 2cp-1-i, so every rank has
the same amount of causal attention work. Ring attention: each rank keeps its queries and passes
its keys and values around the cp ring; every arriving block is attended to while the next one
is in flight, and the partial results are merged with the log-sum-exp (online softmax) rule.
Backward runs the ring again, with each block's dK and dV accumulators travelling alongside it
and returning to their owner at the end.

With document ids (data.attention = document) every query sees only the keys of its own document
at or before it, and with a sliding window (Mistral's, Gemma 3's local layers) only the keys less
than the window before it. The ids of the whole sequence are all-gathered over cp once per call
(b*s integers), so each rank knows every arriving block's ids without sending them round the ring;
the positions of every block are known from the chunk layout. Each block's rows are cut into bands,
each attending only to the keys its documents, causality and window reach (`Documents.ring`; a step
where no row sees the block is skipped, the blocks still travel so that every rank does the same
exchanges). A band gets its mask as an additive bias on the CPU's flash kernel and on CUDA's
memory-efficient kernel, or explicit masked scores elsewhere (`attend_block_masked`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fourfold.parallel import comm
from fourfold.parallel.comm import P2P, Group
from fourfold.spec.ring import bands, fetches_windows, position_reach, rank_positions, visible, window_reach


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


# SDPA's kernels as fourfold prefers them on GPUs: cuDNN's fused attention (the fastest on Hopper and
# Blackwell where it takes the shapes), then flash; torch's own order tries flash first
PREFERRED_KERNELS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH)
_ENABLED = {SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
            SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
            SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
            SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}


@contextlib.contextmanager
def preferred_kernels():
    """A context in which SDPA tries its kernels in `PREFERRED_KERNELS`' order; a kernel the caller
    turned off (an enclosing `sdpa_kernel`) stays off. The priority before is restored whole on exit
    (`sdpa_kernel` restores only the enabled kernels' order). Entered once a step (`Model.step`),
    outside compiled code."""
    order = torch._C._get_sdp_priority_order()
    try:
        with sdpa_kernel([k for k in PREFERRED_KERNELS if _ENABLED[k]()], set_priority=True):
            yield
    finally:
        torch._C._set_sdp_priority_order(order)


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


def attend_block_masked(q, k, v, mask, scale: float):
    """One block under a boolean mask [b, rows, keys] (True: seen): (output in q's dtype, log-sum-
    exp per row in at least fp32). A row that sees no key gets a log-sum-exp that merges as nothing
    (-inf, or about the dtype's lowest number on CPU). GQA as `attend_block`."""
    check_flash_inputs(q, k, v)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=_bias(mask, q.dtype), scale=scale)
        return out, lse
    if q.is_cuda:
        return _masked_efficient(q, k, v, mask, scale)
    return _masked_math(q, k, v, mask, scale)


def attend_block_masked_backward(dout, q, k, v, out, lse, mask, scale: float):
    """(dq, dk, dv) of one masked block, given the rows' final output and (finite) log-sum-exp."""
    check_flash_inputs(q, k, v, lse)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=_bias(mask, q.dtype), scale=scale)
    if q.is_cuda:
        return _masked_efficient_backward(dout, q, k, v, out, lse, mask, scale)
    return _masked_math_backward(dout, q, k, v, out, lse, mask, scale)


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive [b, 1, rows, keys] form of a mask for the CPU kernel: the dtype's lowest finite
    number, not -inf, where masked: the kernel gives a row masked whole NaN gradients with -inf,
    and with the finite bias an output weighted exp(lowest - lse) = 0 when merged."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, torch.finfo(dtype).min)[:, None]


# CUDA's memory-efficient attention (the kernel SDPA picks for a masked call) reads the bias's rows
# at a stride of whole 16-element groups and pads the log-sum-exp's rows to a multiple of 32
BIAS_ALIGNMENT, LSE_ALIGNMENT = 16, 32


def efficient_forward(q, k, v, bias, scale: float):
    """CUDA's memory-efficient attention: (output, log-sum-exp [b, heads, rows padded to 32])."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False,
                                                                            scale=scale)
    return out, lse


def efficient_backward(dout, q, k, v, bias, out, lse, scale: float):
    """Its backward, given the rows' final output and padded log-sum-exp: (dq, dk, dv)."""
    seed = offset = torch.zeros((), dtype=torch.long)  # (read only with dropout)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale)
    return dq, dk, dv


def _efficient_bias(mask: torch.Tensor, q: torch.Tensor, keys: int) -> torch.Tensor:
    """The mask as the efficient kernel's additive bias [b, heads, rows, keys] in q's dtype: one
    [b, rows, keys] tensor (its rows padded to BIAS_ALIGNMENT, as SDPA pads a mask), expanded over
    the heads; the lowest finite number where masked, as for the CPU kernel (`_bias`)."""
    b, rows = mask.shape[0], mask.shape[1]
    padded = -(-keys // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    bias = q.new_zeros(b, rows, padded)[..., :keys]
    bias.masked_fill_(~mask, torch.finfo(q.dtype).min)
    return bias[:, None].expand(q.shape[0], q.shape[1], rows, keys)


def _repeat_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """GQA's K or V repeated to the query heads: the efficient kernel takes a bias but not GQA."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _masked_efficient(q, k, v, mask, scale):
    """`attend_block_masked` on CUDA's memory-efficient kernel: the mask a bf16 bias of one element
    a (row, key), where the explicit path keeps fp32 scores for every head, and no score matrix
    kept (backward recomputes them in its tiles). A row that sees no key gets a log-sum-exp of -inf:
    the kernel scales the bias by log2(e), which takes bf16's lowest number past fp32's, and then
    returns such a row a log-sum-exp of 0, which would merge as a weight of 1."""
    group = q.shape[1] // k.shape[1]
    out, lse = efficient_forward(q, _repeat_heads(k, group), _repeat_heads(v, group),
                                 _efficient_bias(mask, q, k.shape[2]), scale)
    seen = mask.any(-1)[:, None]
    return out, torch.where(seen, lse[..., :q.shape[2]], float("-inf"))


def _masked_efficient_backward(dout, q, k, v, out, lse, mask, scale):
    b, heads, rows = lse.shape
    group = heads // k.shape[1]
    padded = lse.new_full((b, heads, -(-rows // LSE_ALIGNMENT) * LSE_ALIGNMENT), float("inf"))  # the kernel's pad
    padded[..., :rows] = lse
    dq, dk, dv = efficient_backward(dout, q, _repeat_heads(k, group), _repeat_heads(v, group),
                                    _efficient_bias(mask, q, k.shape[2]), out, padded, scale)
    if group > 1:  # each kv head's gradient: the sum over the query heads that read it
        dk, dv = (t.unflatten(1, (k.shape[1], group)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, kv_heads, heads/kv_heads, s, d]: query head h reads kv head h // group."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


def _masked_scores(q, k, mask, scale):
    acc = comm.at_least_fp32(q.dtype)
    s = torch.einsum("bgrsd,bgtd->bgrst", _grouped(q, k.shape[1]).to(acc), k.to(acc)) * scale
    return s.masked_fill_(~mask[:, None, None], float("-inf"))


def _masked_math(q, k, v, mask, scale):
    """`attend_block_masked` with explicit scores [b, kv_heads, group, rows, keys] in at least fp32
    (any device; a row seeing no key: log-sum-exp -inf, output 0)."""
    s = _masked_scores(q, k, mask, scale)
    lse = s.logsumexp(-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None])
    out = torch.einsum("bgrst,bgtd->bgrsd", p, v.to(p.dtype))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _masked_math_backward(dout, q, k, v, out, lse, mask, scale):
    acc = comm.at_least_fp32(q.dtype)
    g = k.shape[1]
    p = torch.exp(_masked_scores(q, k, mask, scale) - _grouped(lse[..., None], g))
    dout_g = _grouped(dout, g).to(acc)
    dv = torch.einsum("bgrst,bgrsd->bgtd", p, dout_g)
    dp = torch.einsum("bgrsd,bgtd->bgrst", dout_g, v.to(acc))
    rowsum = (dout_g * _grouped(out, g).to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - rowsum) * scale
    dq = torch.einsum("bgrst,bgtd->bgrsd", ds, k.to(acc)).flatten(1, 2)
    dk = torch.einsum("bgrst,bgrsd->bgtd", ds, _grouped(q, g).to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _visible(step: int, cp: Group, seq: int) -> tuple[slice, slice, bool]:
    """(query rows, block keys, causal) of the block arriving at ring step `step` (`ring.visible`)."""
    return visible(cp.rank, (cp.rank - step) % cp.size, seq)


def _chunks(documents: torch.Tensor, cp: Group) -> torch.Tensor:
    """This rank's document ids [b, s] -> the whole sequence's, chunk by chunk: [b, 2cp, s/2]."""
    b, s = documents.shape
    every = comm.all_gather(documents, cp, dim=0).view(cp.size, b, 2, s // 2)  # rank r: chunks r, 2cp-1-r
    return torch.cat([every[:, :, 0], every[:, :, 1].flip(0)]).transpose(0, 1)


def document_reach(documents: torch.Tensor, owner: torch.Tensor, row_bands: list[slice], keys: slice) -> torch.Tensor:
    """For each band of rows of `documents` [b, s], the keys (`keys` of the owner's ids [b, s]) that
    can share a document with it: a [bands, 2] tensor of (start, stop) on the device. Ids never
    decrease along the rows nor along the keys, so a band sees keys from the first whose id is its
    first row's to the last whose id is its last row's, in every sequence of the batch: the widest
    over the batch is kept, the mask does the rest."""
    k0, k1 = keys.start or 0, owner.shape[1] if keys.stop is None else keys.stop
    key_ids = owner[:, k0:k1].contiguous()
    firsts = documents[:, [band.start for band in row_bands]].contiguous()
    lasts = documents[:, [band.stop - 1 for band in row_bands]].contiguous()
    start = k0 + torch.searchsorted(key_ids, firsts).amin(0)
    stop = k0 + torch.searchsorted(key_ids, lasts, right=True).amax(0)
    return torch.stack([start, stop], dim=1)


DECREASING_IDS = "document ids must not decrease along the sequence (as block.document_ids gives them)"


def decreasing(documents: torch.Tensor) -> torch.Tensor:
    """Whether ids decrease anywhere along a sequence [b, s] (a 0-d tensor on the device)."""
    return (documents.diff(dim=1) < 0).any()


@dataclasses.dataclass
class BlockPlan:
    """What a block of keys (one ring step's, or the whole sequence's) gets attended with: the rows
    in bands, each with the keys it can see (`cut`); the positions and document ids of the rows
    and of the block's keys, from which each band's mask is made."""

    cut: list[tuple[slice, slice]]
    row_pos: torch.Tensor  # [s] on the device
    key_pos: torch.Tensor
    ids: torch.Tensor | None  # [b, s] document ids, or None: one document a sequence
    key_ids: torch.Tensor | None
    window: int

    def mask(self, rows: slice, keys: slice) -> torch.Tensor:
        """[b or 1, rows, keys]: True where the key is not after the row, within the window, and in
        the row's document."""
        distance = self.row_pos[rows, None] - self.key_pos[None, keys]
        mask = distance >= 0
        if self.window:
            mask &= distance < self.window
        if self.ids is None:
            return mask[None]
        return mask & (self.ids[:, rows, None] == self.key_ids[:, None, keys])


class Documents:
    """A micro-batch's attention masking: its document ids [b, s] (`block.document_ids`, this rank's
    part; None: each sequence one document) and the plans attention makes from them for a window
    (0: none), each made once, with at most one host read, and shared by every layer of the forward
    and its recompute (the ids are the same for all of them). A layer given a tensor wraps it
    (`as_documents`)."""

    def __init__(self, ids: torch.Tensor | None) -> None:
        self.ids = ids
        self._plans: dict[object, object] = {}

    def whole(self, seq: int, window: int, device) -> BlockPlan:
        """Whole-sequence causal attention's plan on one rank."""
        key = ("whole", seq, window)
        if key not in self._plans:
            self._plans[key] = _plans(self.ids, self.ids, [self.ids], [(slice(None), slice(None))],
                                      rank_positions(0, 1, seq),
                                      [rank_positions(0, 1, seq)], window, device)[0]
        return self._plans[key]

    def varlen(self, batch: int, seq: int, device) -> tuple[torch.Tensor, int]:
        """Each document a sequence of its own, as varlen kernels take them: the cumulative starts
        [documents + 1] (int32, on `device`) over the batch's tokens flattened, and the longest
        document. One host read (the ids, b*s integers), made once a forward; none without ids."""
        key = ("varlen", batch, seq)
        if key not in self._plans:
            if self.ids is None:
                starts, longest = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32), seq
            else:
                ids = self.ids.cpu()  # (the one host read)
                if decreasing(ids):
                    raise ValueError(DECREASING_IDS)
                first = torch.ones(ids.shape, dtype=torch.bool)
                first[:, 1:] = ids[:, 1:] != ids[:, :-1]
                starts = torch.cat([first.flatten().nonzero().flatten(), torch.tensor([ids.numel()])]).int()
                longest = int(starts.diff().max())
            self._plans[key] = (starts.to(device, non_blocking=True), longest)
        return self._plans[key]

    def ring(self, cp: Group, seq: int, window: int, device) -> list[BlockPlan | None]:
        """Ring attention's plan over `cp`, step by step (None: no row sees the arriving block)."""
        key = (cp.ranks, seq, window)
        if key not in self._plans:
            n, i = cp.size, cp.rank
            owners = [(i - step) % n for step in range(n)]
            owner_ids, whole = [self.ids] * n, self.ids  # (one rank: its own)
            if self.ids is not None and n > 1:
                chunks = _chunks(self.ids, cp)
                owner_ids = [torch.cat([chunks[:, j], chunks[:, 2 * n - 1 - j]], dim=1) for j in owners]
                whole = chunks.flatten(1)
            seen = [_visible(step, cp, seq)[:2] for step in range(n)]
            self._plans[key] = _plans(self.ids, whole, owner_ids, seen, rank_positions(i, n, seq),
                                      [rank_positions(j, n, seq) for j in owners], window, device)
        return self._plans[key]


def as_documents(documents: torch.Tensor | Documents | None) -> Documents:
    """`documents` as a `Documents` (None: each sequence one document, `ids` None)."""
    return documents if isinstance(documents, Documents) else Documents(documents)


def _plans(ids, whole, owner_ids, seen, row_pos, key_pos, window, device) -> list[BlockPlan | None]:
    """One `BlockPlan` per block of keys (owner ids, (rows, keys) seen, key positions), None where
    no band sees any key: the bands' reach by positions (host) cut to their documents' (one host read
    for all blocks, with the check that the whole sequence's ids `whole` never decrease)."""
    row_bands = [bands(rows, len(row_pos), window) for rows, _ in seen]
    reach = [position_reach(b, row_pos, pos, keys, window) for b, (_, keys), pos in zip(row_bands, seen, key_pos)]
    if ids is not None:
        found = [decreasing(whole).long().expand(1, 2)]
        found += [document_reach(ids, owner, b, keys) for owner, b, (_, keys) in zip(owner_ids, row_bands, seen)]
        bad, *by_documents = torch.cat(found).tolist()  # (one host read)
        if bad[0]:
            raise ValueError(DECREASING_IDS)
        for r in reach:
            r[:] = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(r, by_documents[: len(r)])]
            by_documents = by_documents[len(r):]
    rows_at = torch.tensor(row_pos, device=device)
    plans = []
    for b, r, owner, pos in zip(row_bands, reach, owner_ids, key_pos):
        cut = [(band, slice(start, stop)) for band, (start, stop) in zip(b, r) if start < stop]
        plans.append(BlockPlan(cut, rows_at, torch.tensor(pos, device=device), ids, owner, window) if cut else None)
    return plans


def _merge(out, lse, o_b, lse_b):
    """Two partial attentions of the same rows, combined by the log-sum-exp rule (in place)."""
    merged = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(o_b * torch.exp(lse_b - merged).unsqueeze(-1))
    lse.copy_(merged)


class _Kept:
    """What `_exchange` returns on a ring of one rank: its own tensors, nothing sent."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def wait(self) -> list[torch.Tensor]:
        return self.tensors


def _exchange(tensors: list[torch.Tensor], cp: Group):
    """Send `tensors` to the next cp rank and receive the previous rank's, asynchronously."""
    if cp.size == 1:
        return _Kept(tensors)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    transfers = [P2P("send", t, (cp.rank + 1) % cp.size) for t in tensors]
    transfers += [P2P("recv", r, (cp.rank - 1) % cp.size) for r in received]
    return comm.batch_p2p(transfers, cp, async_op=True)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: Group, plan: list[BlockPlan | None] | None, scale: float,
                sinks: torch.Tensor | None):
        """`plan`: the masked path's, step by step (`Documents.ring`); None: plain causal attention.
        `sinks` [heads]: a logit per head in every row's softmax, with no value (GPT-OSS's)."""
        seq, acc = q.shape[2], comm.at_least_fp32(q.dtype)
        out, lse, extra = q.new_empty(q.shape, dtype=acc), q.new_empty(q.shape[:3], dtype=acc), None
        block_k, block_v = k, v
        for step in range(cp.size):
            pending = _exchange([block_k, block_v], cp) if step + 1 < cp.size else None
            rows, keys, causal = _visible(step, cp, seq)
            # masked: band by band, each with the keys it can see (none: no row sees this block)
            block = None if plan is None else plan[step]
            cut = [(rows, keys)] if plan is None else block.cut if block is not None else []
            for rows, keys in cut:
                if plan is None:
                    o_b, lse_b, extra = attend_block(q[:, :, rows], block_k[:, :, keys], block_v[:, :, keys], causal,
                                                     scale)
                else:
                    o_b, lse_b = attend_block_masked(q[:, :, rows], block_k[:, :, keys], block_v[:, :, keys],
                                                     block.mask(rows, keys).expand(q.shape[0], -1, -1), scale)
                if step == 0:  # the own block covers every row, each seeing itself: a finite lse
                    out[:, :, rows], lse[:, :, rows] = o_b, lse_b
                else:
                    _merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            if pending is not None:
                block_k, block_v = pending.wait()
        if sinks is not None:  # one more term of the softmax: the rows' weights shrink by exp(lse - total)
            lse = _with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp, ctx.extra, ctx.plan, ctx.scale = cp, extra, plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp, plan, scale = ctx.cp, ctx.plan, ctx.scale
        seq, acc = q.shape[2], comm.at_least_fp32(q.dtype)
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=acc)
        block_k, block_v = k, v
        incoming = None  # the dK, dV accumulators of the block held now, from the previous rank
        for step in range(cp.size):
            pending_kv = _exchange([block_k, block_v], cp) if step + 1 < cp.size else None
            rows, keys, causal = _visible(step, cp, seq)
            block = None if plan is None else plan[step]
            if plan is not None and block is None:  # skipped in forward: the accumulators pass on
                incoming = _exchange(list(incoming.wait()), cp)
                if pending_kv is not None:
                    block_k, block_v = pending_kv.wait()
                continue
            dk = torch.zeros_like(block_k, dtype=acc)
            dv = torch.zeros_like(block_v, dtype=acc)
            for rows, keys in [(rows, keys)] if plan is None else block.cut:
                # a later rank's block is seen by the second half of the rows: that lse slice is a strided
                # view, which the CUDA backward would misread
                inputs = (grad_out[:, :, rows], q[:, :, rows], block_k[:, :, keys], block_v[:, :, keys],
                          out[:, :, rows], lse[:, :, rows].contiguous())
                if plan is None:
                    dq_b, dk_b, dv_b = attend_block_backward(*inputs, causal, scale, ctx.extra)
                else:
                    dq_b, dk_b, dv_b = attend_block_masked_backward(
                        *inputs, block.mask(rows, keys).expand(q.shape[0], -1, -1), scale)
                dq[:, :, rows] += dq_b
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
        # d(sink) = -(its weight) * (dout . out) summed over the rows: the blocks' kernels, given the final
        # out and lse, already give q, k and v theirs
        dsinks = None if sinks is None else _sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks


def _with_sinks(out, lse, sinks):
    """The sinks' term of every row's softmax (`_RingAttention`): out scaled in place; the new lse."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    return total


def _sinks_grad(grad_out, out, lse, sinks):
    rowsum = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(sinks.to(lse.dtype)[None, :, None] - lse) * rowsum).sum((0, 2)).to(sinks.dtype)


class _WindowAttention(torch.autograd.Function):
    """Causal attention under a sliding window over cp ranks that fetches only the blocks its queries
    reach (`ring.window_reach`: with a window within a chunk, the two neighbours' at most), instead of
    passing every block round the ring: each rank sends its K and V to the ranks that reach it and
    receives from those it reaches, in one batch, while it attends its own block. The blocks are
    merged in ring order, as the ring merges them; backward keeps the received blocks and sends each
    its dK, dV (fp32 at least) back, summed by their owner in rank order."""

    @staticmethod
    def forward(ctx, q, k, v, cp: Group, plan: list[BlockPlan | None], scale: float, sinks, reached, reaching):
        """`reached`: the ranks whose blocks this one attends (itself first, then in ring order);
        `reaching`: the ranks that attend this one's."""
        acc = comm.at_least_fp32(q.dtype)
        out, lse = q.new_empty(q.shape, dtype=acc), q.new_empty(q.shape[:3], dtype=acc)
        k, v = k.contiguous(), v.contiguous()
        others = [j for j in reached if j != cp.rank]
        blocks = {j: (torch.empty_like(k), torch.empty_like(v)) for j in others}
        transfers = [P2P("send", t, r) for r in reaching if r != cp.rank for t in (k, v)]
        transfers += [P2P("recv", t, j) for j in others for t in blocks[j]]
        pending = comm.batch_p2p(transfers, cp, async_op=True) if transfers else None
        blocks[cp.rank] = (k, v)
        for step in range(cp.size):
            owner = (cp.rank - step) % cp.size
            if owner not in reached or plan[step] is None:
                continue
            if owner != cp.rank and pending is not None:
                pending.wait()
                pending = None
            block_k, block_v = blocks[owner]
            for rows, keys in plan[step].cut:
                o_b, lse_b = attend_block_masked(q[:, :, rows], block_k[:, :, keys], block_v[:, :, keys],
                                                 plan[step].mask(rows, keys).expand(q.shape[0], -1, -1), scale)
                if step == 0:  # the own block covers every row, each seeing itself: a finite lse
                    out[:, :, rows], lse[:, :, rows] = o_b, lse_b
                else:
                    _merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
        if pending is not None:  # (sends to ranks that reach this one, none of whose blocks it needed)
            pending.wait()
        if sinks is not None:
            lse = _with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, sinks, *[t for j in others for t in blocks[j]], k, v)
        ctx.cp, ctx.plan, ctx.scale, ctx.reached, ctx.reaching, ctx.others = cp, plan, scale, reached, reaching, others
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, sinks, *saved = ctx.saved_tensors
        cp, plan, scale = ctx.cp, ctx.plan, ctx.scale
        acc = comm.at_least_fp32(q.dtype)
        blocks = {j: (saved[2 * i], saved[2 * i + 1]) for i, j in enumerate(ctx.others)}
        blocks[cp.rank] = (saved[-2], saved[-1])
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=acc)
        grads = {j: (torch.zeros_like(blocks[j][0], dtype=acc), torch.zeros_like(blocks[j][1], dtype=acc))
                 for j in blocks}
        for step in range(cp.size):
            owner = (cp.rank - step) % cp.size
            if owner not in ctx.reached or plan[step] is None:
                continue
            (block_k, block_v), (dk, dv) = blocks[owner], grads[owner]
            for rows, keys in plan[step].cut:
                dq_b, dk_b, dv_b = attend_block_masked_backward(
                    grad_out[:, :, rows], q[:, :, rows], block_k[:, :, keys], block_v[:, :, keys], out[:, :, rows],
                    lse[:, :, rows].contiguous(), plan[step].mask(rows, keys).expand(q.shape[0], -1, -1), scale)
                dq[:, :, rows] += dq_b
                dk[:, :, keys] += dk_b
                dv[:, :, keys] += dv_b
        # each fetched block's dK, dV back to its owner; this rank's from every rank that fetched it
        coming = {r: (torch.empty_like(grads[cp.rank][0]), torch.empty_like(grads[cp.rank][1]))
                  for r in ctx.reaching if r != cp.rank}
        transfers = [P2P("send", t, j) for j in ctx.others for t in grads[j]]
        transfers += [P2P("recv", t, r) for r in sorted(coming) for t in coming[r]]
        if transfers:
            comm.batch_p2p(transfers, cp)
        dk, dv = grads[cp.rank]
        for r in sorted(coming):
            dk += coming[r][0]
            dv += coming[r][1]
        dsinks = None if sinks is None else _sinks_grad(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None, None, None, dsinks, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Group,
                   documents: torch.Tensor | Documents | None = None, window: int = 0,
                   scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries [b, heads, s, d] to the whole sequence's keys and
    values, of which this rank holds [b, kv_heads, s, d] (its two chunks, as `shard_sequence`).
    `documents`: this rank's [b, s] document ids of the whole sequence's (`block.document_ids`,
    sharded as the tokens; never decreasing along the sequence): each query then sees the keys of
    its own document only. `window` > 0: each query sees only the keys less than `window` positions
    before it (a sliding window); the steps whose block no query can see are skipped. `scale`: the
    scores' (default 1 / sqrt(head_dim)). `sinks` [heads]: a learned logit per head that every row's
    softmax also takes, with no value (GPT-OSS's attention sinks). On one rank (cp 1) the ring is
    the own block alone: the path for sinks, which need the log-sum-exp SDPA does not return."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    documents = as_documents(documents)
    if documents.ids is not None and documents.ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"document ids {tuple(documents.ids.shape)} do not match the queries' [batch, seq] "
                         f"{(q.shape[0], q.shape[2])}")
    window = window if window < q.shape[2] * cp.size else 0  # a window over the whole sequence masks nothing
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if documents.ids is None and not window:
        return _RingAttention.apply(q, k, v, cp, None, scale, sinks)
    plan = documents.ring(cp, q.shape[2], window, q.device)
    if fetches_windows(cp.size, q.shape[2], window):  # only the blocks the window reaches, fetched
        reach = window_reach(cp.size, q.shape[2], window)
        reaching = tuple(r for r in range(cp.size) if cp.rank in reach[r])
        return _WindowAttention.apply(q, k, v, cp, plan, scale, sinks, reach[cp.rank], reaching)
    return _RingAttention.apply(q, k, v, cp, plan, scale, sinks)
