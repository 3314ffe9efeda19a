"""Per-rank step timing (issue #39, item 1): each rank's compute and waits, gathered at each read
of the steps' numbers, a slowed rank named a straggler in the first report with its host, local
rank and place on the grid, and kept in summary.json."""

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fourfold.parallel.clock import KINDS
from fourfold.parallel.model import Model
from runs import prepared_corpus, train_run

SLOW_RANK, SLEEP = 2, 0.5


def _slowed(options: list[str]):
    """`fourfold train OPTIONS` with rank SLOW_RANK's compute slowed by a sleep in each step (the
    harness's: the product has no switch for it)."""
    original = Model.step

    def slow(self, *args):
        time.sleep(SLEEP)
        return original(self, *args)

    if dist.get_rank() == SLOW_RANK:
        Model.step = slow
    try:
        return train_run(options)
    finally:
        Model.step = original


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_corpus(tmp_path_factory.mktemp("data"), 100_000, 512)


@pytest.mark.parametrize("grid", [("--grid.dp", "2", "--grid.x", "2"), ("--grid.pp", "2", "--grid.dp", "2")])
def test_a_slowed_rank_is_named_in_the_first_report(ranks, data, tmp_path, grid):
    # (margin 1: the sleep is over it while the others' compute is under 0.5 s a step, on a loaded machine too)
    options = [*data, *grid, "--log.run_dir", str(tmp_path), "--log.progress", "false", "--log.every", "2",
               "--log.straggler_margin", "1",
               "--train.steps", "4", "--batch.global_batch", "8", "--batch.micro_batch", "2", "--batch.seq", "32",
               "--checkpoint.every", "0"]
    ranks.run(_slowed, 4, options)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    reports = [r for r in records if "timing_after_step" in r]
    assert [r["timing_after_step"] for r in reports] == [2, 4] and all(r["steps"] == 2 for r in reports)
    first = reports[0]
    assert first["stragglers"][0] == SLOW_RANK and first["slowest_rank"] == SLOW_RANK, first
    slow = first["slowest"][0]
    assert slow["rank"] == SLOW_RANK and slow["local_rank"] == SLOW_RANK and slow["host"]
    assert slow["compute"] > SLEEP and slow["over_median"] > first["straggler_margin"]
    coords = dict(part.split("=") for part in slow["grid"].split(","))
    assert set(coords) == {grid[0].removeprefix("--grid."), grid[2].removeprefix("--grid.")}
    for r in first["slowest"]:  # a rank's step is its compute and its waits
        assert r["step"] == pytest.approx(r["compute"] + sum(r[k] for k in KINDS), abs=1e-5)  # (rounded to 1 us)
    # the others wait for it: in the data-parallel reductions, the tensor group's, or the pipeline's
    waits = {r["rank"]: sum(r[k] for k in KINDS) for r in first["slowest"]}
    assert all(w > waits[SLOW_RANK] + SLEEP / 2 for rank, w in waits.items() if rank != SLOW_RANK), waits
    summary = json.loads((Path(tmp_path) / "summary.json").read_text())
    assert summary["slowest_ranks"][0]["rank"] == SLOW_RANK and summary["slowest_ranks"][0]["reports"] == 2


def test_cpu_ranks_sharing_cores_name_no_straggler(monkeypatch):
    """The trial's 8 CPU ranks on 2 cores named stragglers on every run: the scheduler, not a rank, is slow."""
    import os

    import torch

    from fourfold.train.timing import cores_shared

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
    assert cores_shared(torch.device("cpu")) and not cores_shared(torch.device("cuda"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert not cores_shared(torch.device("cpu"))
