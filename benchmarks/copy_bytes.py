"""Activation copies of a training step's forward and backward on a 3D tensor grid: the elements
copy operators (clone, copy_, _to_copy) write on each rank, counted by a dispatch mode, beside the
elements the step's collectives send (fourfold's ledger). A copy is a read and a write of HBM on a
GPU that does no arithmetic: what `comm`'s reorderings cost (issue #38 item 3). Counts, not times:
exact on CPU.

Run: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/copy_bytes.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fourfold.models.config import ModelConfig
from fourfold.parallel.grid import Grid, init_process_group
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout

CFG = ModelConfig("llama", hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=4096, max_positions=512,
                  tied=False, eps=1e-5)
COPIES = {"clone.default", "copy_.default", "_to_copy.default"}


class Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.elements = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__ in COPIES:
            self.elements += out.numel()
            self.by_op[func.__name__] = self.by_op.get(func.__name__, 0) + out.numel()
        return out


def counted(layout: Layout, batch: int, seq: int, seq_parallel: bool) -> tuple[int, int]:
    """(elements copied, elements sent) by this rank in one forward and backward."""
    grid = Grid(layout)
    model = Transformer(grid, CFG, TensorOptions(seq_parallel=seq_parallel), seed=0)
    ids = torch.randint(0, CFG.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], ids[:, 1:]).sum().backward()  # (warm-up: lazily made groups and buffers)
    grid.ledger.reset()
    with Copies() as copies:
        model(ids[:, :-1], ids[:, 1:]).sum().backward()
    return copies.elements, int(grid.ledger.total()) // 4  # (float32)


def main() -> None:
    init_process_group()
    rows = []
    for label, layout, seq_parallel in [("y4, sequence parallel", Layout(y=4), True),
                                        ("x2 y2, sequence parallel", Layout(x=2, y=2), True),
                                        ("x2 y2", Layout(x=2, y=2), False),
                                        ("x4", Layout(x=4), False)]:
        for batch in (1, 2):
            copied, sent = counted(layout, batch, 128, seq_parallel)
            rows.append((label, batch, copied, sent))
    if dist.get_rank() == 0:
        print(f"Llama hidden={CFG.hidden} layers={CFG.layers}, 128 tokens a sequence, one forward and backward, rank 0")
        print(f"{'grid':<26} {'seqs':>4} {'elements copied':>16} {'elements sent':>14} {'copied/sent':>11}")
        for label, batch, copied, sent in rows:
            print(f"{label:<26} {batch:>4} {copied:>16,} {sent:>14,} {copied / sent:>11.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
