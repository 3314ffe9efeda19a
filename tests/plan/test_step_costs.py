"""The step-time model's costs read from the frameworks' sources (docs/planner.md, "Costs read from
the frameworks' sources"), each against a figure worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from fourfold.models.config import load_config
from fourfold.plan import perf
from fourfold.plan.constants import Calibration, constants
from fourfold.plan.costs import attention_seconds, gemm_efficiency, group_bandwidth
from fourfold.plan.frameworks import FOURFOLD, MEGATRON
from fourfold.spec.hardware import make_cluster
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import pipeline_sends

pytestmark = pytest.mark.torch_free

LLAMA = load_config("llama-3.1-8b")
A100 = make_cluster("dgx-a100")


def job(layout: Layout, *, seq: int = 8192, micro_batch: int = 1, recompute: str = "none",
        seq_parallel: bool = True) -> Job:
    return Job(layout, global_batch=64, micro_batch=micro_batch, seq=seq, recompute=recompute,
               seq_parallel=seq_parallel, precision="bf16")


def test_the_loss_moves_the_ranks_fp32_logits_through_hbm():
    """The head: its GEMMs (forward, dX, dW), then the cross-entropy's passes over the rank's
    T x V/tp logits, 52 bytes a logit in Megatron-Core (bf16 logits), 80 in fourfold's chunked loss;
    on a pipeline of one, Megatron's DDP hook adding the embedding table's gradient into its fp32
    accumulator (10 bytes a parameter; the head's own accumulates in its GEMM)."""
    s, k = job(Layout(dp=2, y=4)), constants(Calibration(), A100)
    T, V = s.seq, LLAMA.vocab / 4
    gemms = 6 * T * LLAMA.hidden * V / (A100.gpu.bf16_tflops * 1e12 * gemm_efficiency(T, LLAMA.hidden, V, k))
    head = perf._compute(LLAMA, s, A100, k, MEGATRON).head
    assert head == pytest.approx(gemms + (T * V * 52 + 10 * LLAMA.hidden * V) / (A100.gpu.hbm_tbs * 1e12))
    assert FOURFOLD.loss_bytes(2) == 80 and MEGATRON.loss_bytes(2) == 52


def test_the_embedding_tables_bucket_shows_whatever_the_overlap():
    """With every other bucket hidden (overlap 1, a long backward), the data-parallel time is the
    table's reduce-scatter (fp32) and all-gather (bf16) over dp, inside one node."""
    s = job(Layout(dp=2, y=4), micro_batch=8)
    hidden = dataclasses.replace(Calibration(), dp_overlap=1.0, param_gather_overlap=1.0)
    table = LLAMA.hidden * LLAMA.vocab / 4
    by_hand = (4 + 2) * table * (2 - 1) / 2 / group_bandwidth(s.layout, A100, ("dp", "cp"), hidden)
    assert perf.step_time(LLAMA, s, A100, hidden, MEGATRON).dp_comm == pytest.approx(by_hand)


def test_selective_recompute_runs_the_attention_core_again_and_flash_attentions_backward_is_2_5_forwards():
    k = constants(Calibration(), A100)
    layer = {r: perf._compute(LLAMA, job(Layout(dp=8), recompute=r), A100, k, MEGATRON)
             for r in ("none", "selective", "full")}
    attention = attention_seconds(8192, 1, 1, LLAMA.heads, LLAMA.block.head_dim, A100.gpu.bf16_tflops, k)
    assert layer["selective"].layer - layer["none"].layer == pytest.approx(attention)
    assert layer["full"].layer - layer["none"].layer == pytest.approx(layer["none"].forward)
    # forward, twice it in backward, and flash attention's extra half forward of attention
    overhead = k.layer_overhead_us * 1e-6
    assert layer["none"].layer - overhead == pytest.approx(3 * layer["none"].forward + 0.5 * attention)
    standard = perf._compute(LLAMA, job(Layout(dp=8)), A100, k, MEGATRON, perf.RunTraits(flash_attention=False))
    assert standard.layer - overhead == pytest.approx(3 * standard.forward)


def test_userbuffers_sm_based_overlaps_take_their_share_of_the_gpu():
    """Transformer Engine's pipelined and bulk overlaps run on 16 SMs beside their GEMM: the cost
    is 16/sms of the time both run, so it halves when the GPU has twice the SMs, and is not priced
    on a GPU whose SMs are unknown."""
    s, h100 = job(Layout(dp=2, y=8)), make_cluster("dgx-h100")
    k = constants(Calibration(), h100)

    def pipelined(sms: int) -> float:
        cluster = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, sms=sms))
        return MEGATRON.tensor_comm(LLAMA, s, cluster, k, 0.0, h100.gpu.bf16_tflops, gemm_overlap=True)

    assert h100.gpu.sms == 132
    share = pipelined(132) - pipelined(0)
    assert share > 0 and pipelined(264) - pipelined(0) == pytest.approx(share / 2)


def test_pipeline_sends_carry_what_each_runtime_sends():
    """fourfold sends its stream shard: the sequence split over y only under sequence parallelism
    (`spec.volumes.pipeline_sends`); Megatron a 1/tp slice either way (scatter-gather without it)."""
    for sp in (True, False):
        s = job(Layout(dp=2, pp=2, y=4), seq_parallel=sp)
        shard = pipeline_sends(LLAMA, s.layout.sizes, 1, s.seq, 1, [0], 2, seq_parallel=sp)[0].numel
        assert FOURFOLD.pipeline_sends(LLAMA, s, s.seq)[0].numel == shard
        assert MEGATRON.pipeline_sends(LLAMA, s, s.seq)[0].numel == s.seq * LLAMA.hidden // 4


def test_the_optimizer_step_moves_each_runtimes_bytes_over_its_shard_and_the_ranks_gradients():
    """Against the models' own parameter counts. Llama 3.1 8B (untied) on tp2, dp8 under Megatron-Core:
    the rank holds half of every parameter (norms too, as the model counts them: within 0.1%), the
    ZeRO-1 shard an eighth of that; 38 bytes a shard parameter (norm, fused Adam, bf16 copy), 8 a
    rank's (the NaN check's norm and the zeroing of the gradient buffer). Mixtral 8x7B on dp4 cp2 ep2
    under fourfold: the rank holds the dense parameters and half the experts; the shard is every
    parameter over dp*cp (an expert's replicas are dp*cp/ep, each with 1/ep of them); 54 bytes a shard
    parameter (with the clip's and the decay's passes), 4 a rank's."""
    hbm = A100.gpu.hbm_tbs * 1e12
    s = job(Layout(dp=8, y=2))
    optimizer = perf._compute(LLAMA, s, A100, constants(Calibration(), A100), MEGATRON).optimizer
    held = LLAMA.parameter_count() / 2
    assert optimizer == pytest.approx((38 * held / 8 + 8 * held) / hbm, rel=1e-3)
    mixtral = load_config("mixtral-8x7b")
    s = job(Layout(dp=4, cp=2, ep=2), seq=4096)
    optimizer = perf._compute(mixtral, s, A100, constants(Calibration(), A100), FOURFOLD).optimizer
    b = mixtral.block
    experts = mixtral.layers * b.experts * 3 * mixtral.hidden * b.ffn
    total = mixtral.parameter_count()
    held = total - experts + experts / 2
    assert optimizer == pytest.approx((54 * total / 8 + 4 * held) / hbm, rel=1e-3)


def test_fourfold_adds_each_micro_batchs_gradients_into_their_accumulators_and_megatrons_gemms_do():
    """fourfold's GradientSync adds autograd's bf16 gradient into the fp32 accumulator of every
    parameter, every micro-batch (10 bytes a parameter); Megatron's weight-gradient GEMMs accumulate
    into main_grad themselves. A layer of Llama 3.1 8B on tp2: its parameters over the tensor grid,
    as the model counts them (a 32nd of the parameters outside the tables, within 0.1%)."""
    s, k = job(Layout(dp=4, y=2)), constants(Calibration(), A100)
    layer = {f.name: perf._compute(LLAMA, s, A100, k, f).layer for f in (FOURFOLD, MEGATRON)}
    per_layer = (LLAMA.parameter_count() - 2 * LLAMA.hidden * LLAMA.vocab) / LLAMA.layers / 2
    assert layer["fourfold"] - layer["megatron"] == pytest.approx(10 * per_layer / (A100.gpu.hbm_tbs * 1e12), rel=1e-3)
