"""What tests do with a training run in this process: prepare its corpus, train it, read a
checkpoint whole."""

import json

import torch
import torch.distributed.checkpoint as dcp

from fourfold.config import load_train_config
from fourfold.data import corpus


def prepared_corpus(folder, chars: int, vocab: int) -> list[str]:
    """The first `chars` characters of the bundled corpus in `folder`, tokenized once with a
    `vocab`-token BPE; the data options that train on it."""
    text = folder / "kjv-genesis.txt"
    text.write_text(corpus.bundled_text()[:chars])
    corpus.prepare(str(text), vocab, str(folder / "cache"))
    return ["--data.text", str(text), "--data.vocab", str(vocab), "--data.cache_dir", str(folder / "cache")]


def train_run(options: list[str]):
    """`fourfold train OPTIONS` on this rank (a rank pool's, or alone), without the launcher."""
    from fourfold.train.trainer import train

    return train(load_train_config(None, options))


def whole_checkpoint(path):
    """Every serial tensor of a checkpoint, whole, on one process (NaN where nothing was written)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.full(tuple(md.size), float("nan"), dtype=md.properties.dtype) for k, md in saved.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def step_losses(run_dir):
    """The last logged loss of each step of a run (a restarted run logs the replayed steps again)."""
    out = {}
    for record in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()):
        if "loss" in record and "event" not in record:
            out[record["step"]] = record["loss"]
    return out
