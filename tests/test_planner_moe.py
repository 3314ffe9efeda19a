"""The planner on today's runtime features: mixtures of experts (no expert parallelism) and tied
embeddings over pipeline stages. Pure arithmetic, no processes."""

from dataclasses import replace

import pytest

from fourfold.models.config import load_config
from fourfold.plan import routing
from fourfold.plan.memory import estimate_memory
from fourfold.plan.perf import Calibration, comm_seconds, constants, step_time
from fourfold.plan.search import predict, search
from fourfold.spec.counts import parameter_count
from fourfold.spec.hardware import make_cluster
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import problems
from fourfold.spec.volumes import tied_copy_sends

MIXTRAL = load_config("mixtral-8x7b")
GPT20 = load_config("gpt-20b")
H100 = make_cluster("dgx-h100")


def job(*, dp=1, pp=1, cp=1, x=1, y=1, z=1, micro_batch=1, seq=4096, global_batch=1024, recompute="none") -> Job:
    return Job(Layout(dp=dp, pp=pp, cp=cp, x=x, y=y, z=z), micro_batch=micro_batch, seq=seq,
               global_batch=global_batch, recompute=recompute, seq_parallel=True, precision="bf16")


def test_the_mixtral_preset_is_the_published_config():
    assert (MIXTRAL.family, MIXTRAL.hidden, MIXTRAL.layers, MIXTRAL.heads, MIXTRAL.kv_heads, MIXTRAL.ffn) == (
        "mixtral", 4096, 32, 32, 8, 14336)
    assert (MIXTRAL.experts, MIXTRAL.top_k, MIXTRAL.vocab, MIXTRAL.max_positions, MIXTRAL.tied) == (
        8, 2, 32000, 32768, False)
    assert round(parameter_count(MIXTRAL) / 1e9, 1) == 46.7  # Mistral's figures: 46.7B, 12.9B active
    assert round(parameter_count(MIXTRAL, active=True) / 1e9, 1) == 12.9


@pytest.mark.parametrize("framework", ["fourfold", "megatron"])
def test_plan_and_estimate_run_for_mixtral(framework):
    ranking = search(MIXTRAL, 64, H100, job(), framework=framework, top=3)
    assert ranking and all(r["pp"] == 1 for r in ranking)  # the rules refuse pp > 1 with experts
    best = ranking[0]
    assert best["fits"] and best["step_seconds"] > 0
    again = predict(MIXTRAL, best["job"], H100, framework=framework)
    assert again["step_seconds"] == pytest.approx(best["step_seconds"])


def test_memory_holds_every_expert_and_time_runs_the_active_ones():
    """A dense Llama of Mixtral's active size (an MLP of top_k * ffn): the mixture holds about 3.6x
    its weights, gradients and optimizer state, while its step computes about as much."""
    dense = replace(MIXTRAL, family="llama", experts=0, top_k=0, norm_topk=False, ffn=MIXTRAL.top_k * MIXTRAL.ffn)
    assert parameter_count(dense) == pytest.approx(parameter_count(MIXTRAL, active=True), rel=1e-4)
    s = job(dp=8, y=4, z=2, micro_batch=4)
    moe, base = estimate_memory(MIXTRAL, s, 80), estimate_memory(dense, s, 80)
    ratio = parameter_count(MIXTRAL) / parameter_count(dense)
    for term in ("weights", "gradients", "optimizer"):
        assert moe.terms[term] > base.terms[term]
        assert moe.terms[term] / base.terms[term] == pytest.approx(ratio, rel=0.01)
    assert moe.terms["activations"] > base.terms["activations"]  # router and the experts' weighted outputs
    t_moe, t_dense = step_time(MIXTRAL, s, H100), step_time(dense, s, H100)
    assert t_moe.flops_per_gpu == pytest.approx(t_dense.flops_per_gpu, rel=1e-3)
    assert t_dense.compute < t_moe.compute < 1.5 * t_dense.compute  # smaller expert GEMMs, the router, the sums


def test_activations_scale_with_the_experts_a_token_runs():
    s = job(dp=8, y=4, z=2, micro_batch=4)
    one, two = (estimate_memory(replace(MIXTRAL, top_k=k), s, 80).terms["activations"] for k in (1, 2))
    assert two > one
    full = estimate_memory(MIXTRAL, replace(s, recompute="full"), 80)
    assert full.terms["activations"] < two  # full recompute keeps each layer's input only


def test_a_shared_expert_adds_its_weights_and_activations():
    qwen = replace(MIXTRAL, family="qwen2_moe", norm_topk=False, layers=4)
    shared = replace(qwen, shared_ffn=5632)
    s = job(dp=8, y=4, z=2, micro_batch=4)
    a, b = estimate_memory(qwen, s, 80), estimate_memory(shared, s, 80)
    assert b.terms["weights"] > a.terms["weights"] and b.terms["activations"] > a.terms["activations"]
    assert step_time(shared, s, H100).total > step_time(qwen, s, H100).total


def test_the_balanced_routing_spreads_every_choice():
    for tokens in (1, 7, 4096, 16384):
        routed = routing.balanced_routing(MIXTRAL.block, tokens)
        assert len(routed) == 8 and sum(routed) == 2 * tokens and max(routed) - min(routed) <= 1
    assert routing.replicated_params(MIXTRAL.block) == 8 * 4096


def test_tied_pipelines_are_scored():
    s = job(dp=16, pp=2, z=2, micro_batch=4, seq=2048)
    assert GPT20.tied and not problems(GPT20, s, gpu=True)
    ranking = search(GPT20, 64, H100, job(seq=2048))
    assert any(r["pp"] > 1 for r in ranking)


@pytest.mark.parametrize("framework", ["fourfold", "megatron"])
def test_a_tied_pipelines_step_includes_the_tables_traffic(framework):
    s = job(dp=16, pp=2, y=2 if framework == "megatron" else 1, z=1 if framework == "megatron" else 2,
            micro_batch=4, seq=2048)
    tied, untied = step_time(GPT20, s, H100, framework=framework), step_time(replace(GPT20, tied=False), s, H100,
                                                                             framework=framework)
    assert tied.breakdown()["tied_embedding"] > 0 and untied.tied_embedding == 0
    assert tied.total == pytest.approx(untied.total + tied.tied_embedding)
    assert tied.total == pytest.approx(sum(tied.breakdown().values()))
    if framework == "fourfold":  # the table's send, exposed; its gradient's hides in half the bubble here
        k = constants(Calibration(), H100)
        table = comm_seconds(tied_copy_sends(GPT20, dict(s.layout.sizes), [0], 2), s, H100, 2, k)
        assert tied.tied_embedding >= table
    no_pipeline = step_time(GPT20, replace(s, layout=Layout(**{**s.layout.sizes, "pp": 1, "dp": 32})), H100,
                            framework=framework)
    assert no_pipeline.tied_embedding == 0
