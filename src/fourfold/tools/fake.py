"""One rank of a job of any size in this process: a `fake` process group (its collectives return at
once with outputs of the right shape) for measure and simulate, which then run the runtime's own
code under FakeTensorMode."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

# Registers the `fake` backend (how torch's own docs and torchtitan's estimator get one).
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, command: str) -> Iterator[None]:
    if dist.is_initialized():
        raise RuntimeError(f"{command} builds its own fake process group: call it in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
