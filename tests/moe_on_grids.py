"""What each rank runs in tests/test_moe.py, in a module without transformers (so that the rank
workers do not import it): a mixture-of-experts model loaded from its checkpoint on one grid."""

import torch

from families_on_grids import serial_grads
from fourfold.checkpoint.hf import load_hf
from fourfold.models.config import load_config
from fourfold.parallel import comm, context
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.vocab import batch_order
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import ledger_bytes, model_collectives, pipeline_sends


def run_moe(paths, ids, sizes, seq_parallel, recompute, capacity_factor=0.0):
    """Each model's loss (its router loss included) on the batch `ids` [batch, seq + 1], this
    rank's logits (ranks at x = y = 0), the full gradients (rank 0) and its routing, in float64; the bytes
    each collective sent are the volume functions' at the routing the model took."""
    layout = Layout(**sizes)
    grid = Grid(layout)
    c, cp = grid.coords, grid.group("cp")
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
    inputs, targets = context.shard_sequence(local[:, :-1], cp), context.shard_sequence(local[:, 1:], cp)
    out = {}
    for name, path in paths.items():
        cfg = load_config(path)
        opts = TensorOptions(dtype=torch.float64, seq_parallel=seq_parallel, capacity_factor=capacity_factor)
        model = Transformer(grid, cfg, opts, recompute=recompute)
        load_hf(model, path)
        head = model.logits(inputs)
        full = comm.all_gather(comm.all_gather(head.detach(), grid.group("y"), dim=-1), grid.group("x"), dim=1)
        logits = batch_order(full, len(local), grid, seq_parallel)
        grid.ledger.reset()
        loss = model(inputs, targets).sum() / ids[:, 1:].numel() + model.router_loss()
        loss.backward()
        routing = [tuple(layer.mlp.routed) for layer in model.layers.values()]
        exchanged = [layer.mlp.exchanged for layer in model.layers.values()]
        volume_sizes = dict(layout.sizes, ep=layout.ep)
        expected = model_collectives(cfg, volume_sizes, len(local), inputs.shape[1], seq_parallel=seq_parallel,
                                     recompute=recompute, routing=routing, exchanged=exchanged)
        counts = grid.group(("dp", "cp", "z")).name  # the routing counts' sum, which the volumes leave out
        measured = {key: sent for key, sent in grid.ledger.bytes().items() if key[0] != counts}
        assert measured == ledger_bytes(expected, volume_sizes, 8), name
        if layout.ep > 1:
            assert measured[("ep", "all_to_all_v")] > 0, name
        grads = serial_grads([model], grid)
        loss = comm.all_reduce(loss.detach(), grid.group(("dp", "cp", "z"))).item()
        out[name] = (loss, logits if c["x"] == c["y"] == 0 else None, grads if grid.rank == 0 else None, routing)
    return c, out


def run_moe_pipeline(paths, ids, sizes, microbatches, schedule, virtual=1):
    """Each model's loss through pipeline stages (every micro-batch's load-balancing loss included)
    and the full gradients (one rank per stage), in float64."""
    from fourfold.parallel.pipeline import Pipeline

    layout = Layout(**sizes)
    grid = Grid(layout)
    c, cp = grid.coords, grid.group("cp")
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
    inputs, targets = context.shard_sequence(local[:, :-1], cp), context.shard_sequence(local[:, 1:], cp)
    out = {}
    for name, path in paths.items():
        cfg = load_config(path)
        pipe = Pipeline(grid, cfg, TensorOptions(dtype=torch.float64), schedule=schedule, microbatches=microbatches,
                        micro_batch=len(local) // microbatches, seq=inputs.shape[1], virtual=virtual)
        for model in pipe.models:
            load_hf(model, path)
        grid.ledger.reset()
        loss = pipe.step(inputs, targets, 1.0 / ids[:, 1:].numel())
        sends = pipeline_sends(cfg, layout.sizes, len(local) // microbatches, inputs.shape[1], microbatches,
                               pipe.indices, layout.pp * virtual)
        assert grid.ledger.bytes()[("pp", "send")] == ledger_bytes(sends, layout.sizes, 8)[("pp", "send")], name
        grads = serial_grads(pipe.models, grid)
        loss = comm.all_reduce(loss.detach(), grid.group(("dp", "pp", "cp", "z"))).item()
        out[name] = (loss, None, grads if all(c[d] == 0 for d in c if d != "pp") else None, [])
    return c, out


def save_checkpoint(path, root, sizes):
    """The Hugging Face directory `path` imported on a grid and saved as a training checkpoint."""
    import dataclasses

    from fourfold import checkpoint

    grid = Grid(Layout(**sizes))
    cfg = load_config(path)
    model = Transformer(grid, cfg, TensorOptions(dtype=torch.float64))
    load_hf(model, path)
    checkpoint.save(root, 1, model, None, {"model": dataclasses.asdict(cfg)}, keep=1)
