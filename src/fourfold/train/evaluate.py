"""Mean next-token loss of a model on a token file, computed on a parallel grid (through the
pipeline stages when pp > 1)."""

from __future__ import annotations

import math

import numpy as np
import torch

from fourfold.parallel import comm
from fourfold.parallel.model import Model, shard_rows


def window_count(tokens: int, seq: int) -> int:
    """How many windows of seq + 1 tokens, overlapping by one, a file of `tokens` ids holds."""
    n = (tokens - 1) // seq
    if n < 1:
        raise ValueError(f"a token file of {tokens} tokens holds no window of --seq {seq} + 1; use a smaller --seq")
    return n


def windows(tokens: np.ndarray, seq: int, indices) -> np.ndarray:
    """Windows `indices` of seq + 1 tokens, overlapping by one so that every token after the
    first is predicted exactly once: [len(indices), seq + 1]. Reads only their tokens (a
    memory-mapped file is never loaded whole)."""
    rows = [np.asarray(tokens[i * seq : (i + 1) * seq + 1], dtype=np.int64) for i in indices]
    return np.stack(rows) if rows else np.empty((0, seq + 1), dtype=np.int64)


@torch.no_grad()
def evaluate(model: Model, tokens: np.ndarray, seq: int, batch_per_rank: int = 1, max_tokens: int = 0,
             end_of_document: int | None = None) -> dict:
    """{"loss", "perplexity", "tokens"} of this rank's `model` (through its pipeline stages when it
    has them) on `tokens` (a 1-D array of ids; `max_tokens` > 0: only the first windows, up to
    that many scored tokens). With `end_of_document` (data.attention = document), each token attends
    to its own document only, the documents of each whole window found as in training.

    Windows are dealt to the dp*z token shards in turn, each cut into cp chunks as in training;
    the last batch is padded with windows whose targets are -1 (scored 0, not counted). Through a
    pipeline, each batch is one micro-batch, forward only; the ranks of its last stage score it."""
    grid = model.grid
    count = window_count(len(tokens), seq)
    if max_tokens:
        count = min(count, max(1, max_tokens // seq))
    shards = grid.size(("dp", "z"))
    shard = grid.coords["dp"] * grid.size("z") + grid.coords["z"]
    per_step = shards * batch_per_rank
    steps = -(-count // per_step)
    total = torch.zeros(2, dtype=torch.float64, device=grid.device)  # loss sum, scored tokens
    for step in range(steps):
        ids = np.full((batch_per_rank, seq + 1), -1, dtype=np.int64)
        # this shard's windows of the step: every shards-th from its own (each rank reads only those)
        chunk = windows(tokens, seq, range(step * per_step + shard, min((step + 1) * per_step, count), shards))
        ids[: len(chunk)] = chunk
        batch = shard_rows(torch.from_numpy(ids), grid, end_of_document)
        losses = model.losses(batch)
        if losses is not None:  # (None: a pipeline rank without the last stage)
            total[0] += losses.double().sum()
            total[1] += (batch.targets >= 0).sum()
    comm.all_reduce(total, grid.loss_group())
    mean = (total[0] / total[1]).item()
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": int(total[1].item())}
