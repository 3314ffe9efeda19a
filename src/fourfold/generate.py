"""`fourfold generate`: sample text from a training checkpoint on one process (any training grid)."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold import checkpoint, corpus
from fourfold.grid import Grid
from fourfold.job import Job
from fourfold.layout import Layout
from fourfold.models.config import ModelConfig
from fourfold.models.transformer import Transformer
from fourfold.rules import check


def _single_process_group() -> None:
    """A world of one gloo rank, so the parallel layers and DCP run in this process."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


@torch.no_grad()
def generate(path: str | Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0) -> str:
    """The prompt's continuation: greedy (temperature 0) or sampled at `temperature`."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    path = Path(path)
    if not (path / checkpoint.META).is_file():  # a run's checkpoint directory: take its latest
        path = checkpoint.latest(path) or path
    if (path / "config.json").is_file() and not (path / checkpoint.META).is_file():
        raise checkpoint.CheckpointError(
            f"{path} is a Hugging Face model directory; generate samples from a fourfold training checkpoint: "
            f"train from it first (`fourfold train --model.hf {path}`), or score it with `fourfold eval --hf`")
    meta = checkpoint.read_meta(path)
    cfg = ModelConfig.from_dict(meta["model"])
    # one process, windows of up to the model's positions
    window = min(cfg.max_positions, cfg.sliding_window or cfg.max_positions)  # what one forward may attend to
    check(cfg, Job(micro_batch=1, global_batch=1, seq=window, precision="float32"), world=1)
    tokenizer = corpus.load_tokenizer(path / "tokenizer.json")
    _single_process_group()
    model = Transformer(Grid(Layout()), cfg)
    checkpoint.load_checkpoint(path, model)
    ids = tokenizer.encode(prompt).ids or [0]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        window_ids = torch.tensor([ids[-window:]])
        logits = model(window_ids)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        ids.append(token)
    dist.destroy_process_group()
    return tokenizer.decode(ids)


