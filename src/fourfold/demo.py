"""The main job on an embedded default, until the trainer lands: a tiny Llama on a 3D grid with
data parallelism fits one fixed batch for a few AdamW steps (the loss must fall), prints the
communication ledger of one step beside the volume functions' prediction, then the planner's
recommendation for a large model on a large cluster."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fourfold import comm
from fourfold.grid import Grid, init_process_group
from fourfold.layout import Layout
from fourfold.models.config import load_config
from fourfold.models.transformer import Transformer
from fourfold.tensor.block import TensorOptions
from fourfold.tensor.params import sum_replicated_grads
from fourfold.volumes import ledger_bytes, model_collectives


def run_demo(layout: Layout, steps: int = 20, batch: int = 8, seq: int = 64) -> None:
    init_process_group()
    grid = Grid(layout)
    cfg = load_config("tiny-llama")
    model = Transformer(grid, cfg, TensorOptions(), seed=0).to(grid.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    ids = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    c = grid.coords
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]].to(grid.device)
    say = print if grid.rank == 0 else (lambda *a, **k: None)
    say(f"fourfold demo: {cfg.family} {cfg.parameter_count() / 1e6:.2f}M parameters on {layout.world_size} CPU ranks, "
        f"grid {layout}; fitting one batch of {batch}x{seq} tokens")
    start = time.perf_counter()
    for step in range(steps):
        grid.ledger.reset()
        optimizer.zero_grad(set_to_none=True)
        per_token = model(local[:, :-1], local[:, 1:])
        (per_token.sum() / ids[:, 1:].numel()).backward()
        model_ledger = grid.ledger.bytes()
        sum_replicated_grads(model, grid)
        for p in model.parameters():
            comm.all_reduce(p.grad, grid.group("dp"))
        optimizer.step()
        loss = comm.all_reduce(per_token.detach().sum(), grid.group(("dp", "z"))) / ids[:, 1:].numel()
        if step % 5 == 0 or step == steps - 1:
            say(f"step {step:3d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start
    say(f"{steps} steps in {elapsed:.1f} s, {steps * batch * seq / elapsed:.0f} tokens/s")
    say("\ncommunication ledger of rank 0, last step (forward, backward, gradient sums over y, z and dp):")
    say(grid.ledger.table())
    predicted = ledger_bytes(model_collectives(cfg, layout.sizes, len(local), seq), layout.sizes, 4)
    say(f"forward+backward bytes equal the volume functions' prediction: {model_ledger == predicted}")
    dist.destroy_process_group()
    if grid.rank == 0:
        print_plan()


def print_plan(model: str = "llama-3.1-70b", gpus: int = 512, cluster: str = "dgx-h100") -> None:
    """What the planner recommends for a large model on a large cluster (same as `fourfold plan`)."""
    from fourfold.plan.cli import HEADER, row
    from fourfold.plan.hardware import make_cluster
    from fourfold.plan.memory import Setup
    from fourfold.plan.search import search

    found = search(load_config(model), gpus, make_cluster(cluster), Setup(seq=4096, global_batch=1024))
    print(f"\nthe planner's best configurations for {model} on {gpus} GPUs of {cluster} (seq 4096, 1024 sequences/step):")
    print(HEADER)
    for r in found[:3]:
        print(row(r))
