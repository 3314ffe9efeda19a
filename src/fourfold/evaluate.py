"""Mean next-token loss of a model on a token file, computed on a parallel grid."""

from __future__ import annotations

import math

import numpy as np
import torch

from fourfold import comm, context
from fourfold.grid import Grid


def windows(tokens: np.ndarray, seq: int) -> np.ndarray:
    """Consecutive windows of seq + 1 tokens, overlapping by one, so every token after the first
    is predicted exactly once: [n, seq + 1]."""
    n = (len(tokens) - 1) // seq
    if n < 1:
        raise ValueError(f"a token file of {len(tokens)} tokens holds no window of --seq {seq} + 1; use a smaller --seq")
    index = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
    return tokens[index]


@torch.no_grad()
def evaluate(model: torch.nn.Module, grid: Grid, tokens: np.ndarray, seq: int, batch_per_rank: int = 1) -> dict:
    """{"loss", "perplexity", "tokens"} of `model` on `tokens` (a 1-D array of ids).

    Windows are dealt to the dp*z token shards in turn, each cut into cp chunks as in training;
    the last batch is padded with windows whose targets are -1 (scored 0, not counted)."""
    cp = grid.group("cp")
    data = windows(tokens, seq)
    shards = grid.size(("dp", "z"))
    shard = grid.coords["dp"] * grid.size("z") + grid.coords["z"]
    per_step = shards * batch_per_rank
    steps = -(-len(data) // per_step)
    total = torch.zeros(2, dtype=torch.float64, device=grid.device)  # loss sum, scored tokens
    for step in range(steps):
        ids = np.full((per_step, seq + 1), -1, dtype=np.int64)
        chunk = data[step * per_step : (step + 1) * per_step]
        ids[: len(chunk)] = chunk
        mine = torch.from_numpy(ids[shard::shards])
        inputs = context.shard_sequence(mine[:, :-1].clamp_min(0), cp).to(grid.device)
        targets = context.shard_sequence(mine[:, 1:], cp).to(grid.device)
        total[0] += model(inputs, targets).double().sum()
        total[1] += (targets >= 0).sum()
    comm.all_reduce(total, grid.group(("dp", "cp", "z")))
    mean = (total[0] / total[1]).item()
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": int(total[1].item())}
