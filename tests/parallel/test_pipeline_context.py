"""Pipeline and context parallelism composed with the 3D tensor grid and data parallelism:
loss, gradients and parameters after two optimizer steps equal the serial model's (float64),
and the P2P bytes equal the volume functions. Tied embeddings over pipeline stages on each
schedule, pp2 and pp4, with x, y, z and dp (a spread, not the product)."""

import dataclasses
import types

import pytest
import torch
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from fourfold.models.config import ModelConfig
from fourfold.parallel import comm, context
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.pipeline import Pipeline
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import full_weights
from fourfold.parallel.transformer import Transformer
from fourfold.spec.job import split_layers
from fourfold.spec.layout import Layout
from fourfold.spec.schedule import held_layers
from fourfold.spec.volumes import ledger_bytes, model_collectives, pipeline_sends
from serial_reference import adamw_groups

LLAMA = ModelConfig("llama", hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, vocab=64, max_positions=32,
                    tied=False, eps=1e-5)
GPT = ModelConfig("gpt2", hidden=32, layers=2, heads=4, kv_heads=4, ffn=64, vocab=64, max_positions=32,
                  tied=True, eps=1e-5)
TIED_LLAMA = dataclasses.replace(LLAMA, tied=True, vocab=63)  # and a vocabulary padded on y=2
BATCH, SEQ, STEPS = 8, 16, 2


def _batches(cfg):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, cfg.vocab, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _capture_grads(sync, captured):
    """Keep the reduced gradients of the first step (replicated buckets hold whole gradients)."""
    finish = sync.finish

    def wrapped():
        buckets = finish()
        if not captured:
            captured.extend(b.reduced.clone() for b in buckets)
        return buckets

    sync.finish = wrapped


def _full_grads(models, sync, captured):
    """Serial name -> gradient of step 1, gathered over the tensor grid, for this rank's stages."""
    for bucket, flat in zip(sync.buckets, captured):
        offset = 0
        for p in bucket.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
    out = {}
    for m in models:
        out.update(full_weights(m, grads=True))
    return out


def _train(cfg, sizes, schedule=None, virtual=1, microbatches=1, seq_parallel=False, shard=False):
    layout = Layout(**sizes)
    grid = Grid(layout)
    opts = TensorOptions(dtype=torch.float64, seq_parallel=seq_parallel)
    if layout.pp > 1:
        micro_batch = BATCH // (layout.dp * layout.z * microbatches)
        pipe = Pipeline(grid, cfg, opts, schedule=schedule, microbatches=microbatches, micro_batch=micro_batch,
                        seq=SEQ // layout.cp, virtual=virtual, seed=5, std=0.3)
        models = pipe.models
        module = pipe.module
    else:
        pipe = None
        models = [Transformer(grid, cfg, opts, seed=5, std=0.3)]
        module = models[0]
    sync = GradientSync(module, grid, shard=shard, bucket_mb=0.001)
    captured = []
    if not shard:
        _capture_grads(sync, captured)
    # with ZeRO-1 the updated parameters' gathers are left in flight (the trainer's default)
    opt = AdamW(sync, lr=1e-2, weight_decay=0.1, clip_norm=0.5, overlap_gather=shard)
    c, cp = grid.coords, grid.group("cp")
    losses, sends = [], []
    for ids in _batches(cfg):
        local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
        inputs, targets = context.shard_sequence(local[:, :-1], cp), context.shard_sequence(local[:, 1:], cp)
        scale = 1.0 / ids[:, 1:].numel()
        grid.ledger.reset()
        if pipe is not None:
            loss = pipe.step(inputs, targets, scale=scale, ready=sync.wait_for)
        else:
            loss = models[0](inputs, targets).sum() * scale
            loss.backward()
            loss = loss.detach()
        sends.append(grid.ledger.bytes())
        losses.append(comm.all_reduce(loss.clone(), grid.group(("dp", "pp", "cp", "z"))).item())
        opt.step()
    grads = _full_grads(models, sync, captured) if captured else None
    sync.flush()  # (the weights are read outside a forward)
    return losses, opt.last_norm, grads, full_weights(module), sends[-1]


def _serial(cfg):
    grid = Grid(Layout())
    model = Transformer(grid, cfg, TensorOptions(dtype=torch.float64), seed=5, std=0.3)
    opt = torch.optim.AdamW(adamw_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    losses, grads = [], None
    for ids in _batches(cfg):
        loss = model(ids[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        grads = grads or {k: v.clone() for k, v in full_weights(model, grads=True).items()}  # before clipping
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norm, grads, full_weights(model)


@pytest.fixture(scope="module")
def serial(ranks):
    return {cfg: ranks.run(_serial, 1, cfg)[0] for cfg in (LLAMA, GPT, TIED_LLAMA)}


def _merge(results):
    """Per-rank results -> (losses, norm, gradients and weights of every stage)."""
    grads, weights = {}, {}
    for _, _, g, w, _ in results:
        grads.update(g or {})
        weights.update(w)
    losses, norm = results[0][0], results[0][1]
    return losses, norm, grads, weights


def _assert_close(got, expected, skip=()):
    for name, ref in expected.items():
        if name in skip:
            continue
        err = ((got[name] - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-10, (name, err)


CASES = [  # (model, grid, schedule, virtual stages, micro-batches, sequence parallel, ZeRO-1)
    (LLAMA, dict(pp=2, x=2, y=2), "1f1b", 1, 2, True, False),
    (LLAMA, dict(pp=2, dp=2, z=2), "gpipe", 1, 2, False, False),
    (LLAMA, dict(cp=2, y=2, dp=2), None, 1, 1, True, True),
    (LLAMA, dict(cp=2, pp=2, x=2), "interleaved-1f1b", 2, 4, False, False),
    (LLAMA, dict(cp=4, x=2), None, 1, 1, False, False),
    (LLAMA, dict(pp=4, cp=2), "1f1b", 1, 4, False, True),
    (LLAMA, dict(pp=2, y=2, z=2), "interleaved-1f1b", 2, 2, True, False),
    (GPT, dict(cp=2, y=2, dp=2), None, 1, 1, True, False),
    (GPT, dict(cp=4, z=2), None, 1, 1, False, False),
    # tied: the last stage's copy of the embedding
    (GPT, dict(pp=2, x=2, dp=2), "gpipe", 1, 2, False, False),
    (TIED_LLAMA, dict(pp=4, y=2), "1f1b", 1, 4, True, True),
    (TIED_LLAMA, dict(pp=2, z=2, dp=2), "interleaved-1f1b", 2, 2, False, False),
    (TIED_LLAMA, dict(pp=2, y=2, dp=2), "1f1b", 1, 2, False, True),  # the tied copy waits for its table's gather
]


def _case_id(case):
    cfg, sizes, schedule, virtual, micro, sp, shard = case
    grid = "".join(f"{k}{v}" for k, v in sizes.items())
    name = f"{cfg.family}{'-tied' if cfg.tied else ''}-{grid}-{schedule or 'nopp'}-m{micro}"
    return name + ("-sp" if sp else "") + ("-zero1" if shard else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_equals_serial(ranks, serial, case):
    cfg, sizes, schedule, virtual, micro, sp, shard = case
    results = ranks.run(_train, 8, cfg, sizes, schedule, virtual, micro, sp, shard)
    losses, norm, grads, weights = _merge(results)
    ref_losses, ref_norm, ref_grads, ref_weights = serial[cfg]
    assert losses == pytest.approx(ref_losses, rel=1e-10)
    assert norm == pytest.approx(ref_norm, rel=1e-10)
    # GPT-2's k bias has an exactly-zero gradient: rounding noise, and Adam amplifies it
    skip = {n for n in ref_weights if n.endswith("attn.k.bias")} if cfg.family == "gpt2" else set()
    if not shard:
        _assert_close(grads, ref_grads, skip)
    _assert_close(weights, ref_weights, skip)
    # P2P bytes of one step: activations between stages and ring attention, as the volumes say
    layout = Layout(**sizes)
    n_stages = layout.pp * virtual
    for rank, (*_, sent) in enumerate(results):
        c = layout.coords(rank)
        local_batch, seq = BATCH // (layout.dp * layout.z), SEQ // layout.cp
        stages = [c["pp"] + v * layout.pp for v in range(virtual)]
        layers = split_layers(cfg.layers, n_stages)
        expected = pipeline_sends(cfg, layout.sizes, local_batch // micro, seq, micro, stages, n_stages,
                                  seq_parallel=sp) if layout.pp > 1 else []
        for s in stages:
            expected += model_collectives(cfg, layout.sizes, local_batch // micro, seq, seq_parallel=sp,
                                          layers=len(layers[s]), first=s == 0, last=s == n_stages - 1) * micro
        # gradient buckets (over dp, cp and more) may launch during the last backward: not counted here
        model_sent = {k: v for k, v in sent.items() if not {"dp", "cp"} <= set(k[0].split("_"))}
        assert model_sent == ledger_bytes(expected, layout.sizes, 8)


def _ring_against_sdpa(cp, heads, kv_heads):
    grid = Grid(Layout(cp=cp))
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 16, 8
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected.backward(grad)
    group = grid.group("cp")
    local = [context.shard_sequence(t.detach(), group, dim=2).requires_grad_() for t in (q, k, v)]
    out = context.ring_attention(*local, group)
    out.backward(context.shard_sequence(grad, group, dim=2))
    errors = [(out - context.shard_sequence(expected.detach(), group, 2)).abs().max().item()]
    errors += [(mine.grad - context.shard_sequence(full.grad, group, 2)).abs().max().item()
               for mine, full in zip(local, (q, k, v))]
    return max(errors)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_equals_causal_attention(ranks, cp):
    """Output and dQ, dK, dV of load-balanced ring attention equal full causal attention (MHA, GQA)."""
    for heads, kv_heads in ((4, 4), (4, 2)):
        assert max(ranks.run(_ring_against_sdpa, cp, cp, heads, kv_heads)) < 1e-12


def test_sequence_chunks_name_the_fix():
    with pytest.raises(ValueError, match="divisible by 2\\*cp = 4"):
        context.check_sequence(6, 2)


def test_flash_kernel_contract_is_checked_on_every_device():
    """The CUDA flash backward misreads a strided log-sum-exp (a later rank's block is seen by the
    second half of the rows): the contract refuses one on CPU too, so the ring attention test
    above runs the GPU's contract."""
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    out, lse, extra = context.attend_block(q, k, v, True, 0.25)
    rows = slice(4, None)
    with pytest.raises(RuntimeError, match="log-sum-exp as a contiguous"):
        context.attend_block_backward(out[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows],
                                      False, 0.25, extra)
    dq, dk, dv = context.attend_block_backward(out[:, :, rows], q[:, :, rows], k, v, out[:, :, rows],
                                               lse[:, :, rows].contiguous(), False, 0.25, extra)
    assert dq.shape == q[:, :, rows].shape
    with pytest.raises(RuntimeError, match="unit stride"):
        context.attend_block(q.transpose(-1, -2), k, v, True, 0.25)


def test_rules_refuse_ring_attention_in_float32_on_gpus():
    from fourfold.models.config import load_config
    from fourfold.spec.job import Job
    from fourfold.spec.rules import problems

    job = Job(Layout(cp=2), global_batch=1, seq=64, precision="float32")
    found = problems(load_config("tiny-llama"), job, gpu=True)
    assert [p.fix for p in found] == ["use precision bf16 (or auto), or cp=1"]
    assert problems(load_config("tiny-llama"), job) == []  # CPU's flash kernel takes float32
    # attention sinks run the ring's kernel on one rank too
    alone = Job(Layout(x=8), global_batch=1, seq=64, precision="float32")
    assert [p.fix for p in problems(load_config("gpt-oss-20b"), alone, gpu=True)] == ["use precision bf16 (or auto)"]
    assert problems(load_config("tiny-llama"), alone, gpu=True) == []


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (2, 4, 2), (8, 2, 8), (4, 3, 4)])
def test_held_activations_are_those_of_torchs_interleaved_schedule(p, v, m):
    """The most chunk forwards a pipeline rank runs before their backwards, in the op lists torch's
    ScheduleInterleaved1F1B (the runtime's schedule) builds, times a chunk's layers, is what the
    estimate holds. (The schedule's own per-rank method, called with the attributes its constructor
    sets: torch is pinned, and a change to its private API fails here loudly.)"""
    me = types.SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                               microbatches_per_round=m // max(1, m // p))
    most = 0
    for rank in range(p):
        alive = 0
        for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(me, rank):
            if action is not None:
                alive += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}[action.computation_type]
                most = max(most, alive)
    chunk = 2  # layers a stage
    assert held_layers(chunk * p * v, p, v, m, "interleaved-1f1b") == most * chunk
    assert held_layers(chunk * p, p, 1, m, "1f1b") == min(p, m) * chunk  # 1F1B: p micro-batches on the first rank
    assert held_layers(chunk * p, p, 1, m, "gpipe") == m * chunk  # GPipe: every micro-batch
