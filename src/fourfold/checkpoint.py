"""Training checkpoints with torch.distributed.checkpoint (DCP), in the serial model's names.

Every tensor is stored under its serial name ("model/layers.0.attn.q", "optim/m/...") and full
shape, written in pieces: each rank writes only the rectangles of it that it holds (its z piece of
its (x, y) block, its ZeRO-1 slice of master/m/v: `fourfold.sharded_io`), straight from its own
tensors; replicas offer identical rectangles and DCP writes them once. Loading onto any grid reads,
on each rank, only the rectangles it holds, into its own tensors.

A save goes to `.step-N.partial/` and is renamed to `step-N/` only after every rank finished
and `meta.json` (step, data position, config) is written; older checkpoints beyond `keep` are
removed after that. A crash during a save therefore leaves the previous checkpoint intact, and
`latest()` never returns a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from fourfold.optimizer import AdamW
from fourfold.sharded_io import Rectangle, RectangleLoadPlanner, RectangleSavePlanner, ShardError, rectangles
from fourfold.tensor import params

META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / META).is_file())


def latest(root: str | Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None


def local_rectangles(module: nn.Module, opt: AdamW | None, *, model: bool = True) -> list[Rectangle]:
    """The serial rectangles this rank holds: of its parameters ("model/NAME", with `model`) and of
    its ZeRO-1 slices of the optimizer state ("optim/master|m|v/NAME", once it has state). Views of
    the local tensors: nothing is copied or gathered."""
    layouts = params.layouts(module)
    out = []
    if model:
        for p, layout in layouts.items():
            out += rectangles(layout, p.detach().reshape(-1), prefix="model/")
    if opt is not None and opt.state:
        for bucket, state in zip(opt.sync.buckets, opt.state):
            # each parameter's part of this rank's slice of the bucket
            for p, a, b, at in bucket.segments(*bucket.shard_range(opt.sync.shard)):
                for kind in AdamW.STATE:
                    out += rectangles(layouts[p], state[kind][at : at + b - a], lo=a, prefix=f"optim/{kind}/")
    return out


def save(root: str | Path, step: int, module: nn.Module, opt: AdamW | None, meta: dict, keep: int,
         files: dict[str, Path] | None = None) -> Path:
    """Write checkpoint `step` (collective: every rank calls it) and return its directory; `files`
    (name -> path, e.g. the tokenizer) are copied in so that the checkpoint stands alone."""
    root = Path(root)
    final, partial = _step_dir(root, step), root / f".step-{step:08d}.partial"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
    dist.barrier()
    dcp.save({}, checkpoint_id=partial, planner=RectangleSavePlanner(local_rectangles(module, opt)))
    dist.barrier()
    if rank == 0:
        for name, source in (files or {}).items():
            shutil.copyfile(source, partial / name)
        tmp = partial / (META + ".tmp")
        tmp.write_text(json.dumps(dict(meta, step=step, optimizer_steps=opt.step_count if opt else 0), indent=1))
        os.replace(tmp, partial / META)
        if final.exists():  # a run resumed from an earlier step reached this one again: the new copy wins
            stale = root / f".step-{step:08d}.replaced"
            os.replace(final, stale)
            os.replace(partial, final)
            shutil.rmtree(stale)
        else:
            os.replace(partial, final)
        # keep the last K up to this step; later ones (from a run this one resumed before) are left alone
        up_to_now = [c for c in complete(root) if c.name <= final.name]
        for old in up_to_now[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not (path / META).is_file():
        raise CheckpointError(f"{path} is not a complete fourfold checkpoint (no {META}); give a step-N directory "
                              f"written by `fourfold train`")
    return json.loads((path / META).read_text())


def _read(path: Path, rects: list[Rectangle]) -> None:
    try:
        dcp.load({}, checkpoint_id=str(path), planner=RectangleLoadPlanner(rects))
    except ShardError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except CheckpointException as e:  # raised on every rank for a failure on any
        failures = [error for error, _ in e.failures.values() if isinstance(error, ShardError)]
        if failures:
            raise CheckpointError(f"{path}: {failures[0]}") from None
        raise


def load_checkpoint(path: str | Path, module: nn.Module, opt: AdamW | None = None) -> dict:
    """Set the model (and the optimizer's state, read at its first step, once its buckets are
    traced) from a checkpoint written on any grid: each rank reads only the rectangles it holds,
    into its own tensors; returns the checkpoint's meta."""
    path = Path(path)
    meta = read_meta(path)
    with torch.no_grad():
        _read(path, local_rectangles(module, None))
    if opt is not None and meta.get("optimizer_steps"):
        opt.restore(lambda: _read(path, local_rectangles(module, opt, model=False)), meta["optimizer_steps"])
    return meta
