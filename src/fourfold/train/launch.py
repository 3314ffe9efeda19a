"""Start a fourfold command on N local processes through torchrun (one node).

`python -m fourfold.train.launch TORCHRUN-ARGS` is torchrun that stops quietly on a signal: torchrun
passes SIGINT/SIGTERM to every rank (whose `StopRequest` notes it: each finishes its step, agrees
with the others to stop, and rank 0 says so in one line; fourfold.train.trainer), then exits with 128 +
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


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # the ones torchrun stops on


def relaunch_with_torchrun(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m fourfold.cli.main ARGV` on `nproc` ranks with torchrun (which restarts every rank
    up to `max_restarts` times when one fails); returns its exit code, or 128 + the signal after
    one stopped it. torchrun runs in a process group of its own, so that a signal reaches it once,
    passed on from here, whether a terminal's Ctrl-C sent it to this group or `kill` (a
    scheduler, a user) to this process alone (which torchrun would not have seen)."""
    cmd = [
        sys.executable, "-m", "fourfold.train.launch", "--standalone", f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}", "-m", "fourfold.cli.main", *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # many ranks on few cores: one thread each
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    received: list[int] = []
    torchrun = None

    def forward(signum: int, frame) -> None:
        received.append(signum)
        if torchrun is not None:
            torchrun.send_signal(signum)

    previous = {s: signal.getsignal(s) for s in FORWARDED}
    for s in FORWARDED:  # before torchrun starts: no signal may find the default handler meanwhile
        signal.signal(s, forward)
    try:
        torchrun = subprocess.Popen(cmd, env=env, process_group=0)
        if received:  # one came while it started
            torchrun.send_signal(received[0])
        code = torchrun.wait()  # (interrupted by a forwarded signal, the wait goes on: PEP 475)
        return 128 + received[0] if received else code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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


# What a rank's collective raises when a peer rank died (gloo's socket, NCCL's abort and remote error).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
             "remote process exited")


def peer_lost(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank died: that rank's own message (or
    torchrun's line for it) says why; this one needs no traceback."""
    while err is not None:  # (pipelining wraps a stage's error in a RuntimeError of its own)
        if isinstance(err, RuntimeError) and any(s in str(err) for s in PEER_LOST):
            return True
        err = err.__cause__ or err.__context__
    return False


def _how_it_ended(exitcode: int) -> str:
    """A rank's end as torchrun reports its exit code: "signal NAME" (negative) or "exit code N"."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:  # a real-time signal has no name
        return f"signal {-exitcode}"


class _Quiet(logging.Filter):
    """Drops torchrun's warnings that it got a signal and passes it to each rank, and turns its error
    for a failed rank (a multi-line record, before a restart too) into one line naming the rank and how
    it ended (after the last attempt the launcher's `failed_ranks` names every one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("failed (exitcode: %s) local_rank: %s (pid: %s) of binary"):
            code, local_rank = record.args[:2]
            print(f"fourfold: local rank {local_rank} failed ({_how_it_ended(code)})", file=sys.stderr, flush=True)
            return False
        return not str(record.msg).startswith(("Received %s death signal", "Sending process %s closing signal",
                                               "failed (exitcode: %s)"))


def torchrun() -> int:
    """torchrun's command line (sys.argv), returning 128 + the signal that stopped it."""
    _stop_with_the_launcher()
    try:
        return _torchrun()
    except KeyboardInterrupt:  # before torchrun handles signals (importing torch, rendezvous): no rank started
        print("fourfold: interrupted before the ranks started", file=sys.stderr)
        return 128 + signal.SIGINT


def _stop_with_the_launcher() -> None:
    """A SIGTERM for this torchrun (and so its ranks) when the launching process dies without
    passing a signal on (SIGKILL, a crash): in a process group of its own, nothing else tells it
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher died before that took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _torchrun() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_Quiet())
    try:
        main()
    except SignalException as e:
        return 128 + e.sigval
    except ChildFailedError as e:  # the ranks said why on their own output: one line here, not a traceback
        print(f"fourfold: {failed_ranks(e.failures)}", file=sys.stderr)
        return 1
    return 0


def failed_ranks(failures: dict) -> str:
    """One line for torchrun's failed ranks ({rank: ProcessFailure}): which ranks, and how each ended."""
    how = [f"rank {rank} ({_how_it_ended(f.exitcode)})" for rank, f in sorted(failures.items())]
    return f"{len(how)} rank{'s' * (len(how) > 1)} failed: {', '.join(how)}; each one's own message is above"


if __name__ == "__main__":
    sys.exit(torchrun())
