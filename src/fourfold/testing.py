"""Run a function on N gloo ranks from a test, without paying process start-up per test.

`RankPool` keeps up to `max_ranks` worker processes alive (importing torch costs seconds per
process; a fresh gloo world costs about 0.1 s). Each `run(fn, n, *args)` gives the first n workers
a fresh default process group of world size n, calls `fn(*args)` on each, tears the group down
and returns the per-rank results. A rank that raises makes `run` raise `RankFailure` carrying that
rank's traceback; ranks that do not answer within the timeout are killed and the pool restarts.

`fn` must be importable by name (a module-level function), as with any multiprocessing target.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class RankFailure(AssertionError):
    """One or more ranks raised or hung; the message holds their tracebacks."""


def _worker(index: int, store_port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 8 ranks share 2 cores; more threads only contend
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            return
        job, world, fn, args, path, timeout_s = task
        sys.path[:] = path
        try:
            dist.init_process_group(
                "gloo", store=dist.PrefixStore(f"job{job}", store), rank=index, world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
            dist.barrier()  # every rank connected before any can finish and tear its side down
            results.put((job, index, True, fn(*args)))
        except BaseException:  # report everything, including assertion failures, to the test
            results.put((job, index, False, traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()  # models hold their groups in reference cycles (hooks): free what can be
            # What survived (torch's and the tests' modules, mostly) is left out of the next
            # collections: a full one over torch's objects takes ~40 ms a rank, 8 ranks on 2 cores.
            gc.freeze()


class RankPool:
    def __init__(self, max_ranks: int = 8, timeout_s: float = 300.0, jobs_per_worker: int = 12,
                 preload: tuple[str, ...] = ()):
        self.max_ranks = max_ranks
        self.preload = ["torch", "torch.distributed", *preload]
        self.timeout_s = timeout_s
        # gloo groups of finished worlds are not all freed (their sockets stay connected and
        # their threads keep polling), so workers are replaced after this many jobs.
        self.jobs_per_worker = jobs_per_worker
        self._procs: list = []
        self._job = 0
        self._jobs_here = 0

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("forkserver")
        # The fork server imports torch (and `preload`) once; workers fork from it in a fraction of a
        # second, where each would take seconds to import them again after every restart.
        ctx.set_forkserver_preload(self.preload)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.max_ranks)]
        self._procs = [
            ctx.Process(target=_worker, args=(i, self._store.port, self._tasks[i], self._results), daemon=True)
            for i in range(self.max_ranks)
        ]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        for q, p in zip(self._tasks if self._procs else [], self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
            p.join()
        self._procs = []

    def run(self, fn: Callable[..., Any], nranks: int, *args: Any) -> list[Any]:
        if not 1 <= nranks <= self.max_ranks:
            raise ValueError(f"nranks={nranks} must be between 1 and the pool's {self.max_ranks}")
        if self._procs and self._jobs_here >= self.jobs_per_worker:
            self.close()
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self._kill()
            self._start()
            self._jobs_here = 0
        self._jobs_here += 1
        self._job += 1
        for i in range(nranks):
            self._tasks[i].put((self._job, nranks, fn, args, list(sys.path), self.timeout_s))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) + len(failures) < nranks:
            # After a failure the other ranks are likely stuck in a collective: give them a moment.
            wait = min(deadline, time.monotonic() + 5) if failures else deadline
            try:
                job, rank, ok, value = self._results.get(timeout=max(0.0, wait - time.monotonic()))
            except queue.Empty:
                break
            if job == self._job:
                (results if ok else failures)[rank] = value
        if failures or len(results) < nranks:
            self._kill()  # stragglers may hold a broken process group; start afresh next time
            hung = [r for r in range(nranks) if r not in results and r not in failures]
            parts = [f"rank {r} of {nranks} failed:\n{tb}" for r, tb in sorted(failures.items())]
            if hung:
                parts.append(f"ranks {hung} did not finish (killed after the failure or timeout)")
            raise RankFailure("\n".join(parts))
        return [results[r] for r in range(nranks)]


def eval_command(argv: list[str]) -> dict:
    """`fourfold eval ARGV` as each of its ranks computes it, in the process group that exists (run
    it on a pool's ranks: `pool.run(eval_command, n, argv)`) instead of under torchrun: the same
    parser, resolution of MODEL and checks before launch, then every rank's score."""
    from fourfold.cli import eval as evaluation
    from fourfold.cli.main import parser

    args = parser()[0].parse_args(["eval", *argv])
    layout = evaluation.resolve(args)
    evaluation.check_before_launch(args, layout)
    return evaluation.score(args, layout)
