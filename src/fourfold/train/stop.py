"""A run's stop on a signal: agreed by every rank, so that all stop after the same step, and the
one line that says where it stopped and how to go on."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from fourfold import checkpoint
from fourfold.config import TrainConfig
from fourfold.parallel import comm
from fourfold.train.launch import StopRequest


class StopAgreement:
    """The strongest signal any rank got (SIGTERM > SIGINT, by number), agreed on so that every
    rank stops after the same step whichever ranks the signal reached. Host to host and one step
    behind: each step starts the all-reduce of the flags as they are then, and reads the one the
    previous step started, long finished, so no step waits for it, nor for the GPU."""

    def __init__(self, stop: StopRequest):
        self.stop, self.group, self._pending = stop, comm.host_group(), None

    def poll(self) -> signal.Signals | None:
        agreed = self.finish()
        flag = torch.tensor([self.stop.received])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return signal.Signals(agreed) if agreed else None

    def finish(self) -> int:
        """The agreed flag of the all-reduce in flight (0 if none); nothing is in flight after."""
        if self._pending is None:
            return 0
        (work, flag), self._pending = self._pending, None
        work.wait()
        return int(flag.item())


def stop_message(cfg: TrainConfig, stopped: signal.Signals, done: int) -> str:
    """The one line about a run stopped by a signal: the last checkpoint and how to resume."""
    said = f"stopped by {stopped.name} after {done} of {cfg.train.steps} steps"
    if stopped == signal.SIGINT:
        said += " (SIGINT does not save; SIGTERM does)"
    last = checkpoint.latest(cfg.checkpoint_dir)
    if last is None:
        return f"{said}; no checkpoint yet: the same command starts over"
    how = (f"resume with --checkpoint.load {last}" if cfg.checkpoint.load or not cfg.checkpoint.resume
           else "run the same command again to resume from it")
    return f"{said}; last checkpoint {last}: {how}"
