"""Fault injection, for the tests of recovery ([fault]): a rank that dies, or signals itself, once
at a configured step (a marker file in the run directory makes it once across restarts)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch.distributed as dist

from fourfold.config import FaultSection


def maybe_signal(fault: FaultSection, run_dir: str | Path, step: int) -> None:
    """Fault injection for the stop test: this rank sends itself a signal once, at the configured step."""
    marker = Path(run_dir) / ".signal-injected"
    if fault.signal_step == step and fault.signal_rank == dist.get_rank() and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.Signals[fault.signal])


def maybe_kill(fault: FaultSection, run_dir: str | Path, step: int) -> None:
    """Fault injection for the recovery test: this rank dies once, at the configured step."""
    marker = Path(run_dir) / ".fault-injected"
    if fault.kill_step == step and fault.kill_rank == dist.get_rank() and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
