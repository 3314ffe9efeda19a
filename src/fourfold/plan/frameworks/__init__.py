"""The framework profiles the planner prices a job under, by name (`--framework`). A third
profile is one new module here (a `Framework` subclass) and its instance in FRAMEWORKS."""

from fourfold.plan.frameworks.base import CP_COMMS, Framework
from fourfold.plan.frameworks.fourfold import FOURFOLD
from fourfold.plan.frameworks.megatron import MEGATRON, Megatron

FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (FOURFOLD, MEGATRON)}


def named(name: str, cp_comm: str | None = None) -> Framework:
    """The profile called `name`, or a ValueError listing the profiles; `cp_comm` (CP_COMMS): its
    context-parallel exchange, where the framework has a choice (None: its own)."""
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework profile {name!r}; the profiles: {', '.join(FRAMEWORKS)}")
    profile = FRAMEWORKS[name]
    if cp_comm is None or cp_comm == profile.cp_comm:
        return profile
    if name != MEGATRON.name:
        raise ValueError(f"the {name} profile's context parallelism is its runtime's ring ({profile.cp_comm}): "
                         f"cp_comm {cp_comm} is Megatron-Core's; give --framework megatron, or leave --cp-comm out")
    return Megatron(cp_comm)


__all__ = ["CP_COMMS", "FOURFOLD", "FRAMEWORKS", "MEGATRON", "Framework", "Megatron", "named"]
