"""The cost of document-masked attention (data.attention = document) against plain causal attention,
forward and backward of the attention core alone, same shapes, on CPU.

Two ranks, one thread each. First each rank times the whole sequence on its own (the 1-rank path:
SDPA with is_causal, against `block.masked_attention`, SDPA with a materialised block-diagonal
mask); then the two time cp2 ring attention on their halves, without and with document ids (each
block cut to the rows and keys that can share a document, masked by an additive bias on the CPU
flash kernel). Windows hold 1, 4 or 16 documents, cut at seeded random places. Last, what each
1-rank path keeps for backward (autograd's saved tensors, 4 documents): the banded path as on CPU
(GQA in the flash kernel), as on CUDA (K/V repeated to the query heads, so the memory-efficient
kernel takes the mask), and one [s, s] mask on the math kernel (what SDPA does on CUDA given a mask
with GQA). Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/document_mask.py
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fourfold.parallel import context
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import masked_attention
from fourfold.spec.layout import Layout
from timing import best_time  # benchmarks/timing.py, beside this file


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `fn()`'s graph."""
    storages = {}

    def pack(t: torch.Tensor):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def documents(n: int, seq: int, batch: int, g: torch.Generator) -> torch.Tensor:
    """[batch, seq] document ids: n documents per row, cut at random places."""
    rows = []
    for _ in range(batch):
        starts = torch.zeros(seq, dtype=torch.long)
        starts[torch.randperm(seq - 1, generator=g)[: n - 1] + 1] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    grid = Grid(Layout(cp=dist.get_world_size()))
    cp = grid.group("cp")
    g = torch.Generator().manual_seed(0)
    b, s, d = args.batch, args.seq, args.head_dim
    q = torch.randn(b, args.heads, s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, args.kv_heads, s, d, generator=g, requires_grad=True) for _ in "kv")
    grad = torch.randn(b, args.heads, s, d, generator=g)
    docs = {n: documents(n, s, b, g) for n in (1, 4, 16)}
    local = [context.shard_sequence(t.detach(), cp, dim=2).requires_grad_() for t in (q, k, v)]
    local_grad = context.shard_sequence(grad, cp, dim=2)

    def timed(fn, gradient) -> float:
        return best_time(lambda: fn().backward(gradient), args.repeat)

    rows = []
    for n in (None, 1, 4, 16):
        def whole(n=n):
            if n is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return masked_attention(q, k, v, docs[n], enable_gqa=True)

        def ring(n=n):
            return context.ring_attention(*local, cp, None if n is None else context.shard_sequence(docs[n], cp))

        label = "causal" if n is None else f"{n} document{'s' * (n > 1)}"
        rows.append((label, timed(whole, grad), timed(ring, local_grad)))
    attended = []  # (rows x keys) attended off the own block, both ranks, as a share of plain causal ring's
    for n in (1, 4, 16):
        mine = context.shard_sequence(docs[n], cp)
        plan = context.Documents(mine).ring(cp, mine.shape[1], 0, mine.device)
        attended.append(sum((r.stop - r.start) * (k.stop - k.start) for p in plan[1:] if p for r, k in p.cut))
    attended = torch.tensor(attended, dtype=torch.float64) / (s // cp.size * s // (2 * cp.size))  # (s/cp x s/(2cp))
    dist.all_reduce(attended)
    attended /= cp.size * (cp.size - 1)
    kept = {}
    for label, fn, kernel in [
        ("banded, GQA in the kernel (CPU)", lambda: masked_attention(q, k, v, docs[4], enable_gqa=True), None),
        ("banded, heads repeated (CUDA)",
         lambda: masked_attention(q, k, v, docs[4], enable_gqa=True, expand_heads=True), None),
        ("one [s, s] mask, math kernel", lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=(docs[4][:, :, None] == docs[4][:, None, :]).tril()[:, None], enable_gqa=True),
         torch.nn.attention.SDPBackend.MATH),
    ]:
        with torch.nn.attention.sdpa_kernel(kernel) if kernel else nullcontext():
            kept[label] = saved_bytes(fn)
    if grid.rank == 0:
        print(f"attention forward + backward, batch {b}, seq {s}, {args.heads} heads ({args.kv_heads} kv), head dim "
              f"{d}, float32, 1 thread per rank, best of {args.repeat}")
        print(f"{'window':<12} {'1 rank ms':>10} {'vs causal':>10} {'cp2 ring ms':>12} {'vs causal':>10}")
        for label, one, ring in rows:
            print(f"{label:<12} {one * 1e3:10.1f} {one / rows[0][1]:10.2f} {ring * 1e3:12.1f} "
                  f"{ring / rows[0][2]:10.2f}")
        print("off the own block, the ring attends to this share of the causal ring's rows x keys, for 1, 4, 16 "
              "documents: " + ", ".join(f"{a:.3f}" for a in attended.tolist()))
        inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
        print(f"kept for backward, 1 rank, 4 documents (q, k, v themselves: {inputs / 2**20:.1f} MiB):")
        for label, n in kept.items():
            print(f"  {label:<34} {n / 2**20:8.1f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
