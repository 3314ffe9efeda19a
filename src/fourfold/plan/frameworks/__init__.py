"""The framework profiles the planner prices a job under, by name (`--framework`). A third
profile is one new module here (a `Framework` subclass) and its instance in FRAMEWORKS."""

from fourfold.plan.frameworks.base import Framework
from fourfold.plan.frameworks.fourfold import FOURFOLD
from fourfold.plan.frameworks.megatron import MEGATRON

FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (FOURFOLD, MEGATRON)}


def named(name: str) -> Framework:
    """The profile called `name`, or a ValueError listing the profiles."""
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework profile {name!r}; the profiles: {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


__all__ = ["FOURFOLD", "FRAMEWORKS", "MEGATRON", "Framework", "named"]
