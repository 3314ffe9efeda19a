"""What each rank runs in tests/models/test_moe.py, in a module without transformers (so that the rank
workers do not import it): a mixture-of-experts model loaded from its checkpoint on one grid."""

import torch

from families_on_grids import serial_grads
from fourfold.checkpoint.hf import load_hf
from fourfold.models.config import load_config
from fourfold.parallel import comm, context
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import ledger_bytes, model_collectives, pipeline_sends


def _rank_batch(grid, ids):
    """(coords, local sequences, inputs, targets) of this rank: its dp and z share of `ids`, its cp chunks."""
    c, cp, layout = grid.coords, grid.group("cp"), grid.layout
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
    return c, local, context.shard_sequence(local[:, :-1], cp), context.shard_sequence(local[:, 1:], cp)


def run_moe(paths, ids, sizes, seq_parallel, recompute, capacity_factor=0.0):
    """Each model's loss (its router loss included) on the batch `ids` [batch, seq + 1], this
    rank's logits (ranks at x = y = 0), the full gradients (rank 0) and its routing, in float64; the bytes
    each collective sent are the volume functions' at the routing the model took."""
    layout = Layout(**sizes)
    grid = Grid(layout)
    c, local, inputs, targets = _rank_batch(grid, ids)
    out = {}
    for name, path in paths.items():
        cfg = load_config(path)
        opts = TensorOptions(dtype=torch.float64, seq_parallel=seq_parallel, capacity_factor=capacity_factor)
        model = Transformer(grid, cfg, opts, recompute=recompute)
        load_hf(model, path)
        head = model.logits(inputs)
        full = comm.all_gather(comm.all_gather(head.detach(), grid.group("y"), dim=-1), grid.group("x"), dim=1)
        logits = full.view(len(local), -1, full.shape[-1])  # (the head's tokens: in order)
        grid.ledger.reset()
        loss = model(inputs, targets).sum() / ids[:, 1:].numel() + model.router_loss()
        loss.backward()
        # (a dense layer among the mixtures, DeepSeek-V3's first: no routing)
        routing = [tuple(getattr(layer.mlp, "routed", ())) for layer in model.layers.values()]
        exchanged = [getattr(layer.mlp, "exchanged", (0, 0)) for layer in model.layers.values()]
        volume_sizes = dict(layout.sizes, ep=layout.ep)
        expected = model_collectives(cfg, volume_sizes, len(local), inputs.shape[1], seq_parallel=seq_parallel,
                                     recompute=recompute, routing=routing, exchanged=exchanged, cp_rank=c["cp"])
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
    c, local, inputs, targets = _rank_batch(grid, ids)
    out = {}
    for name, path in paths.items():
        cfg = load_config(path)
        pipe = Pipeline(grid, cfg, TensorOptions(dtype=torch.float64), schedule=schedule, microbatches=microbatches,
                        micro_batch=len(local) // microbatches, seq=inputs.shape[1], virtual=virtual)
        for model in pipe.models:
            load_hf(model, path)
        grid.ledger.reset()
        loss = pipe.step(inputs, targets, scale=1.0 / ids[:, 1:].numel())
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


def assert_export_round_trip(ranks, path, tmp_path):
    """The Hugging Face directory `path` imported on x2 z2, saved as a training checkpoint and exported
    (`fourfold.checkpoint.export`): transformers loads the same weights and the same config from it."""
    import json

    import transformers

    from fourfold.checkpoint.export import export
    from fourfold.models.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads(open(f"{path}/config.json").read()))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    ranks.run(save_checkpoint, 4, path, tmp_path / "run", dict(x=2, z=2))
    export(tmp_path / "run", tmp_path / "hf")
    original, exported = (transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float64).state_dict()
                          for p in (path, tmp_path / "hf"))
    assert original.keys() == exported.keys()
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    assert ModelConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())) == cfg
