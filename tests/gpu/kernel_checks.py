"""Ring attention's per-block kernels against a float32 reference, with bounds set by bf16 itself.

Shared by tests/gpu/test_kernels.py, tests/gpu/test_nccl.py and benchmarks/gpu_acceptance.py.

The rule, after FlashAttention's own tests: from the same bf16 inputs, the kernel's largest error
against a float32 reference must be at most FACTOR times the largest error of a plain bf16
computation of the same attention (written out in bf16 torch ops: scores, softmax and products
each rounded to bf16), plus the reference's own rounding to the kernel's output dtype for each
time the result is rounded (a perfect kernel is off by that much: bf16 outputs cannot hold the
float32 answer; ring attention sums partial results that each block's kernel rounded). So the
bound follows bf16 at each shape instead of being a fixed tolerance. SDPA's math path cannot be
the plain computation: it upcasts bf16 to float32 inside, so its error is the output's rounding
alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fourfold.parallel.comm import Group, Ledger
from fourfold.parallel.context import _visible, attend_block, attend_block_backward

FACTOR = 2.0  # the kernel may err at most twice as much as plain bf16 arithmetic


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int

    def __str__(self) -> str:
        return f"b{self.batch} h{self.heads} kv{self.kv_heads} s{self.seq} d{self.head_dim}"


# Llama's head sizes; grouped-query attention (4 query heads per key/value head) and plain multi-head.
SHAPES = (Shape(2, 8, 2, 1024, 128), Shape(2, 4, 4, 512, 64))

# The three kinds of block ring attention computes, as (cp rank, ring step) on a cp group of two
# ranks; `context._visible` says which rows and keys each attends (the ring's own rule).
BLOCKS = {"own": (0, 0), "later rank's": (0, 1), "earlier rank's": (1, 1)}


def visible(block: str, seq: int) -> tuple[slice, slice, bool]:
    """(query rows, keys, causal) of one kind of block, from the ring's rule."""
    rank, step = BLOCKS[block]
    return _visible(step, Group("cp", None, (0, 1), rank, Ledger()), seq)


def random_inputs(shape: Shape, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 q [b, heads, s, d], k and v [b, kv_heads, s, d], and an output gradient like q; drawn on
    the CPU, so that every rank and GPU model gets the same values from the same seed."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [(shape.batch, heads, shape.seq, shape.head_dim)
             for heads in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)]
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=torch.bfloat16) for s in sizes)


def _written_out(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of attention in q's dtype, every step a plain torch op."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _with_grads(attend, q, k, v, dout, dtype) -> dict[str, torch.Tensor]:
    """out, lse and dq, dk, dv (autograd, for the output gradient `dout`) of `attend` in `dtype`."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = attend(q, k, v)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def reference(q, k, v, dout, causal: bool, scale: float) -> dict[str, torch.Tensor]:
    """float32 from the bf16 inputs: the output and gradients by SDPA's math path (with GQA), the
    log-sum-exp written out."""
    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        with torch.no_grad():
            return out, _written_out(q, k, v, causal, scale)[1]

    return _with_grads(attend, q, k, v, dout, torch.float32)


def plain_bf16(q, k, v, dout, causal: bool, scale: float) -> dict[str, torch.Tensor]:
    """The same attention written out in bf16: what bf16 rounding alone costs."""
    return _with_grads(lambda q, k, v: _written_out(q, k, v, causal, scale), q, k, v, dout, torch.bfloat16)


def compare(label: str, got: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
            plain: dict[str, torch.Tensor], roundings: dict[str, int] | None = None) -> list[dict]:
    """One {name, max_error, bound, ok} per tensor of `got`, by the rule of the module's doc;
    `roundings[name]`: how many times the result was rounded to its dtype (default once)."""
    checks = []
    for name, tensor in got.items():
        error = _max_error(tensor, exact[name])
        rounding = _max_error(exact[name].to(tensor.dtype), exact[name])
        bound = FACTOR * _max_error(plain[name], exact[name]) + (roundings or {}).get(name, 1) * rounding
        checks.append({"name": f"{label} {name}", "max_error": error, "bound": bound, "ok": error <= bound})
    return checks


def _max_error(t: torch.Tensor, exact: torch.Tensor) -> float:
    return (t.float() - exact.float()).abs().max().item()


def _as_ring_rows(t: torch.Tensor, seq: int, rows: slice) -> torch.Tensor:
    """`t` (one block's rows) as ring attention holds it: a row slice of a full-sequence tensor."""
    full = t.new_zeros(*t.shape[:2], seq, *t.shape[3:])
    full[:, :, rows] = t
    return full[:, :, rows]


def check_block(block: str, shape: Shape, device: torch.device, seed: int = 0) -> list[dict]:
    """`attend_block` and `attend_block_backward` on one kind of ring block, fed the views the ring
    feeds them (query rows and key halves sliced from full tensors; the backward's output, output
    gradient and log-sum-exp row slices of full-sequence tensors, the log-sum-exp made
    contiguous), against `reference` with `plain_bf16`'s bound."""
    q, k, v, dout = random_inputs(shape, device, seed)
    rows, keys, causal = visible(block, shape.seq)
    scale = 1.0 / math.sqrt(shape.head_dim)
    q_b, k_b, v_b, dout_b = q[:, :, rows], k[:, :, keys], v[:, :, keys], dout[:, :, rows]
    out, lse, extra = attend_block(q_b, k_b, v_b, causal, scale)
    out_rows = _as_ring_rows(out, shape.seq, rows)
    lse_rows = _as_ring_rows(lse, shape.seq, rows).contiguous()
    dq, dk, dv = attend_block_backward(dout_b, q_b, k_b, v_b, out_rows, lse_rows, causal, scale, extra)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    label = f"{block} block (rows {_span(rows, shape.seq)}, keys {_span(keys, shape.seq)}" \
            f"{', causal' if causal else ''}) {shape}"
    return compare(label, got, reference(q_b, k_b, v_b, dout_b, causal, scale),
                   plain_bf16(q_b, k_b, v_b, dout_b, causal, scale))


def _span(s: slice, seq: int) -> str:
    start, stop, _ = s.indices(seq)
    return f"{start}:{stop}"
