"""Every job the rules accept on up to 8 ranks (a spread of them; FOURFOLD_ALL_GRIDS=1: all) builds
and trains a step, through the runtime's Model and batch split."""

import math
import os

import numpy as np
import pytest

from jobs import MODELS, accepted_jobs


def _train_one_step(cases):
    """A training step of each (model, job) on this world, through the trainer's Model and batch split."""
    import torch

    from fourfold.parallel.data import GradientSync
    from fourfold.parallel.grid import Grid
    from fourfold.parallel.model import Model, local_batch
    from fourfold.parallel.optimizer import AdamW
    from fourfold.parallel.tensor.block import torch_dtype

    losses = []
    for name, job in cases:
        grid = Grid(job.layout)
        model = Model(grid, job, MODELS[name], dtype=torch_dtype(job.precision, grid.device))
        opt = AdamW(GradientSync(model.module, grid), lr=1e-3)
        rows = job.global_batch // job.layout.dp
        ids = np.random.default_rng(0).integers(0, MODELS[name].vocab, (rows, job.seq + 1))
        loss = model.step(local_batch(job, grid, ids), opt.sync, 1.0 / (job.global_batch * job.seq))
        opt.step()
        total = loss.clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
    return losses


def _sample(accepted, per_model: int = 4):
    """Every accepted job when FOURFOLD_ALL_GRIDS=1 (about 200, over ten minutes on 2 cores);
    otherwise a fixed spread: per model, jobs using the most dims at once, each set of dims once."""
    if os.environ.get("FOURFOLD_ALL_GRIDS") == "1":
        return accepted
    out = []
    richest_first = sorted(accepted, key=lambda a: -sum(n > 1 for n in a[1].layout.sizes.values()))
    for name in MODELS:
        seen = set()
        for model, job in richest_first:
            kind = tuple(d for d, n in job.layout.sizes.items() if n > 1)
            if model == name and kind not in seen and len(seen) < per_model:
                seen.add(kind)
                out.append((model, job))
    return out


def test_every_accepted_job_up_to_8_ranks_trains_a_step(ranks):
    for name, job in _sample(accepted_jobs()[0]):
        # one job per world, as in a real run (one Grid per process)
        loss = ranks.run(_train_one_step, job.layout.world_size, [(name, job)])[0][0]
        # each token's loss is held by its x*y tensor ranks (on the last stage): the mean loss
        # of a fresh model, about ln(vocab)
        assert math.isfinite(loss), (name, str(job))
        expected = pytest.approx(math.log(MODELS[name].vocab), rel=0.05)
        assert loss / job.layout.size(("x", "y")) == expected, (name, str(job))
