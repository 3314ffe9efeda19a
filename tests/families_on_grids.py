"""What each rank runs in tests/models/test_model_families.py, in a module without transformers (so
that the rank workers do not import it): every family loaded from its checkpoint on one grid."""

import torch

from fourfold.checkpoint.hf import load_hf
from fourfold.models.config import load_config
from fourfold.parallel import comm, context
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model
from fourfold.parallel.pipeline import Pipeline
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import full_weights, layouts
from fourfold.parallel.transformer import Transformer
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import ledger_bytes, model_collectives
from fourfold.train.evaluate import evaluate
from serial_reference import sum_replicated_grads


def run_families(paths, ids, sizes, seq_parallel, microbatches, schedule="1f1b", virtual=1):
    """Each family's loss on the batch `ids` [batch, seq + 1], this rank's logits (ranks at
    x = y = 0, without pp) and the full gradients (one rank per pipeline stage), in float64."""
    layout = Layout(**sizes)
    grid = Grid(layout)
    c, cp = grid.coords, grid.group("cp")
    opts = TensorOptions(dtype=torch.float64, seq_parallel=seq_parallel)
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
    inputs, targets = context.shard_sequence(local[:, :-1], cp), context.shard_sequence(local[:, 1:], cp)
    scale, seq = 1.0 / ids[:, 1:].numel(), ids.shape[1] - 1
    out = {}
    for name, path in paths.items():
        cfg = load_config(path)
        logits = None
        if layout.pp > 1:
            pipe = Pipeline(grid, cfg, opts, schedule=schedule, microbatches=microbatches,
                            micro_batch=len(local) // microbatches, seq=seq // layout.cp, virtual=virtual)
            models = pipe.models
            for model in models:
                load_hf(model, path)
            loss = pipe.step(inputs, targets, scale=scale)
        else:
            models = [Transformer(grid, cfg, opts)]
            load_hf(models[0], path)
            head = models[0].logits(inputs)
            full = comm.all_gather(comm.all_gather(head.detach(), grid.group("y"), dim=-1), grid.group("x"), dim=1)
            logits = full.view(len(local), -1, full.shape[-1])  # (the head's tokens: in order)
            grid.ledger.reset()
            loss = models[0](inputs, targets).sum() * scale
            loss.backward()
            expected = model_collectives(cfg, layout.sizes, len(local), seq // layout.cp, seq_parallel=seq_parallel,
                                          cp_rank=c["cp"])
            assert grid.ledger.bytes() == ledger_bytes(expected, layout.sizes, 8), name
        grads = serial_grads(models, grid)
        loss = comm.all_reduce(loss.detach(), grid.group(("dp", "pp", "cp", "z"))).item()
        stage_head = all(c[d] == 0 for d in c if d != "pp")
        out[name] = (loss, logits if c["x"] == c["y"] == 0 else None, grads if stage_head else None)
    return c, out



def evaluate_families(paths, tokens, seq, batch, sizes, virtual=1):
    """Each family's `evaluate` loss on the 1-D `tokens` (float64), through pipeline stages when pp > 1."""
    layout = Layout(**sizes)
    grid = Grid(layout)
    # built for pp micro-batches of `batch` sequences a rank (what an interleaved schedule needs);
    # evaluate scores one micro-batch at a time
    job = Job(layout, micro_batch=batch * layout.z, global_batch=batch * layout.z * layout.dp * layout.pp, seq=seq,
              schedule="interleaved-1f1b" if virtual > 1 else "gpipe", virtual=virtual)
    out = {}
    for name, path in paths.items():
        model = Model(grid, job, load_config(path), dtype=torch.float64)
        for part in model.parts:
            load_hf(part, path)
        out[name] = evaluate(model, tokens, seq, batch)
    return out


def serial_grads(models, grid):
    """The serial model's gradients from this rank's stages' (`models`): each summed over the dims
    that hold it replicated and over dp*cp, then gathered whole in serial names (collective)."""
    grads = {}
    for model in models:
        sum_replicated_grads(model, grid)
        expert = {id(p) for p, layout in layouts(model).items() if layout.expert}  # replicated over edp only
        for p in model.parameters():
            comm.all_reduce(p.grad, grid.expert_group("edp") if id(p) in expert else grid.group(("dp", "cp")))
        grads.update(full_weights(model, grads=True))
    return grads
