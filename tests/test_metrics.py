"""The metrics writers' checks before launch and their pins (what they write: tests/test_trainer.py)."""

import sys
import tomllib
from pathlib import Path

import pytest

from fourfold.data import corpus
from fourfold.spec.trainconfig import ConfigError, load_train_config, validate
from fourfold.train import metrics


def test_wandb_asked_for_but_not_installed_fails_before_launch(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = load_train_config(None, ["--log.wandb_project", "my-project"])
    with pytest.raises(ConfigError, match=r"log.wandb_project needs the wandb package, which is not installed: "
                                          r"pip install wandb==0\.31\.0"):
        validate(cfg, 1)
    validate(load_train_config(None, []), 1)  # no project: no wandb needed


def test_pins_named_in_messages_are_pyproject_extras():
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["metrics"] == [metrics.TENSORBOARD]
    assert extras["wandb"] == [metrics.WANDB]
    assert extras["parquet"] == [corpus.PYARROW]
    assert {metrics.TENSORBOARD, corpus.PYARROW} <= set(extras["test"])
