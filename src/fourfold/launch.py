"""Start a fourfold command on N local processes through torchrun (one node).

`python -m fourfold.launch TORCHRUN-ARGS` is torchrun that stops quietly on a signal: torchrun
passes SIGINT/SIGTERM to every rank (whose `StopRequest` notes it: each finishes its step, agrees
with the others to stop, and rank 0 says so in one line; fourfold.trainer), then exits with 128 +
the signal instead of printing its SignalException traceback and a warning per rank.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

# Time torchrun gives the ranks to finish their step (and, on SIGTERM, save) before it kills them.
SHUTDOWN_TIMEOUT_S = 300


def inside_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_with_torchrun(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m fourfold.cli ARGV` on `nproc` ranks with torchrun (which restarts every rank
    up to `max_restarts` times when one fails); returns its exit code, or 130 after a Ctrl-C. A
    SIGTERM sent to this process is passed on to torchrun (and so to the ranks)."""
    cmd = [
        sys.executable, "-m", "fourfold.launch", "--standalone", f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}", "-m", "fourfold.cli", *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # many ranks on few cores: one thread each
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    torchrun = subprocess.Popen(cmd, env=env)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: torchrun.send_signal(signum))
    try:
        return _wait(torchrun)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait(torchrun: subprocess.Popen) -> int:
    """torchrun's exit code. A Ctrl-C reaches torchrun too (same process group), which passes it to
    the ranks: wait for them to stop rather than leave them running, and return 130."""
    interrupted = False
    while True:
        try:
            code = torchrun.wait()
            return 128 + signal.SIGINT if interrupted else code
        except KeyboardInterrupt:
            interrupted = True


class StopRequest:
    """Notes SIGINT and SIGTERM on a rank instead of raising: the training loop reads `received` (the
    highest signal number noted) at its next step boundary. `restore()` puts the previous handlers back."""

    def __init__(self):
        self.received = 0
        self._previous = {s: signal.signal(s, self._note) for s in (signal.SIGINT, signal.SIGTERM)}

    def _note(self, signum: int, frame) -> None:
        self.received = max(self.received, signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class _QuietOnSignal(logging.Filter):
    """Drops torchrun's warnings that it got a signal and passes it to each rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Received %s death signal", "Sending process %s closing signal"))


def torchrun() -> int:
    """torchrun's command line (sys.argv), returning 128 + the signal that stopped it."""
    try:
        return _torchrun()
    except KeyboardInterrupt:  # before torchrun handles signals (importing torch, rendezvous): no rank started
        print("fourfold: interrupted before the ranks started", file=sys.stderr)
        return 128 + signal.SIGINT


def _torchrun() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_QuietOnSignal())
    try:
        main()
    except SignalException as e:
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(torchrun())
