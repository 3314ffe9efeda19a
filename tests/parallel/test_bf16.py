"""bf16 numerics on CPU (bf16 GEMMs run here): a few AdamW steps of a small Llama in bf16 on every
kind of 8-rank grid (3D, 1D tensor, context and pipeline parallel), against the float64 serial
model (transformers). The yardstick is transformers' own bf16 error on the same model and tokens:
autocast bf16 with fp32 weights and AdamW, what its Trainer does with bf16=True. fourfold keeps
bf16 weights with fp32 master weights, Adam moments and gradient accumulators, and merges ring
attention's blocks in fp32; tensor-parallel partial outputs are summed in bf16 (in fp32 they gave
the same losses on gloo: docs/benchmarks.md). The measure is the RMS over
every token of every step of the per-token loss's distance from float64's; fourfold's may be at
most twice transformers'."""

import numpy as np
import pytest
import torch
import transformers

from fourfold.checkpoint.hf import load_hf
from fourfold.models.config import load_config
from fourfold.parallel import pipeline, transformer
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model, local_batch
from fourfold.parallel.optimizer import AdamW
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import ledger_bytes, model_collectives
from serial_reference import hf_adamw_groups

HF = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
          intermediate_size=256, vocab_size=256, tie_word_embeddings=False, max_position_embeddings=128)
STEPS, BATCH, SEQ, LR = 4, 8, 32, 3e-3
OPTIMIZER = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _batch():
    return np.random.default_rng(0).integers(0, HF["vocab_size"], (BATCH, SEQ + 1))


def _target_index():
    """A batch-shaped array whose targets are their own index in the flattened [BATCH, SEQ] targets."""
    index = np.full((BATCH, SEQ + 1), -1)
    index[:, 1:] = np.arange(BATCH * SEQ).reshape(BATCH, SEQ)
    return index


def _transformers_losses(path, dtype, autocast):
    """Per-token losses [STEPS, BATCH * SEQ] of transformers' model, loaded in `dtype`, trained on the batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa")
    opt = torch.optim.AdamW(hf_adamw_groups(model, OPTIMIZER["weight_decay"]), **OPTIMIZER)
    ids = torch.from_numpy(_batch())
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.double().reshape(-1, HF["vocab_size"]), ids[:, 1:].reshape(-1),
                                                 reduction="none")
        loss.mean().backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint path, float64 per-token losses, transformers' bf16 ones)."""
    path = tmp_path_factory.mktemp("llama-bf16")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**HF)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    exact = _transformers_losses(path, torch.float64, autocast=False)
    bf16 = _transformers_losses(path, torch.float32, autocast=True)
    return str(path), exact, bf16


def _fourfold_losses(path, sizes):
    """(each local target's index in the batch, its loss at every step [STEPS, ...]) on the ranks
    that score tokens (the last pipeline stage), else None."""
    job = Job(Layout(**sizes), global_batch=BATCH, micro_batch=BATCH // (sizes.get("dp", 1) * 2), seq=SEQ,
              seq_parallel=sizes.get("y", 1) > 1, precision="bf16")
    grid = Grid(job.layout)
    model = Model(grid, job, load_config(path), dtype=torch.bfloat16)
    for part in model.parts:
        load_hf(part, path)
    opt = AdamW(GradientSync(model.module, grid), **OPTIMIZER)
    rows = np.arange(BATCH).reshape(job.dp, -1)[grid.coords["dp"]]
    batch = local_batch(job, grid, _batch()[rows])
    where = local_batch(job, grid, _target_index()[rows]).targets
    scored = []  # the per-token losses of each micro-batch, in order (both schedules score them in order)
    score = transformer.vocab_parallel_cross_entropy

    def recorded(*args, **kwargs):
        losses = score(*args, **kwargs)
        scored.append(losses.detach().double())
        return losses

    transformer.vocab_parallel_cross_entropy = pipeline.vocab_parallel_cross_entropy = recorded
    try:
        for _ in range(STEPS):
            model.step(batch, opt.sync, 1.0 / (BATCH * SEQ))
            opt.step()
    finally:  # the worker process runs other tests next
        transformer.vocab_parallel_cross_entropy = pipeline.vocab_parallel_cross_entropy = score
    # Gradient sums travel in fp32 whatever the dtype: the weight gradients reduce-scattered over z
    # and ring attention's dK, dV accumulators; the norms' statistics over x (bf16 elsewhere).
    sent = grid.ledger.bytes()
    expected = ledger_bytes(model_collectives(load_config(path), job.layout.sizes, job.micro_batch // job.z,
                                              SEQ // job.cp, seq_parallel=job.seq_parallel), job.layout.sizes, 2)
    for key in (("z", "reduce_scatter"), ("cp", "send"), ("x", "all_reduce")):
        if key in expected:
            assert sent[key] == expected[key] * job.microbatches * STEPS, (key, sent[key], expected[key])
    if not scored:
        return None
    return where.reshape(-1), torch.cat(scored, dim=0).reshape(STEPS, -1)


def _rms(a, b):
    return (a - b).square().mean().sqrt().item()


GRIDS = {"x2y2z2": dict(x=2, y=2, z=2), "dp2x4": dict(dp=2, x=4), "cp2x2y2": dict(cp=2, x=2, y=2),
         "pp2dp2y2": dict(pp=2, dp=2, y=2)}


@pytest.mark.parametrize("sizes", GRIDS.values(), ids=GRIDS.keys())
def test_bf16_training_is_as_close_to_float64_as_transformers(ranks, reference, sizes):
    path, exact, hf_bf16 = reference
    losses = torch.full_like(exact, float("nan"))
    for result in ranks.run(_fourfold_losses, 8, path, sizes):
        if result is not None:
            where, scored = result
            losses[:, where] = scored
    assert not losses.isnan().any(), "some tokens were scored by no rank"
    error, hf_error = _rms(losses, exact), _rms(hf_bf16, exact)
    print(f"per-token loss error RMS {error:.3e}, transformers' bf16 {hf_error:.3e}: {error / hf_error:.2f}x")
    assert error <= 2 * hf_error, f"per-token loss error RMS {error:.2e}: {error / hf_error:.1f}x transformers' bf16"
