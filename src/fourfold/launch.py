"""Start a fourfold command on N local processes through torchrun (one node)."""

from __future__ import annotations

import os
import subprocess
import sys


def inside_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_with_torchrun(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m fourfold.cli ARGV` on `nproc` ranks with torchrun (which restarts every rank
    up to `max_restarts` times when one fails); returns its exit code."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}", "-m", "fourfold.cli", *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # many ranks on few cores: one thread each
    return subprocess.call(cmd, env=env)
