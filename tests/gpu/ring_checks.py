"""Ring attention with its cp ranks as threads of one process, on one device (CPU or one GPU).

`context._RingAttention`'s forward and backward run unchanged; only the transport is replaced
(`context._exchange`: queues between the threads instead of p2p), so the log-sum-exp merge, the
backward from the final log-sum-exp and the dK, dV accumulators' ring are checked without a
second GPU, against float64 attention of the whole sequence. What this cannot check is the p2p
itself (tests/gpu/test_nccl.py does, on 2+ GPUs; the gloo tests on CPU).

Shared by tests/gpu/test_acceptance.py (the dry run) and benchmarks/gpu_acceptance.py.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch

from fourfold.parallel import context
from fourfold.parallel.comm import Group, Ledger

from .kernel_checks import Shape, _written_out, compare, plain_bf16, random_inputs

TIMEOUT_S = 120  # a rank waiting longer for its neighbour: the other thread failed


class _Arrival:
    def __init__(self, box: queue.Queue):
        self.box = box

    def wait(self) -> list[torch.Tensor]:
        return self.box.get(timeout=TIMEOUT_S)


class _Queues:
    """`context._exchange` for threads: the n-th exchange of rank r reaches rank r + 1's n-th."""

    def __init__(self):
        self.boxes: dict[tuple[int, int], queue.Queue] = defaultdict(queue.Queue)
        self.sent: dict[int, int] = defaultdict(int)
        self.lock = threading.Lock()

    def exchange(self, tensors: list[torch.Tensor], cp: Group) -> _Arrival:
        with self.lock:
            n = self.sent[cp.rank]
            self.sent[cp.rank] += 1
            send, receive = self.boxes[((cp.rank + 1) % cp.size, n)], self.boxes[(cp.rank, n)]
        send.put([t.contiguous() for t in tensors])
        return _Arrival(receive)


class _Saved:
    """What autograd's ctx gives `_RingAttention` (called directly: autograd runs every backward of
    a GPU on one thread, where the virtual ranks would wait on each other)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _unshard(parts: list[torch.Tensor], cp: int) -> torch.Tensor:
    """The whole sequence (dim 2) from each cp rank's chunks i and 2cp-1-i."""
    chunks = [None] * (2 * cp)
    for i, part in enumerate(parts):
        chunks[i], chunks[2 * cp - 1 - i] = part.chunk(2, dim=2)
    return torch.cat(chunks, dim=2)


def virtual_ring(q, k, v, dout, cp: int) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of ring attention over `cp` virtual ranks, for whole-sequence q [b, h, s, d],
    k, v [b, kv_heads, s, d] and output gradient `dout`, reassembled into whole sequences."""
    ring = _Queues()

    def rank(r: int):
        group = Group("cp", None, tuple(range(cp)), r, Ledger())
        mine = [context.shard_sequence(t, group, dim=2) for t in (q, k, v, dout)]
        saved = _Saved()
        with torch.no_grad():
            scale = q.shape[-1] ** -0.5
            out = context._RingAttention.forward(saved, *mine[:3], group, None, scale, None)
            return (out, *context._RingAttention.backward(saved, mine[3])[:3])

    original, context._exchange = context._exchange, ring.exchange
    try:
        with ThreadPoolExecutor(cp) as pool:
            results = [f.result() for f in [pool.submit(rank, r) for r in range(cp)]]
    finally:
        context._exchange = original
    return {name: _unshard([r[i] for r in results], cp) for i, name in enumerate(("out", "dq", "dk", "dv"))}


def exact(q, k, v, dout, scale: float) -> dict[str, torch.Tensor]:
    """float64 causal attention (GQA) of the bf16 inputs and its gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = _written_out(q, k, v, True, scale)[0]
    out.backward(dout.double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def check_ring(shape: Shape, cp: int, device: torch.device, seed: int = 0) -> list[dict]:
    """`virtual_ring` in bf16 against float64, by kernel_checks' rule: at most FACTOR times the
    error of plain bf16 arithmetic, plus two roundings (each block's kernel rounds its part, the
    fp32 sum of the parts is rounded once)."""
    q, k, v, dout = random_inputs(shape, device, seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    got = virtual_ring(q, k, v, dout, cp)
    return compare(f"ring attention cp={cp} {shape}", got, exact(q, k, v, dout, scale),
                   plain_bf16(q, k, v, dout, True, scale), roundings=dict.fromkeys(got, 2))
