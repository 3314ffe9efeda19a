"""Elastic continuation (issue #39, item 3): a run of 8 ranks (dp4 x2) on two torchrun agents that
loses one is continued by torchrun's elastic rendezvous on the 4 ranks left: they take the first
usable grid of grid.fallbacks (dp2 x2), keep the global batch (2 micro-batches a replica, was 1),
reshard the latest checkpoint and go on in the data order; the losses equal those of a run started
on dp2 x2 from the same checkpoint bitwise, and the uninterrupted 8-rank run's to float32
rounding. A grid that fits none of the ranks is refused with the node count that would."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fourfold.config import ConfigError, load_train_config, validate
from fourfold.data import corpus
from fourfold.train.elastic import regrid
from runs import train_run

STEPS = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    text = folder / "kjv-genesis.txt"
    text.write_text(corpus.bundled_text()[:100_000])
    corpus.prepare(str(text), 512, str(folder / "cache"))
    return ["--data.text", str(text), "--data.vocab", "512", "--data.cache_dir", str(folder / "cache")]


def _options(run_dir, data, *extra):
    return [*data, "--log.run_dir", str(run_dir), "--log.progress", "false", "--log.every", "1",
            "--train.steps", str(STEPS), "--batch.global_batch", "8", "--batch.micro_batch", "2", "--batch.seq", "32",
            "--optimizer.warmup", "2", "--checkpoint.every", "2", "--checkpoint.keep", str(STEPS), *extra]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}, [r for r in records if "event" in r]


def _agent(run_dir, data, port: int, log):
    """One "node" of 4 ranks: torchrun's elastic agent (1 to 2 nodes, c10d rendezvous on this host)."""
    cmd = [sys.executable, "-m", "fourfold.train.launch", "--nnodes=1:2", "--nproc-per-node=4", "--max-restarts=3",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=elastic-test",
           "--rdzv-conf=join_timeout=120,last_call_timeout=5", "-m", "fourfold.cli.main", "train",
           *_options(run_dir, data, "--grid.dp", "4", "--grid.x", "2", "--grid.elastic", "true",
                     "--grid.fallbacks", "dp=8; dp=3; dp=2,x=2; dp=4")]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, ...
        except OSError:  # (gone meanwhile)
            continue
        if int(after_name[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent, then its ranks (torchrun starts each in a session of its own)."""
    ranks_of_agent = _children(agent.pid)
    agent.kill()
    for pid in ranks_of_agent:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def test_eight_ranks_continued_on_four_when_a_node_is_lost(ranks, data, tmp_path):
    """Two torchrun agents of 4 ranks each run dp4 x2; one "node" (its agent and ranks) is killed
    after a checkpoint. The other's torchrun restarts its ranks on a 4-rank rendezvous: they take
    dp2 x2 (dp=8 needs 8 ranks, dp=3 does not divide the batch) and resume from the latest checkpoint."""
    whole, elastic, fixed = (tmp_path / name for name in ("whole", "elastic", "fixed"))
    ranks.run(train_run, 8, _options(whole, data, "--grid.dp", "4", "--grid.x", "2"))
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    with open(tmp_path / "a.log", "w") as log_a, open(tmp_path / "b.log", "w") as log_b:
        first = _agent(elastic, data, port, log_a)
        time.sleep(1)  # (the first hosts the rendezvous)
        second = _agent(elastic, data, port, log_b)
        try:
            deadline = time.monotonic() + 300
            while not (elastic / "checkpoints" / "step-00000002").is_dir() and time.monotonic() < deadline:
                time.sleep(0.1)
            _kill_node(second)
            assert first.wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-3000:]
        finally:  # (a failed test leaves no agent behind)
            for agent in (first, second):
                if agent.poll() is None:
                    _kill_node(agent)
    said = (tmp_path / "a.log").read_text().splitlines()
    assert ("elastic: 4 ranks, not the grid's 8: grid dp=4,x=2 -> dp=2,x=2 (grid.fallbacks); the global batch stays "
            "8 sequences, 2 micro-batches of 2 a replica a step (was 1 of 2)") in said
    got, events = _losses(elastic)
    assert [(e["event"], e["grid"], e.get("grid_before")) for e in events] == [
        ("start", "dp=4,x=2", None), ("resume", "dp=2,x=2", "dp=4,x=2")]
    resumed = events[1]["step"]
    assert 2 <= resumed < STEPS and sorted(got) == list(range(STEPS))
    ranks.run(train_run, 4, _options(fixed, data, "--grid.dp", "2", "--grid.x", "2", "--checkpoint.load",
                                     events[1]["from"]))
    expected, _ = _losses(whole)
    same, _ = _losses(fixed)
    after = {s: got[s] for s in got if s >= resumed}
    assert after == same  # bitwise: the same grid from the same checkpoint
    assert got == pytest.approx(expected, rel=2e-5)  # another grid: float32 rounding
    meta = json.loads((elastic / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())
    assert meta["data_position"] == STEPS * 8  # the data order went on where the checkpoint left it


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
