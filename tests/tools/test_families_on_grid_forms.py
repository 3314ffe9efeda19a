"""Every family on grid forms covering every pair of dims its rules accept: none fails in its first step.

A grid's form is the set of its dims above 1 (dp, pp, cp, x, y, z, and ep for a mixture). For each
family (tests/tiny_models.py) a few jobs of up to 8 ranks, each dim 2, are chosen so that every pair of
dims the rules accept together runs together in one of them (the parallel pieces meet in pairs: the
trial's crash was GPT-OSS's expert biases under ep with x), with sequence parallelism and recompute
alternating; one rank of each (the last: the last pipeline stage, the highest coordinates) runs a
training step under fake tensors as `fourfold simulate` runs it. A pair the rules refuse is refused
in one line that names the fix. FOURFOLD_ALL_GRIDS=1 runs every accepted
form of up to 8 ranks instead (each dim 2: at most three rank dims, and ep)."""

import itertools
import os

import pytest

from fourfold.models.config import ModelConfig
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import problems
from fourfold.tools.simulate import train_step
from jobs import FIXES
from tiny_models import TINY

RANK_DIMS = ("dp", "pp", "cp", "x", "y", "z")


def _job(cfg: ModelConfig, dims: tuple[str, ...], n: int) -> Job:
    """A job of these dims at 2 each (ep 2 rides on dp or cp), the options alternating with `n`."""
    sizes = {d: 2 for d in dims}
    layout = Layout(**sizes)
    return Job(layout, micro_batch=2 * layout.z, global_batch=4 * layout.z * layout.dp, seq=16,
               seq_parallel=n % 2 == 0, recompute=("none", "selective", "full")[n % 3], precision="bf16")


def _forms(cfg: ModelConfig) -> tuple[list[tuple[str, ...]], dict[frozenset, list]]:
    """(the forms to run: greedily, the fewest covering every accepted pair of dims; the pairs no
    accepted job has, with the problems of the smallest job of each)."""
    dims = RANK_DIMS + (("ep",) if cfg.experts else ())
    candidates = [f for r in (3, 4) for f in itertools.combinations(dims, r)
                  if sum(d != "ep" for d in f) == 3 and ("ep" not in f or {"dp", "cp"} & set(f))]
    accepted = [f for f in candidates if not problems(cfg, _job(cfg, f, 0), gpu=True)]
    pairs = {frozenset(p) for p in itertools.combinations(dims, 2)}
    covered = {frozenset(p) for f in accepted for p in itertools.combinations(f, 2)}
    refused = {}
    for pair in pairs - covered:  # no accepted job has it: the smallest job of it is refused, naming the fix
        form = tuple(sorted(pair | ({"dp"} if "ep" in pair and not {"dp", "cp"} & pair else set())))
        refused[pair] = problems(cfg, _job(cfg, form, 0), gpu=True)
    if os.environ.get("FOURFOLD_ALL_GRIDS") == "1":  # every accepted form of 1 to 3 dims (a few minutes a family)
        smaller = [f for r in range(1, 5) for f in itertools.combinations(dims, r) if sum(d != "ep" for d in f) < 3
                   and ("ep" not in f or {"dp", "cp"} & set(f)) and not problems(cfg, _job(cfg, f, 0), gpu=True)]
        return smaller + accepted, refused
    return _fewest_covering(accepted, covered), refused


def _fewest_covering(forms: list[tuple[str, ...]], pairs: set[frozenset]) -> list[tuple[str, ...]]:
    """The fewest forms holding every pair of `pairs` (a depth-first search, deepening: 6 forms a family
    here, where a greedy cover takes 7)."""
    holds = {f: {frozenset(p) for p in itertools.combinations(f, 2)} & pairs for f in forms}
    most = max(map(len, holds.values()))

    def cover(left: set[frozenset], k: int) -> list[tuple[str, ...]] | None:
        if not left:
            return []
        if len(left) > most * k:
            return None
        pair = min(left, key=lambda p: sum(p in h for h in holds.values()))  # the hardest pair first
        for f in (f for f in forms if pair in holds[f]):
            rest = cover(left - holds[f], k - 1)
            if rest is not None:
                return [f, *rest]
        return None

    return next(found for k in range(1, len(forms) + 1) if (found := cover(set(pairs), k)) is not None)


@pytest.mark.parametrize("family", TINY)
def test_every_grid_form_the_rules_accept_trains_a_step(family):
    cfg = ModelConfig.from_hf(TINY[family])
    forms, refused = _forms(cfg)
    for pair, found in refused.items():
        assert found and all(p.fix.startswith(FIXES) and "\n" not in str(p) for p in found), (family, pair, found)
    for n, form in enumerate(forms):
        job = _job(cfg, form, n)
        try:
            train_step(cfg, job, rank=job.world_size - 1)
        except Exception as e:  # the job and the failure, not only a traceback
            raise AssertionError(f"{family} on {job.layout} ({job.recompute} recompute, sequence parallel "
                                 f"{job.seq_parallel}): {type(e).__name__}: {e}") from e
