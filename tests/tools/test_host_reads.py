"""Host reads of device values in one training step (issue #42, item 7): each is a CUDA
synchronisation on a GPU, so the step's count is stated per kind of job and a regression fails.
The step is timed by the rank's clock, and a mixture's expert load counted, as in training.
Counted on CPU by `fourfold.tools.host_reads.HostReads` (a dispatch mode, plus `tolist`/`numpy`)."""

import dataclasses

import pytest
import torch

from fourfold.models.config import ModelConfig, load_config
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.block import TensorOptions, document_ids
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from fourfold.tools.host_reads import HostReads

LAYERS = 4
DENSE = ModelConfig("llama", hidden=32, layers=LAYERS, heads=4, kv_heads=2, ffn=64, vocab=64, max_positions=64,
                    tied=False, eps=1e-5)
MOE = dataclasses.replace(load_config("mixtral-8x7b"), hidden=32, layers=LAYERS, heads=4, kv_heads=2, ffn=16, vocab=64,
                          max_positions=64, experts=8, top_k=2)
EOS = 1


def _step(cfg: ModelConfig, sizes: dict, documents: bool, recompute: str, dtype: torch.dtype) -> dict:
    """One forward, backward and optimizer step (after a first one: the traced pass) under HostReads."""
    grid = Grid(Layout(**sizes))
    model = Transformer(grid, cfg, TensorOptions(dtype=dtype), seed=5, recompute=recompute)
    opt = AdamW(GradientSync(model, grid), lr=1e-3)
    ids = torch.randint(2, cfg.vocab, (4, 33), generator=torch.Generator().manual_seed(0))
    ids[:, [5, 12, 20]] = EOS
    local = ids.chunk(grid.size("dp"))[grid.coords["dp"]]
    inputs, targets = local[:, :-1], local[:, 1:]
    docs = document_ids(inputs, EOS) if documents else None
    if grid.size("cp") > 1:  # this rank's two chunks of every sequence (`context.shard_sequence`)
        from fourfold.parallel.context import shard_sequence
        cp = grid.group("cp")
        inputs, targets = shard_sequence(inputs, cp), shard_sequence(targets, cp)
        docs = None if docs is None else shard_sequence(docs, cp)
    counts = []
    for _ in range(2):
        with HostReads() as reads:  # timed as the trainer times a step (issue #39: at no host read)
            grid.clock.step_began()
            model(inputs, targets, docs).sum().backward()
            opt.step()
            grid.clock.step_ended()
        counts.append(dict(reads.counts))
    assert grid.clock.read()["step"] > 0
    return counts[-1]


@pytest.mark.parametrize("kind, cfg, sizes, documents, recompute, most, dtype", [
    ("dense", DENSE, dict(dp=2), False, "none", 0, torch.float64),
    # the bands, once a forward, shared by its layers and their recompute (before: one a layer)
    ("document masking", DENSE, dict(dp=2), True, "full", 1, torch.float64),
    ("cp", DENSE, dict(cp=2), False, "none", 0, torch.float64),
    ("cp with document masking", DENSE, dict(cp=2), True, "none", 1, torch.float64),
    # a window's plans are host arithmetic
    ("sliding window, cp", dataclasses.replace(DENSE, sliding_window=5), dict(cp=2), False, "full", 0, torch.float64),
    # float64: the experts' loop splits its rows by the tokens per expert, once a layer (before: per expert)
    ("mixture", MOE, dict(dp=2), False, "none", LAYERS, torch.float64),
    # the exchange's split sizes (before: 2 a layer)
    ("mixture, ep", MOE, dict(dp=2, ep=2), False, "none", LAYERS, torch.float64),
    # the grouped GEMM takes the experts' offsets on the device (float32 on CPU, bf16 on GPUs)
    ("mixture, grouped experts", MOE, dict(dp=2), False, "none", 0, torch.float32),
])
def test_host_reads_of_a_training_step(ranks, kind, cfg, sizes, documents, recompute, most, dtype):
    for counts in ranks.run(_step, 2, cfg, sizes, documents, recompute, dtype):
        assert sum(counts.values()) <= most, (kind, counts)
