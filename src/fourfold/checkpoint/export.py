"""`fourfold export CHECKPOINT OUT_DIR`: a training checkpoint as a Hugging Face model directory.

One process, tensor by tensor: each serial tensor is read whole from the DCP checkpoint (from
whatever pieces the ranks wrote), renamed (and for GPT-2 fused and transposed) as transformers
names it, and added to the current safetensors shard; a shard is written when it reaches the
size limit. Memory is bounded by one shard plus the largest tensor, whatever the model's size.
The directory is written under OUT_DIR.partial and renamed at the end (a failed export leaves no
half directory); config.json, the index and the checkpoint's tokenizer go with it, with a
tokenizer_config.json naming its end-of-document token, so that transformers and a later
`--model.hf OUT_DIR` agree with training on it, and a generation_config.json (the fine-tuned
model's settings, with the bos, eos and pad ids of config.json). An existing non-empty OUT_DIR is
refused, never replaced: a typo naming the source model must not delete it. A checkpoint missing a
file, or with one cut short (`checkpoint.damage`), is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from fourfold import checkpoint
from fourfold.checkpoint.hf import hf_sources, hf_tensor
from fourfold.data import corpus
from fourfold.models.config import ModelConfig

SHARD_BYTES = 2 * 2**30


def export(source: str | Path, out_dir: str | Path, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the checkpoint `source` (a step-N directory, or a run's checkpoint directory: its
    latest) to `out_dir`; returns the step-N directory it read."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # (also the checkpoint's own directory)
        raise checkpoint.CheckpointError(f"{out} exists and is not empty; export writes a whole model directory and "
                                         f"replaces nothing: give a new directory or remove {out} first")
    path = Path(source)
    if not (path / checkpoint.META).is_file():
        path = checkpoint.latest(path) or path
    cfg = ModelConfig.from_dict(checkpoint.read_meta(path)["model"])
    what = checkpoint.damage(path)
    if what:
        raise checkpoint.CheckpointError(f"the checkpoint {path} is damaged ({what}); export an intact one")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_model(cfg, path, partial, shard_bytes)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return path


def _write_model(cfg: ModelConfig, path: Path, partial: Path, shard_bytes: int) -> None:
    reader = _MetadataOnce(str(path))
    saved = reader.read_metadata().state_dict_metadata

    def read(name: str) -> torch.Tensor:
        md = saved[f"model/{name}"]
        t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        dcp.load({f"model/{name}": t}, storage_reader=reader, no_dist=True)
        return t

    shard: dict[str, torch.Tensor] = {}  # the one being filled: number len(files)
    files: list[str] = []
    weight_map: dict[str, int] = {}
    size = total = 0
    for hf, parts in hf_sources(cfg).items():
        tensor = hf_tensor(parts, [read(ours) for ours, _ in parts])
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:  # write the full shard, start the next
            files.append(_write(shard, partial, len(files)))
            size = 0
        shard[hf] = tensor
        weight_map[hf] = len(files)
        size, total = size + nbytes, total + nbytes
    files.append(_write(shard, partial, len(files)))
    names = _final_names(partial, files)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {hf: names[i] for hf, i in weight_map.items()}}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    token_ids = _write_tokenizer(cfg, path, partial)
    if token_ids.get("pad_token_id") is None:  # none named by the tokenizer: the one of the model fine-tuned, if any
        token_ids["pad_token_id"] = checkpoint.read_meta(path).get("pad_token_id")
    if token_ids["pad_token_id"] is None:  # (a model whose config names one: the row its training kept)
        token_ids["pad_token_id"] = cfg.pad_token
    (partial / "config.json").write_text(json.dumps(cfg.to_hf() | token_ids, indent=1))
    _write_generation_config(path, partial, token_ids)


def _write_generation_config(path: Path, out: Path, token_ids: dict) -> None:
    """generation_config.json, as transformers' generate reads it: the checkpoint's copy of the
    fine-tuned model's (its sampling settings) with the token ids of config.json."""
    source = path / "generation_config.json"
    settings = json.loads(source.read_text(encoding="utf-8")) if source.is_file() else {}
    settings.update({key: value for key, value in token_ids.items() if value is not None})
    (out / "generation_config.json").write_text(json.dumps(settings, indent=1))


def _write_tokenizer(cfg: ModelConfig, path: Path, out: Path) -> dict:
    """The checkpoint's tokenizer.json and a tokenizer_config.json naming its end-of-document token
    (eos_token, as `corpus.end_of_document` found it for training) and BOS; returns config.json's
    bos_token_id, eos_token_id and pad_token_id (the tokenizer_config.json's pad_token). An id not
    known is null: left out, transformers would take its class default (Llama's 1 and 2, GPT-2's
    50256), another token or none of the vocabulary."""
    if not (path / "tokenizer.json").is_file():
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    for name, source in corpus.tokenizer_files(path / "tokenizer.json").items():  # the chat template among them
        if name != "tokenizer_config.json":  # (written below)
            (out / name).parent.mkdir(exist_ok=True)
            shutil.copyfile(source, out / name)
    # the user's own tokenizer_config.json (its class, EOS, chat template) when the run had one
    settings = (json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
                if (path / "tokenizer_config.json").is_file() else {"tokenizer_class": "PreTrainedTokenizerFast"})
    tokenizer = corpus.load_tokenizer(out / "tokenizer.json")
    try:  # beside the checkpoint's copy: the same settings, as `--model.hf OUT` will find them
        eos = corpus.end_of_document(path / "tokenizer.json")
    except ValueError:  # a tokenizer without one (trained on data.tokens): transformers gets none either
        eos = None
    bos = settings.get("bos_token")
    bos = tokenizer.token_to_id(bos.get("content") if isinstance(bos, dict) else bos) if bos else None
    if bos is None:  # the token the tokenizer puts before each document
        bos = _prepended(tokenizer)
    if bos is None and cfg.family_spec().bos_is_eos:  # GPT-2's convention: one <|endoftext|> is both
        bos = eos
    for key, token in (("eos_token", eos), ("bos_token", bos)):
        if token is not None:
            settings[key] = tokenizer.id_to_token(token)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    pad = settings.get("pad_token")
    pad = tokenizer.token_to_id(pad.get("content") if isinstance(pad, dict) else pad) if pad else None
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def _prepended(tokenizer) -> int | None:
    """The id the tokenizer puts before a text (a BOS its post-processor adds), if any."""
    try:
        ids, plain = tokenizer.encode("a").ids, tokenizer.encode("a", add_special_tokens=False).ids
    except Exception:  # a vocabulary that cannot encode "a" (word level, without an unknown token)
        return None
    return ids[0] if len(ids) == len(plain) + 1 and ids[1:] == plain else None


class _MetadataOnce(dcp.FileSystemReader):
    """A checkpoint's reader that reads its metadata file once: each `dcp.load` asks for it, and
    an export loads tensor by tensor (the metadata of a large job's checkpoint is hundreds of MB:
    its ZeRO-1 optimizer states are chunks of every rank)."""

    def read_metadata(self):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata()
        return self._metadata


def _write(tensors: dict[str, torch.Tensor], directory: Path, number: int) -> str:
    name = f"shard-{number:05d}.safetensors"
    save_file(tensors, str(directory / name), metadata={"format": "pt"})
    # safetensors creates the file readable by its owner only; a model directory is for others too
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory / name, 0o666 & ~umask)
    tensors.clear()  # free the shard's memory before the next is filled
    return name


def _final_names(directory: Path, files: list[str]) -> list[str]:
    """transformers' names: model.safetensors for one shard, model-0000i-of-0000n.safetensors otherwise."""
    n = len(files)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old, new in zip(files, names):
        os.replace(directory / old, directory / new)
    return names
