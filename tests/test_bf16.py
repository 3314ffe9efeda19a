"""bf16 numerics on CPU (bf16 GEMMs run here): a few AdamW steps of a small Llama in bf16 on 3D,
context-parallel and pipeline grids, against the float64 serial model (transformers). The
yardstick is transformers' own bf16 error on the same model and batch: autocast bf16 with fp32
weights and AdamW, what its Trainer does with bf16=True. fourfold keeps bf16 weights with fp32
master weights, Adam moments and gradient accumulators; its error (the mean over the steps of
the loss's distance from float64's) may be no larger."""

import numpy as np
import pytest
import torch
import transformers

from fourfold.parallel import comm
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.models.config import load_config
from fourfold.checkpoint.hf import load_hf
from fourfold.parallel.optimizer import AdamW
from fourfold.train.trainer import Model, local_batch
from fourfold.spec.volumes import ledger_bytes, model_collectives

HF = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
          intermediate_size=256, vocab_size=256, tie_word_embeddings=False, max_position_embeddings=128)
STEPS, BATCH, SEQ, LR = 4, 8, 32, 3e-3
OPTIMIZER = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _batch():
    return np.random.default_rng(0).integers(0, HF["vocab_size"], (BATCH, SEQ + 1))


def _transformers_losses(path, dtype, autocast):
    """Per-step mean losses of transformers' model, loaded in `dtype`, trained on the whole batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    ids = torch.from_numpy(_batch())
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.double().reshape(-1, HF["vocab_size"]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint path, float64 losses, transformers' bf16 error per step)."""
    path = tmp_path_factory.mktemp("llama-bf16")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**HF)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    exact = _transformers_losses(path, torch.float64, autocast=False)
    bf16 = _transformers_losses(path, torch.float32, autocast=True)
    return str(path), exact, [abs(a - b) for a, b in zip(bf16, exact)]


def _fourfold_losses(path, sizes, schedule):
    job = Job(Layout(**sizes), global_batch=BATCH, micro_batch=BATCH // (sizes.get("dp", 1) * 2), seq=SEQ,
              seq_parallel=sizes.get("y", 1) > 1, precision="bf16", schedule=schedule)
    grid = Grid(job.layout)
    model = Model(grid, job, load_config(path), dtype=torch.bfloat16)
    for part in getattr(model.pipeline, "models", [model.module]):
        load_hf(part, path)
    opt = AdamW(GradientSync(model.module, grid), **OPTIMIZER)
    inputs, targets = local_batch(job, grid, _batch()[np.arange(BATCH).reshape(job.dp, -1)[grid.coords["dp"]]])
    losses = []
    for _ in range(STEPS):
        loss = model.step(inputs, targets, opt.sync, 1.0 / (BATCH * SEQ))
        opt.step()
        losses.append(comm.all_reduce(loss.double().reshape(1), grid.group(("dp", "pp", "cp", "z"))).item())
    # Gradient sums travel in fp32 whatever the dtype: the weight gradients reduce-scattered over z
    # and ring attention's dK, dV accumulators (bf16 elsewhere).
    sent = grid.ledger.bytes()
    expected = ledger_bytes(model_collectives(load_config(path), job.layout.sizes, job.micro_batch // job.z,
                                              SEQ // job.cp, seq_parallel=job.seq_parallel), job.layout.sizes, 2)
    for key in (("z", "reduce_scatter"), ("cp", "send")):
        if key in expected:
            assert sent[key] == expected[key] * job.microbatches * STEPS, (key, sent[key], expected[key])
    return losses


@pytest.mark.parametrize("sizes, schedule", [(dict(x=2, y=2, z=2), "1f1b"), (dict(cp=2, x=2, y=2), "1f1b"),
                                             (dict(pp=2, dp=2, y=2), "1f1b")], ids=["x2y2z2", "cp2x2y2", "pp2dp2y2"])
def test_bf16_training_is_as_close_to_float64_as_transformers(ranks, reference, sizes, schedule):
    path, exact, hf_error = reference
    losses = ranks.run(_fourfold_losses, 8, path, sizes, schedule)[0]
    error = [abs(a - b) for a, b in zip(losses, exact)]
    # the mean over the steps: one step's error is a random walk's position, their mean is steadier
    assert np.mean(error) <= np.mean(hf_error), (error, hf_error)
