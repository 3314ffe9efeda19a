"""The planner on today's runtime features: mixtures of experts (with and without expert
parallelism) and tied embeddings over pipeline stages. Pure arithmetic, no processes."""

import json
import math
from dataclasses import replace

import pytest

from fourfold.cli.main import main
from fourfold.models.config import load_config
from fourfold.plan import perf, routing
from fourfold.plan.constants import Calibration, Profile, constants
from fourfold.plan.costs import comm_seconds
from fourfold.plan.frameworks import FOURFOLD, MEGATRON
from fourfold.plan.frameworks.fourfold import Fourfold, expert_exchange_bytes
from fourfold.plan.memory import fourfold_memory
from fourfold.plan.perf import RunTraits, step_time
from fourfold.plan.search import check, predict, search
from fourfold.spec.counts import layer_params, parameter_count
from fourfold.spec.hardware import make_cluster
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import JobError, problems
from fourfold.spec.volumes import Collective, ledger_bytes, model_collectives, tied_copy_sends

pytestmark = pytest.mark.torch_free

MIXTRAL = load_config("mixtral-8x7b")
GPT20 = load_config("gpt-20b")
H100 = make_cluster("dgx-h100")


def job(*, dp=1, pp=1, cp=1, x=1, y=1, z=1, ep=1, micro_batch=1, seq=4096, global_batch=1024,
        recompute="none") -> Job:
    return Job(Layout(dp=dp, pp=pp, cp=cp, x=x, y=y, z=z, ep=ep), micro_batch=micro_batch, seq=seq,
               global_batch=global_batch, recompute=recompute, seq_parallel=True, precision="bf16")


def test_the_mixtral_preset_is_the_published_config():
    assert (MIXTRAL.family, MIXTRAL.hidden, MIXTRAL.layers, MIXTRAL.heads, MIXTRAL.kv_heads, MIXTRAL.ffn) == (
        "mixtral", 4096, 32, 32, 8, 14336)
    assert (MIXTRAL.experts, MIXTRAL.top_k, MIXTRAL.vocab, MIXTRAL.max_positions, MIXTRAL.tied) == (
        8, 2, 32000, 32768, False)
    assert round(parameter_count(MIXTRAL) / 1e9, 1) == 46.7  # Mistral's figures: 46.7B, 12.9B active
    assert round(parameter_count(MIXTRAL, active=True) / 1e9, 1) == 12.9


@pytest.mark.parametrize("framework", [FOURFOLD, MEGATRON], ids=lambda f: f.name)
def test_plan_and_estimate_run_for_mixtral(framework):
    ranking = search(MIXTRAL, 64, H100, job(), framework=framework, top=3)
    assert ranking and any(r["ep"] > 1 for r in ranking)  # both profiles split the experts
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
    moe, base = fourfold_memory(MIXTRAL, s, 80), fourfold_memory(dense, s, 80)
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
    one, two = (fourfold_memory(replace(MIXTRAL, top_k=k), s, 80).terms["activations"] for k in (1, 2))
    assert two > one
    full = fourfold_memory(MIXTRAL, replace(s, recompute="full"), 80)
    assert full.terms["activations"] < two  # full recompute keeps each layer's input only


def test_a_shared_expert_adds_its_weights_and_activations():
    qwen = replace(MIXTRAL, family="qwen2_moe", norm_topk=False, layers=4)
    shared = replace(qwen, shared_ffn=5632)
    s = job(dp=8, y=4, z=2, micro_batch=4)
    a, b = fourfold_memory(qwen, s, 80), fourfold_memory(shared, s, 80)
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


@pytest.mark.parametrize("framework", [FOURFOLD, MEGATRON], ids=lambda f: f.name)
def test_a_tied_pipelines_step_includes_the_tables_traffic(framework):
    s = job(dp=16, pp=2, y=2 if framework is MEGATRON else 1, z=1 if framework is MEGATRON else 2,
            micro_batch=4, seq=2048)
    tied, untied = step_time(GPT20, s, H100, framework=framework), step_time(replace(GPT20, tied=False), s, H100,
                                                                             framework=framework)
    assert tied.breakdown()["tied_embedding"] > 0 and untied.tied_embedding == 0
    assert tied.total == pytest.approx(untied.total + tied.tied_embedding)
    assert tied.total == pytest.approx(sum(tied.breakdown().values()))
    if framework is FOURFOLD:  # the table's send, exposed; its gradient's hides in half the bubble here
        k = constants(Calibration(), H100)
        table = comm_seconds(tied_copy_sends(GPT20, dict(s.layout.sizes), [0], 2), s, H100, 2, k)
        assert tied.tied_embedding >= table
    no_pipeline = step_time(GPT20, replace(s, layout=Layout(**{**s.layout.sizes, "pp": 1, "dp": 32})), H100,
                            framework=framework)
    assert no_pipeline.tied_embedding == 0


# Expert parallelism (`Layout.ep`): a rank holds experts/ep experts and exchanges its tokens' rows.
EXPERTS6 = replace(MIXTRAL, experts=6, layers=4)  # 2 * T choices do not divide over 6 experts: an uneven routing


def _runtime_exchange(cfg, tokens: int, ep: int) -> tuple[tuple[int, ...], tuple[int, int]]:
    """(rows each expert of expert-group rank 0 runs, (rows it sends to, rows it receives from the
    other ranks)) as `ParallelMoE._exchanged` computes them on fake tensors: choice i (of top_k *
    tokens) to expert i % experts, every rank routing alike; written out again from that rule."""
    choices = cfg.top_k * tokens
    per = [len(range(e, choices, cfg.experts)) for e in range(cfg.experts)]
    local = cfg.experts // ep
    send = [sum(per[s * local:(s + 1) * local]) for s in range(ep)]
    received = [per[:local]] * ep  # [source][expert]: rank 0's experts
    here = [sum(r) for r in received]
    routed = tuple(sum(r[j] for r in received) for j in range(local))
    return routed, (sum(send) - send[0], sum(here) - here[0])


EP_GRIDS = [(MIXTRAL, dict(dp=8, ep=8), "none"), (MIXTRAL, dict(dp=8, y=2, ep=4, micro_batch=2), "selective"),
            (MIXTRAL, dict(dp=4, cp=2, x=2, ep=2), "none"), (MIXTRAL, dict(dp=16, z=2, ep=8, micro_batch=2), "full"),
            (EXPERTS6, dict(dp=6, x=2, ep=3), "none"), (EXPERTS6, dict(dp=4, pp=2, ep=2), "none")]


@pytest.mark.parametrize("case", EP_GRIDS, ids=["dp8-ep8", "dp8y2-ep4-selective", "dp4cp2x2-ep2", "dp16z2-ep8-full",
                                                "6-experts-dp6x2-ep3", "6-experts-dp4pp2-ep2"])
def test_expert_exchange_volumes_are_the_runtimes_at_the_balanced_routing(case):
    """The bytes the planner prices for the expert group (counts, rows out and back, and their
    gradients) are `spec.volumes`' (the runtime's ledger is tested against them) at the routing the
    runtime takes on fake tensors, for the rank the planner prices (rank 0, the busiest)."""
    cfg, sizes, recompute = case
    sizes = dict(sizes)
    mb = sizes.pop("micro_batch", 1)
    s = job(**sizes, micro_batch=mb, recompute=recompute, global_batch=4 * mb * sizes["dp"])
    assert not problems(cfg, s, gpu=True)
    batch, seq = mb // s.z, s.seq // s.cp
    routed, exchanged = _runtime_exchange(cfg, batch * seq, s.layout.ep)
    assert routing.local_routing(cfg.block, batch * seq, s.layout.ep) == routed
    assert routing.exchanged_rows(cfg.block, batch * seq, s.layout.ep) == exchanged
    layers = cfg.layers // s.pp
    volume_sizes = dict(s.layout.sizes, ep=s.layout.ep)
    expected = model_collectives(cfg, volume_sizes, batch, seq, seq_parallel=True, recompute=recompute, layers=layers,
                                 first=False, last=False, routing=[routed] * layers, exchanged=[exchanged] * layers)
    per_micro_batch = {op: float(sent) for (group, op), sent in ledger_bytes(expected, volume_sizes, 2).items()
                       if group == "ep"}
    assert per_micro_batch["all_to_all_v"] > 0
    priced = expert_exchange_bytes(cfg, s)
    assert priced == {op: sent * s.microbatches for op, sent in per_micro_batch.items()}


def test_expert_parallelism_holds_a_share_of_the_experts():
    """Weights and gradients hold experts/ep of every layer's experts; the optimizer state is the
    same (1/ep of the experts over 1/ep of the ranks); at a balanced routing the activations too (a
    rank's experts receive top_k * T rows, as many as its tokens chose), less the weighted outputs
    the local path keeps (measured in test_planner_measured)."""
    s1 = job(dp=16, y=4, z=2, micro_batch=4)
    one = fourfold_memory(MIXTRAL, s1, 80)
    matrices, _ = layer_params(MIXTRAL)
    experts = MIXTRAL.experts * 3 * MIXTRAL.hidden * MIXTRAL.ffn
    assert routing.expert_params(MIXTRAL.block) == experts and experts < matrices
    for ep in (2, 4, 8):
        s = replace(s1, layout=replace(s1.layout, ep=ep))
        m = fourfold_memory(MIXTRAL, s, 80)
        dropped = MIXTRAL.layers * experts / (s.x * s.y * s.z) * (1 - 1 / ep)
        assert one.terms["weights"] - m.terms["weights"] == pytest.approx(2 * dropped)
        assert one.terms["gradients"] - m.terms["gradients"] == pytest.approx(4 * dropped)
        assert m.terms["optimizer"] == pytest.approx(one.terms["optimizer"])
        # the rows back from the all-to-all are the only outputs kept: one [top_k * T, h/x] less a layer
        tokens = s.seq * s.micro_batch / s.z
        kept_less = MIXTRAL.layers * 2 * MIXTRAL.block.top_k * tokens * MIXTRAL.hidden / s.x
        assert one.terms["activations"] - m.terms["activations"] == pytest.approx(kept_less)
        assert (m.replicas, m.expert_replicas) == (16, 16 // ep)  # the checkpoint's writers, as the trainer's


def test_expert_parallel_all_to_all_inside_a_node_and_across_nodes():
    """An all-to-all's time is the bytes a rank sends to the others over the link they take: NVLink
    when the ep group sits in a node, the NICs for the share bound for other nodes when it does
    not; the expert weights' gradients are reduced over their replicas only."""
    k = constants(Calibration(), H100)
    intra = H100.intra_node_gbs * k.intra_node_efficiency * 1e9
    inter = H100.inter_node_gbs * k.inter_node_efficiency * 1e9
    sent = Collective("ep", "all_to_all_v", 2**20)
    inside = job(dp=64, ep=8)  # ep: 8 consecutive dp ranks, one node
    assert comm_seconds([sent], inside, H100, 2, k) == pytest.approx(2 * 2**20 / intra + 7 * k.latency_us * 1e-6)
    across = job(dp=8, x=8, ep=8)  # 8 dp ranks 8 apart: one per node
    assert comm_seconds([sent], across, H100, 2, k) == pytest.approx(2 * 2**20 / min(inter, intra)
                                                                     + 7 * k.latency_us * 1e-6)
    half = job(dp=16, x=4, ep=4)  # 4 dp ranks 4 apart: two on each of two nodes
    off = 2 / 3  # of the 3 others, 2 on the other node
    assert comm_seconds([sent], half, H100, 2, k) == pytest.approx(
        max(off * 2 * 2**20 / min(inter, intra), (1 - off) * 2 * 2**20 / intra) + 3 * k.latency_us * 1e-6)
    # the step: the exchange costs more across nodes; ep = dp*cp leaves the experts' gradients unreduced
    t_inside, t_dense = step_time(MIXTRAL, job(dp=64, ep=8), H100), step_time(MIXTRAL, job(dp=64), H100)
    assert t_inside.exposed_comm > t_dense.exposed_comm == 0
    exposed = replace(Calibration(), dp_overlap=0.0)  # (hidden, the reduction would not show its bytes)
    assert step_time(MIXTRAL, job(dp=64, ep=8), H100, exposed).dp_comm < step_time(MIXTRAL, job(dp=64), H100,
                                                                                   exposed).dp_comm
    t_across = step_time(MIXTRAL, job(dp=8, x=8, ep=8), H100)
    one_node = make_cluster("dgx-h100", gpus_per_node=64)  # the same grid with every group on NVLink
    assert t_across.exposed_comm > step_time(MIXTRAL, job(dp=8, x=8, ep=8), one_node).exposed_comm
    # the experts' GEMMs: one expert on 8x the rows instead of 8 (balanced: as many FLOPs, larger GEMMs);
    # apart from each micro-batch's gradient accumulation (10 bytes a parameter), an eighth of the experts'
    def gemms(s) -> float:
        accumulated = 10 * MIXTRAL.layers * sum(perf._layer_params_per_rank(MIXTRAL, s)) / (H100.gpu.hbm_tbs * 1e12)
        return step_time(MIXTRAL, s, H100).compute - s.microbatches * accumulated

    assert gemms(job(dp=8, x=8, ep=8)) == pytest.approx(gemms(job(dp=8, x=8)), rel=0.02)


def test_search_tries_expert_parallelism_for_mixtures_only():
    ranking = search(MIXTRAL, 64, H100, job(), micro_batches=(2,), top=None)
    eps = {r["ep"] for r in ranking}
    assert eps == {1, 2, 4, 8}
    assert all(math.gcd(MIXTRAL.experts, r["dp"] * r["cp"]) % r["ep"] == 0 for r in ranking)
    assert {r["ep"] for r in search(GPT20, 64, H100, job(seq=2048), top=3)} == {1}
    # Megatron-Core splits the experts over dp only (fourfold over dp*cp)
    check(MIXTRAL, job(dp=4, cp=2, ep=8, seq=8192))
    with pytest.raises(JobError, match="Megatron-Core splits the experts over data-parallel ranks only: ep=8 does "
                                       "not divide dp=4; choose an ep dividing dp"):
        check(MIXTRAL, job(dp=4, cp=2, ep=8, seq=8192), framework=MEGATRON)
    shared = replace(MIXTRAL, family="qwen2_moe", shared_ffn=7168)
    with pytest.raises(JobError, match="Megatron-Core \\(0.8\\) has no shared experts"):
        check(shared, job(dp=8, ep=8), framework=MEGATRON)
    with pytest.raises(JobError, match="mixture layers need sequence parallelism with tensor parallelism"):
        check(MIXTRAL, replace(job(dp=4, y=2), seq_parallel=False), framework=MEGATRON)
    megatron = search(MIXTRAL, 64, H100, job(), micro_batches=(2,), framework=MEGATRON, top=None)
    assert {r["ep"] for r in megatron} == {1, 2, 4, 8}
    assert all(r["dp"] % r["ep"] == 0 and (r["cp"] == 1 or r["ep"] == 1) for r in megatron)


def test_megatrons_expert_parallelism_by_hand():
    """Megatron-Core's all-to-all dispatcher with tp 1 (Mixtral, dp8 ep8 on one DGX H100): each layer
    and micro-batch sends every (token, expert) choice's row to its expert's rank and back, forward
    and backward, exposed; a rank holds 1/8 of the experts, their optimizer state over the dp/ep = 1
    rank that holds them."""
    one, eight = job(dp=8, micro_batch=2, global_batch=64), job(dp=8, ep=8, micro_batch=2, global_batch=64)
    t1, t8 = step_time(MIXTRAL, one, H100, framework=MEGATRON), step_time(MIXTRAL, eight, H100, framework=MEGATRON)
    tokens, h = 2 * 4096, MIXTRAL.hidden
    message = 7 / 8 * tokens * MIXTRAL.top_k * h * 2  # bytes a rank sends to the other 7, bf16
    k = constants(Calibration(), H100)
    a2a = message / (H100.intra_node_gbs * 1e9 * k.intra_node_efficiency) + 7 * k.latency_us * 1e-6  # on NVLink
    per_step = MIXTRAL.layers * one.microbatches * 4 * a2a  # out and back, forward and backward
    assert t8.exposed_comm - t1.exposed_comm == pytest.approx(per_step, rel=1e-9)
    experts = routing.expert_params(MIXTRAL.block) * MIXTRAL.layers
    m1, m8 = (MEGATRON.memory(MIXTRAL, s, 80) for s in (one, eight))
    assert m1.terms["weights_and_grads"] - m8.terms["weights_and_grads"] == pytest.approx(6 * experts * 7 / 8)
    # 1/8 of the experts' state either way: sharded over the 8 replicas, or whole on the one rank holding those experts
    assert m1.terms["optimizer"] == pytest.approx(m8.terms["optimizer"])


def test_a_mixtures_search_places_its_expert_groups_inside_a_node_where_that_is_faster():
    """For a mixture the search also tries the data dims innermost (ep consecutive dp*cp ranks then
    share a node); a dense model's search does not. (Both links at their peaks, not a fit's figures:
    where each order wins depends on the inside- and across-node rates.)"""
    peaks = Calibration(profiles=(Profile("dgx-h100", 0.75, 400, 1.0, 1.0),))  # NVLink and NICs at their peaks
    ranking = search(MIXTRAL, 64, H100, job(), micro_batches=(2,), top=None, cal=peaks)
    inner = [r for r in ranking if r["order"].startswith("cp,dp")]
    assert inner and any(r["ep"] > 1 for r in inner)
    # where it wins: ep8 over dp*cp with z2 innermost would put each expert group on 8 nodes
    best = {(r["dp"], r["z"], r["ep"], r["micro_batch"]): r for r in ranking}.get((32, 2, 8, 2))
    assert best is not None and best["order"].startswith("cp,dp")
    assert not any(r["order"].startswith("cp,dp") for r in search(GPT20, 64, H100, job(seq=2048), top=None))


def test_estimate_takes_ep_and_hands_it_to_train(capsys):
    code = main(["estimate", "--model", "mixtral-8x7b", "--dp", "64", "--ep", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if out["fits"] else 3)  # 3: it does not fit (cli.plan.NO_FIT)
    assert out["ep"] == 8 and "--ep 8" in out["commands"]["estimate"] and "--grid.ep 8" in out["commands"]["train"]
    main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--top", "3"])
    table = capsys.readouterr().out
    first = next(line for line in table.splitlines() if line.startswith("dp"))
    assert " ep" in first and "--grid.ep" in table


def test_fp8_speeds_the_dense_linears_and_leaves_fourfolds_routed_experts():
    """`--fp8` prices fourfold's FP8 linears: the dense ones faster, the experts' grouped GEMM in the
    model's dtype (train.fp8 leaves it); a measured run with FP8 (Transformer Engine) runs its experts in FP8."""
    s = job(dp=8, y=4, z=2, micro_batch=4)
    bf16, fp8 = step_time(MIXTRAL, s, H100), step_time(MIXTRAL, replace(s, fp8="rowwise"), H100)
    measured = step_time(MIXTRAL, s, H100, traits=RunTraits(fp8=True))
    # (the compute: faster GEMMs hide less of the tensor collectives, which may show more)
    assert measured.compute < fp8.compute < bf16.compute
    alone = job(dp=8, micro_batch=4)  # no tensor collectives: the step is faster too
    assert step_time(MIXTRAL, replace(alone, fp8="rowwise"), H100).total < step_time(MIXTRAL, alone, H100).total
    dense, waited = replace(MIXTRAL, experts=0, top_k=0), Fourfold(forward_chunks=1)  # (FP8's forward is unchunked)
    assert step_time(dense, replace(s, fp8="tensorwise"), H100, framework=waited).total == pytest.approx(
        step_time(dense, s, H100, framework=waited, traits=RunTraits(fp8=True)).total)
