"""Hugging Face checkpoints (config.json + safetensors, as `save_pretrained` writes them): import
into any grid, each rank reading only the blocks it owns (export back: `fourfold.checkpoint.export`, from a
checkpoint).

Every loader asks a `Reader` for a slice of a *serial* tensor by fourfold's name; the reader
maps the name to the checkpoint's tensor (transposing GPT-2's Conv1D weights, cutting its fused
c_attn) and reads just that slice through safetensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from fourfold.checkpoint import META, CheckpointError, latest
from fourfold.models.config import ModelConfig
from fourfold.models.family import HFTensor
from fourfold.parallel import comm
from fourfold.parallel.tensor.params import (
    Read,
    Replicas,
    assigned_by_group,
    buffer_layouts,
    copy_into,
    layouts,
    load,
    parallel_layers,
)


def _tensor_files(directory: Path) -> dict[str, Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {name: directory / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{directory} has neither model.safetensors nor model.safetensors.index.json; "
                              "save the model with save_pretrained(..., safe_serialization=True)")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def check_weights(directory: str | os.PathLike) -> None:
    """That a Hugging Face directory holds its weights: model.safetensors, or every file its index
    names (raises CheckpointError naming what is missing), checked before a run starts from it."""
    directory = Path(directory).expanduser()
    missing = sorted({f.name for f in _tensor_files(directory).values() if not f.is_file()})
    if missing:
        raise CheckpointError(f"{directory}: model.safetensors.index.json names {', '.join(missing)}, which "
                              f"{'is' if len(missing) == 1 else 'are'} not there; copy the whole model directory")


def checkpoint_reader(directory: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype) -> Read:
    """A `Read` over a Hugging Face checkpoint directory; checks that every tensor the model needs
    is there before any is read (on every rank alike: with shared reading a rank reads only some),
    and shapes as it reads."""
    directory = Path(directory)
    files = _tensor_files(directory)
    missing = sorted(set(hf_sources(cfg)) - set(files))
    if missing:
        raise CheckpointError(f"{directory} has no tensor {missing[0]!r} ({len(missing)} missing): the checkpoint does "
                              f"not match config ({cfg.family}, {cfg.layers} layers, tied={cfg.tied})")
    handles: dict[Path, object] = {}

    def sliced(name: str):
        if name not in files:
            raise CheckpointError(f"{directory} has no tensor {name!r}: the checkpoint does not match config "
                                  f"({cfg.family}, {cfg.layers} layers, tied={cfg.tied})")
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, "pt")
        return handles[path].get_slice(name)

    tensors = cfg.family_spec().tensors(cfg)

    def read(name, rows, cols):
        where = tensors[name]
        t, lead, step = sliced(where.name), () if where.expert is None else (where.expert,), where.stride
        # the contiguous span of the tensor's rows holding ours (every step-th of it)
        span = slice(where.offset + rows.start * step, where.offset + (rows.stop - 1) * step + 1)
        if cols is None:
            return t[lead + (span,)][::step].to(dtype)
        if not where.conv1d:
            return t[lead + (span, cols)][::step].to(dtype)
        return t[lead + (cols, span)][:, ::step].T.to(dtype)

    return read


def model_directory(path: str | os.PathLike) -> tuple[Path, bool]:
    """(the directory to load, whether it is a Hugging Face one) for a fourfold checkpoint (a step-N
    directory, or a run's checkpoint directory: its latest) or a directory save_pretrained wrote."""
    path = Path(path)
    step = path if (path / META).is_file() else latest(path)
    if step:
        return step, False
    if (path / "config.json").is_file():
        return path, True
    raise CheckpointError(f"{path} is neither a fourfold checkpoint ({META}) nor a Hugging Face directory "
                          "(config.json); give a step-N directory, a run's checkpoint directory, or the directory "
                          "save_pretrained wrote")


def _check_config(directory: Path, cfg: ModelConfig) -> None:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json; pass the directory save_pretrained wrote")
    theirs = ModelConfig.from_hf(json.loads(path.read_text()))
    if theirs != cfg:
        diffs = [f"{k}: checkpoint {getattr(theirs, k)} vs model {getattr(cfg, k)}"
                 for k in cfg.__dataclass_fields__ if getattr(theirs, k) != getattr(cfg, k)]
        raise CheckpointError(f"checkpoint {directory} does not match the model config: {'; '.join(diffs)}")


def load_hf(model: nn.Module, directory: str | os.PathLike, replicas: Replicas | None = None) -> None:
    """Fill a fourfold `Transformer` (on any grid) from a Hugging Face checkpoint directory.
    `replicas`: the ranks holding the same parameters (the trainer's dp*cp; an expert's replicas). Each reads
    the layers assigned to it (whole ones, balanced by size) and the group sums each parameter
    into every rank (the others give zeros: exact), so the files are read once per
    model-parallel part, not once per replica."""
    directory = Path(directory)
    _check_config(directory, model.cfg)
    dtype = next(model.parameters()).dtype
    read = checkpoint_reader(directory, model.cfg, dtype)
    if replicas is None or not replicas.shared:
        load(model, read)
        return
    layers, expert = parallel_layers(model), layouts(model)
    is_expert = [any(expert[p].expert for p in layer.parameters() if p in expert) for layer in layers]
    mine = assigned_by_group([(sum(p.numel() for p in layer.parameters()), e) for layer, e in zip(layers, is_expert)],
                             replicas)
    owners: dict[nn.Parameter, int] = {}  # a parameter's first layer (a tied weight has two) gives it
    for i, layer in enumerate(layers):
        if i in mine:
            layer.load(read, copy_into)
        for p in layer.parameters():
            owners.setdefault(p, i)
    with torch.no_grad():
        for p, i in owners.items():
            if i not in mine:
                p.zero_()
            comm.all_reduce(p.data, replicas.experts if is_expert[i] else replicas.dense)
        for i, layer in enumerate(layers):  # checkpointed buffers (a balancing bias) as the parameters
            for b in buffer_layouts(layer):
                if i not in mine:
                    b.zero_()
                comm.all_reduce(b, replicas.experts if is_expert[i] else replicas.dense)


def hf_sources(cfg: ModelConfig) -> dict[str, list[tuple[str, HFTensor]]]:
    """transformers name -> the fourfold tensors it is made of, each (name, where it lies in it), by
    expert and first row."""
    out: dict[str, list[tuple[str, HFTensor]]] = {}
    for ours, where in cfg.family_spec().tensors(cfg).items():
        out.setdefault(where.name, []).append((ours, where))
    return {hf: sorted(parts, key=lambda p: (p[1].expert or 0, p[1].offset)) for hf, parts in out.items()}


def hf_tensor(parts: list[tuple[str, HFTensor]], tensors: list[torch.Tensor]) -> torch.Tensor:
    """One transformers tensor from the fourfold tensors `hf_sources` names for it: each expert's
    parts put at their rows (the last dim of a Conv1D tensor, the first otherwise), the experts
    stacked."""
    experts: dict[int | None, list] = {}
    for t, (_, where) in zip(tensors, parts):
        stored = t.T if where.conv1d and t.dim() == 2 else t
        experts.setdefault(where.expert, []).append((stored, where))
    whole = []
    for pieces in experts.values():
        axis = -1 if pieces[0][1].conv1d else 0
        shape = list(pieces[0][0].shape)
        shape[axis] = sum(t.shape[axis] for t, _ in pieces)
        out = pieces[0][0].new_empty(shape)
        for t, where in pieces:
            rows = where.offset + where.stride * torch.arange(t.shape[axis])
            out.index_copy_(axis % out.dim(), rows, t)
        whole.append(out)
    return (torch.stack(whole) if None not in experts else whole[0]).contiguous()


def to_hf_tensors(cfg: ModelConfig, serial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fourfold's serial tensors under the checkpoint's names (and layouts)."""
    return {hf: hf_tensor(parts, [serial[ours] for ours, _ in parts]) for hf, parts in hf_sources(cfg).items()}
