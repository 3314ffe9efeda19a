"""Counting the reads of device values by the host (each one a CUDA synchronisation on a GPU) in a
piece of work, on any device: under a dispatch mode, the aten ops whose result the host needs
(`.item()`, `bool(t)`, `torch.where(cond)` / `nonzero`, `masked_select`, `unique`, a device-to-host
copy), plus `Tensor.tolist` and `Tensor.numpy`, which read a CPU tensor's memory without an aten op
(on a GPU they copy to the host first).

    with HostReads() as reads:
        loss = model(ids, targets).sum(); loss.backward()
    reads.total, reads.counts  # {"tolist": 2, "nonzero": 8, ...}
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that cannot run without the host knowing a value they compute
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
           "repeat_interleave"}


class HostReads(TorchDispatchMode):
    """Counts host reads by kind while active (see the module docstring). `repeat_interleave`
    counts only with tensor repeats (its output size is data)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._patched: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING and (name != "repeat_interleave" or len(args) == 1 or isinstance(args[1], torch.Tensor)):
            self.counts[name] += 1
        elif name in ("_to_copy", "copy_") and self._to_host(func, args, kwargs):
            self.counts["to_host"] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(func, args, kwargs) -> bool:
        source = args[0] if func.overloadpacket.__name__ == "_to_copy" else args[1]
        target = kwargs.get("device") if func.overloadpacket.__name__ == "_to_copy" else args[0].device
        return (isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None
                and torch.device(target).type == "cpu")

    def __enter__(self):
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def counted(tensor, *args, _method=method, _original=original, **kwargs):
                self.counts[_method] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
