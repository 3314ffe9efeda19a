"""`fourfold generate`: sample text on one process from a training checkpoint (written on any grid) or a
Hugging Face directory, with the tokenizer.json beside it."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold import checkpoint
from fourfold.checkpoint.hf import load_hf, model_directory
from fourfold.data import corpus
from fourfold.models.config import ModelConfig, load_config
from fourfold.parallel.grid import Grid
from fourfold.parallel.transformer import Transformer
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import check


def _single_process_group() -> None:
    """A world of one gloo rank, so the parallel layers and DCP run in this process."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def open_model(path: str | Path) -> tuple[Transformer, object, int, int | None]:
    """(model, tokenizer, window, eos) on one process from `path`: a fourfold training checkpoint (a
    step-N directory, or a run's checkpoint directory: its latest) or a Hugging Face directory
    (config.json, safetensors, tokenizer.json, as save_pretrained writes); window is the most
    tokens one forward may attend to, eos the tokenizer's end-of-document id (None: it has none)."""
    path, hf = model_directory(path)
    if hf:
        try:
            cfg = load_config(str(path))
        except ValueError as e:  # a model fourfold does not implement: the reason names it
            raise checkpoint.CheckpointError(f"{path}: {e}") from None
    else:
        cfg = ModelConfig.from_dict(checkpoint.read_meta(path)["model"])
        what = checkpoint.damage(path)
        if what:
            raise checkpoint.CheckpointError(f"the checkpoint {path} is damaged ({what}); give an intact one")
    window = cfg.max_positions  # (a sliding window is the attention's own: the context may be longer)
    check(cfg, Job(micro_batch=1, global_batch=1, seq=window, precision="float32"), world=1)
    if not (path / "tokenizer.json").is_file():
        raise checkpoint.CheckpointError(f"{path} has no tokenizer.json; put the model's tokenizer.json there "
                                         "(save_pretrained of its tokenizer writes it)")
    tokenizer = corpus.load_tokenizer(path / "tokenizer.json")
    try:
        eos = corpus.end_of_document(path / "tokenizer.json")
    except ValueError:  # a tokenizer without an end token: samples run to max_new_tokens
        eos = None
    _single_process_group()
    model = Transformer(Grid(Layout()), cfg)
    if hf:
        load_hf(model, path)
    else:
        checkpoint.load_checkpoint(path, model)
    return model, tokenizer, window, eos


@torch.no_grad()
def continue_ids(model: Transformer, ids: list[int], window: int, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, eos: int | None = None) -> list[int]:
    """`ids` and up to `max_new_tokens` more: greedy (temperature 0) or sampled at `temperature` > 0;
    a sample ends with the end-of-document id `eos`, as transformers' generate with eos_token_id
    (the model's text ended: what it gives after is the start of some other document)."""
    if max(ids) >= model.cfg.vocab:
        raise ValueError(f"the prompt has token id {max(ids)}, outside the model's vocabulary of {model.cfg.vocab}; "
                         "use the model's own tokenizer.json")
    ids = list(ids)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids[-window:]]))[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        ids.append(token)
        if token == eos:
            break
    return ids


def generate(path: str | Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0) -> str:
    """The prompt and its continuation, from a checkpoint or Hugging Face directory (see `open_model`);
    ValueError for a prompt and max_new_tokens past the model's positions (it was not trained there)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    model, tokenizer, window, eos = open_model(path)
    try:
        ids = tokenizer.encode(prompt).ids or [0]
        positions = model.cfg.max_positions
        if len(ids) + max_new_tokens > positions:
            raise ValueError(f"--max-new-tokens {max_new_tokens} after the prompt's {len(ids)} tokens passes the "
                             f"model's {positions} positions; give --max-new-tokens {max(0, positions - len(ids))} or "
                             f"less, or a shorter prompt")
        return tokenizer.decode(continue_ids(model, ids, window, max_new_tokens, temperature, seed, eos))
    finally:
        dist.destroy_process_group()
