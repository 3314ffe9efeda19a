"""Elastic continuation (issue #39, item 3): a run of 8 ranks (dp4 x2) continued by torchrun on 4
takes the first usable grid of grid.fallbacks (dp2 x2), keeps the global batch (2 micro-batches a
replica, was 1), reshards the checkpoint and goes on in the data order; its losses equal those of
a run started on dp2 x2 from the same checkpoint bitwise, and the uninterrupted 8-rank run's to
float32 rounding. A grid that fits none of the ranks is refused with the node count that would."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from fourfold.config import ConfigError, load_train_config, validate
from fourfold.train.elastic import regrid
from runs import prepared_corpus, train_run

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_corpus(tmp_path_factory.mktemp("data"), 100_000, 512)


def _options(run_dir, data, *extra):
    return [*data, "--log.run_dir", str(run_dir), "--log.progress", "false", "--log.every", "1",
            "--train.steps", str(STEPS), "--batch.global_batch", "8", "--batch.micro_batch", "2", "--batch.seq", "32",
            "--optimizer.warmup", "2", "--checkpoint.every", "3", *extra]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}, [r for r in records if "event" in r]


def test_eight_ranks_continued_on_four(ranks, data, tmp_path):
    whole, elastic, fixed = (tmp_path / name for name in ("whole", "elastic", "fixed"))
    ranks.run(train_run, 8, _options(whole, data, "--grid.dp", "4", "--grid.x", "2"))
    step3 = whole / "checkpoints" / "step-00000003"
    shutil.copytree(step3, elastic / "checkpoints" / "step-00000003")
    # dp=8 needs 8 ranks, dp=3,x=... does not divide the batch: the first that runs on 4 is dp=2,x=2
    cmd = [sys.executable, "-m", "fourfold.cli.main", "train", "--nproc-per-node", "4",
           *_options(elastic, data, "--grid.dp", "4", "--grid.x", "2", "--grid.elastic", "true",
                     "--grid.fallbacks", "dp=8; dp=3; dp=2,x=2; dp=4")]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("elastic: 4 ranks, not the grid's 8: grid dp=4,x=2 -> dp=2,x=2 (grid.fallbacks); the global batch stays "
            "8 sequences, 2 micro-batches of 2 a replica a step (was 1 of 2)") in done.stdout.splitlines()
    ranks.run(train_run, 4, _options(fixed, data, "--grid.dp", "2", "--grid.x", "2", "--checkpoint.load", str(step3)))
    expected, _ = _losses(whole)
    got, events = _losses(elastic)
    same, _ = _losses(fixed)
    assert list(got) == [3, 4, 5] and got == same  # bitwise: the same grid from the same checkpoint
    assert got == pytest.approx({s: expected[s] for s in got}, rel=2e-5)  # another grid: float32 rounding
    assert [(e["event"], e["step"], e["grid"], e.get("grid_before")) for e in events] == [
        ("resume", 3, "dp=2,x=2", "dp=4,x=2")]
    meta = json.loads((elastic / "checkpoints" / "step-00000006" / "meta.json").read_text())
    assert meta["data_position"] == 6 * 8  # the data order went on from sequence 24


def test_ranks_that_fit_no_grid_are_refused_with_the_node_count_that_would(data, tmp_path):
    cfg = load_train_config(None, _options(tmp_path, data, "--grid.dp", "4", "--grid.x", "2", "--grid.elastic", "true",
                                           "--grid.fallbacks", "dp=4,x=2; dp=2,x=2"))
    with pytest.raises(ConfigError, match=r"6 ranks \(3 nodes of 2\) fit none of grid.fallbacks \(dp=4,x=2: 8 ranks; "
                                          r"dp=2,x=2: 4 ranks\); the smallest node count that runs one is 2 \(4 "
                                          r"ranks: dp=2,x=2\)"):
        regrid(cfg, 6, 2)
    # a grid of the right size that the run cannot use says why
    odd = load_train_config(None, _options(tmp_path, data, "--grid.dp", "4", "--grid.x", "2", "--grid.elastic", "true",
                                           "--grid.fallbacks", "dp=3,x=2"))
    with pytest.raises(ConfigError, match=r"fit none of grid.fallbacks \(dp=3,x=2: batch.global_batch=8 must be a "
                                          r"multiple of dp\*micro_batch"):
        regrid(odd, 6, 2)
    with pytest.raises(ConfigError, match="grid.fallbacks: 'q=2' in 'q=2' is not DIM=N"):
        validate(load_train_config(None, ["--grid.elastic", "true", "--grid.fallbacks", "q=2"]), 1)
    with pytest.raises(ConfigError, match="grid.fallbacks is given but grid.elastic is off"):
        validate(load_train_config(None, ["--grid.fallbacks", "dp=2"]), 1)
    assert regrid(cfg, 8, 2) == (cfg, None)  # the grid's own rank count: nothing changes
    planned, line = regrid(load_train_config(None, _options(tmp_path, data, "--grid.dp", "4", "--grid.elastic",
                                                            "true")), 2, 2)
    assert planned.layout().world_size == 2 and "(the planner's best on" in line
