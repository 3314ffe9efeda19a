"""The learning-rate schedule: linear warmup, then cosine decay to optimizer.min_lr at train.steps."""

from __future__ import annotations

import math

from fourfold.config import OptimizerSection


def learning_rate(o: OptimizerSection, steps: int, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr at the last of `steps`."""
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    progress = (step - o.warmup) / max(1, steps - o.warmup)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


SCHEDULE_KEYS = ("train.steps", "optimizer.lr", "optimizer.min_lr", "optimizer.warmup")


def schedule_changes(saved: dict, now: dict) -> list[str]:
    """The keys of the learning-rate schedule that differ between `saved` (the config a checkpoint
    was written with, as a dict) and `now`, as "key old -> new"."""
    out = []
    for key in SCHEDULE_KEYS:
        section, name = key.split(".")
        before, after = saved.get(section, {}).get(name), now[section][name]
        if before is not None and before != after:
            out.append(f"{key} {before} -> {after}")
    return out
