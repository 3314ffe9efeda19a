"""Training checkpoints with torch.distributed.checkpoint (DCP), in the serial model's names.

Every tensor is stored under its serial name ("model/layers.0.attn.q", "optim/m/...") with its
full shape, so a checkpoint loads onto any grid: each rank reads what its shards need. Ranks
holding the same tensor (replicas over dp, the tensor-grid peers after the gather) offer it
under the same key and DCP writes it once. The cost is that each tensor is gathered whole on
the ranks of its stage while saving.

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

from fourfold.optimizer import AdamW
from fourfold.tensor.params import dict_reader, full_weights, load

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


def state_dict(module: nn.Module, opt: AdamW | None) -> dict[str, torch.Tensor]:
    """Serial-named tensors of the model (and of the optimizer, once it has state)."""
    out = {f"model/{k}": v for k, v in full_weights(module).items()}
    if opt is not None and opt.state:
        per_param = opt.per_param_state()
        for kind, tensors in per_param.items():
            out.update({f"optim/{kind}/{k}": v for k, v in full_weights(module, pick=lambda p: tensors[id(p)]).items()})
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
    dcp.save(state_dict(module, opt), checkpoint_id=partial)
    dist.barrier()
    if rank == 0:
        for name, source in (files or {}).items():
            shutil.copyfile(source, partial / name)
        tmp = partial / (META + ".tmp")
        tmp.write_text(json.dumps(dict(meta, step=step, optimizer_steps=opt.step_count if opt else 0), indent=1))
        os.replace(tmp, partial / META)
        if final.exists():  # the same step saved before a restart: that copy is complete already
            shutil.rmtree(partial)
        else:
            os.replace(partial, final)
        for old in complete(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not (path / META).is_file():
        raise CheckpointError(f"{path} is not a complete fourfold checkpoint (no {META}); give a step-N directory "
                              f"written by `fourfold train`")
    return json.loads((path / META).read_text())


def _blocks_read(module: nn.Module) -> dict[str, tuple[int, int | None]]:
    """The serial tensors this rank's parameters are read from, with the extent read (rows, cols)."""
    extent: dict[str, tuple[int, int | None]] = {}

    def record(name, rows, cols):
        r, c = extent.get(name, (0, None))
        extent[name] = (max(r, rows.stop), None if cols is None else max(c or 0, cols.stop))
        return torch.zeros(rows.stop - rows.start, *(() if cols is None else (cols.stop - cols.start,)))

    load(module, record, put=lambda p, value: None)
    return extent


def load_checkpoint(path: str | Path, module: nn.Module, opt: AdamW | None = None) -> dict:
    """Set the model (and the optimizer's state, applied at its next step) from a checkpoint
    written on any grid; returns its meta."""
    path = Path(path)
    meta = read_meta(path)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    kinds = ["model"] + ([f"optim/{k}" for k in AdamW.STATE] if opt is not None and meta.get("optimizer_steps") else [])
    state = {}
    for name, (rows, cols) in _blocks_read(module).items():
        for kind in kinds:
            key = f"{kind}/{name}"
            if key not in saved:
                raise CheckpointError(f"{path} has no tensor {key!r}: it was written for a different model")
            shape = tuple(saved[key].size)
            if rows > shape[0] or (cols is not None and (len(shape) < 2 or cols > shape[1])):
                raise CheckpointError(f"{path}: {key} has shape {shape}, smaller than this model's; load it into the "
                                      f"model config it was trained with")
            state[key] = torch.empty(shape, dtype=saved[key].properties.dtype)
    dcp.load(state, checkpoint_id=str(path))
    model = {k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")}
    load(module, dict_reader(model))
    if len(kinds) > 1:
        restored: dict[str, dict[int, torch.Tensor]] = {}
        for kind in AdamW.STATE:
            prefix = f"optim/{kind}/"
            tensors = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            restored[kind] = {}
            load(module, dict_reader(tensors), put=lambda p, value, into=restored[kind]: into.__setitem__(id(p), value))
        opt.restore(restored, meta["optimizer_steps"])
    return meta
