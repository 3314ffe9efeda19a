"""One rank of a large job on this machine: the grid's groups on a fake world of thousands of
ranks, and `fourfold simulate` against the other measurement of the same runtime (measure_peak)."""

import dataclasses
import json
import types

import pytest
import torch.distributed as dist
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType
from torch.testing._internal.distributed.fake_pg import FakeStore

from fourfold.cli.main import main
from fourfold.models.config import load_config
from fourfold.parallel.grid import Grid
from fourfold.plan.memory import fourfold_memory
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.schedule import schedule_order
from fourfold.spec.volumes import ledger_bytes, pipeline_sends
from fourfold.tools.measure import measure_peak
from fourfold.tools.simulate import simulate

# The trainer's groups: each dim's, and its roles' (replicas, losses, tokens, the world)
TRAINER_GROUPS = ("dp", "pp", "cp", "x", "y", "z", ("dp", "cp"), ("dp", "pp", "cp", "z"), ("dp", "cp", "z"),
                  ("dp", "pp", "cp", "x", "y", "z"))


def test_grid_on_a_fake_world_of_4096_ranks_builds_only_its_own_groups():
    layout = Layout(dp=64, pp=2, cp=2, x=2, y=4, z=2)
    rank = 3001  # not rank 0: nothing may assume the first rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        grid = Grid(layout)
        for dims in TRAINER_GROUPS + (("dp", "cp", "x"), ("dp", "cp", "y", "z")):
            group = grid.group(dims)
            assert list(group.ranks) == layout.group_ranks(dims, rank)
            assert group.ranks[group.rank] == rank
        roles = (grid.replica_group(), grid.loss_group(), grid.token_group(), grid.world_group())
        assert roles == tuple(grid.group(dims) for dims in TRAINER_GROUPS[6:])
    finally:
        dist.destroy_process_group()


def test_groups_over_dims_of_size_one_share_the_other_dims_communicator():
    layout = Layout(dp=8, x=2, y=4)  # pp, cp and z are 1
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=layout.world_size)
    try:
        grid = Grid(layout)
        groups = {dims: grid.group(dims) for dims in TRAINER_GROUPS + (("dp", "cp", "x"), ("dp", "cp", "y", "z"))}
        for dims, group in groups.items():
            assert list(group.ranks) == layout.group_ranks(dims, 5)
        assert groups[("dp", "cp")].process_group is grid.group("dp").process_group
        assert groups[("dp", "cp", "y", "z")].process_group is grid.group(("dp", "y")).process_group
        assert grid.group(("dp", "cp")).name == "cp_dp"  # the ledger keeps the name asked for (innermost first)
        # every dim: the default group itself, not a copy of it
        assert grid.group(("dp", "pp", "cp", "x", "y", "z")).process_group is dist.group.WORLD
        # one communicator per distinct set of ranks (of more than one rank: DeviceMesh makes its
        # size-1 dims' own): dp, x, y, (dp, x), (dp, y) and (dp, x, y); 6 communicators for 9 groups of more
        # than one rank
        shared = [g for g in groups.values() if g.size > 1]
        assert len(shared) == 9 and len({id(g.process_group) for g in shared}) == len({g.ranks for g in shared}) == 6
    finally:
        dist.destroy_process_group()


def test_simulated_step_peaks_where_the_measured_one_does():
    """Two routes through the same runtime: with one micro-batch per step, simulate's step peak is
    measure_peak's, up to the trainer's loss scaling and accumulator (a few scalars)."""
    cfg = load_config("tiny-llama")
    job = Job(Layout(dp=2, x=2, y=2, z=2), global_batch=4, micro_batch=2, seq=64, seq_parallel=True,
              precision="bf16")
    sim = simulate(cfg, job, rank=0, steps=1)
    measured = measure_peak(cfg, job)
    step_peak = max(v for k, v in sim.device_peak_bytes.items() if k.startswith("step"))
    assert abs(step_peak - measured.peak_bytes) <= 256
    assert sim.device_peak_bytes["checkpoint save"] < measured.peak_bytes  # the save adds nothing over the step
    assert sim.save["chunks"] > 0 and sim.save["bytes_written"] > 0
    # the dp replicas share the weights' writing: a rank stages its optimizer share and about half the weights
    assert sim.save["bytes_written"] == pytest.approx(fourfold_memory(cfg, job, 80.0).checkpoint_host_bytes, rel=0.01)
    ops = {(c["group"], c["op"]) for c in sim.collectives_per_step}
    assert ("cp_dp", "reduce_scatter") in ops  # ZeRO-1: the weight gradients reduced over the replicas


def test_simulate_cli_reports_a_later_pipeline_stage(capsys):
    code = main(["simulate", "--model", "tiny-llama", "--grid", "dp=4,pp=2,x=2,y=2", "--rank", "31", "--seq", "64",
                 "--global-batch", "8", "--steps", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world"] == 32 and out["coords"]["pp"] == 1 and out["coords"]["dp"] == 3
    assert out["layers"] == 2 and len(out["step_seconds"]) == 1
    assert set(out["startup_seconds"]) == {"process group", "grid and groups", "model", "optimizer"}


@pytest.mark.parametrize("rank", [0, 4])  # the first stage's rank and the last's
def test_simulated_pipeline_sends_are_the_volumes(rank):
    """A tied model over two stages: each stage's activations and gradients, and the tied table's
    copy and its gradient, sent as `spec.volumes.pipeline_sends` counts them."""
    cfg = dataclasses.replace(load_config("tiny-llama"), tied=True)
    job = Job(Layout(dp=2, pp=2, x=2), global_batch=8, micro_batch=2, seq=64, seq_parallel=True, precision="bf16")
    sim = simulate(cfg, job, rank=rank, steps=1)
    stage = Layout(dp=2, pp=2, x=2).coords(rank)["pp"]
    expected = pipeline_sends(cfg, job.layout.sizes, job.micro_batch, job.seq, job.microbatches, [stage], 2,
                              seq_parallel=True)
    sent = {c["op"]: c["bytes"] for c in sim.collectives_per_step if c["group"] == "pp"}
    assert sent == {"send": int(ledger_bytes(expected, job.layout.sizes, 2)[("pp", "send")])}


def test_every_simulated_step_receives_the_tied_tables_gradient(monkeypatch):
    """The first stage adds the last stage's copy's gradient to its table in every step, as a
    pipeline step arms it (once only in the first step before: later steps' peaks missed it)."""
    from fourfold.parallel import comm

    received = []
    recv = comm.recv
    monkeypatch.setattr(comm, "recv", lambda tensor, peer, group: received.append(tensor.numel()) or
                        recv(tensor, peer, group))
    cfg = dataclasses.replace(load_config("tiny-llama"), tied=True)
    job = Job(Layout(dp=2, pp=2, x=2), global_batch=8, micro_batch=2, seq=64, seq_parallel=True, precision="bf16")
    simulate(cfg, job, rank=0, steps=2)  # two counted steps, two timed
    assert received == [cfg.vocab // 2 * cfg.hidden] * 4  # the table's x-shard, once a step


def test_simulate_names_a_rank_outside_the_job(capsys):
    code = main(["simulate", "--model", "tiny-llama", "--grid", "dp=2", "--rank", "2", "--seq", "64"])
    assert code == 2
    assert "--rank 2 is outside a job of 2 ranks" in capsys.readouterr().err


def test_simulate_refuses_a_job_the_rules_reject(capsys):
    code = main(["simulate", "--model", "tiny-llama", "--grid", "y=3,dp=1", "--seq", "64"])
    assert code == 2
    assert "y=3" in capsys.readouterr().err


def test_simulated_expert_parallel_rank_exchanges_what_the_planner_prices():
    """A Mixtral rank with expert parallelism (2 of its layers, dp8 y2 ep4): the expert group's
    exchange bytes in the ledger are the planner's (fake tensors route at its balanced routing), the
    step peak is within 5% of the estimate's terms the fake tensors see, and the checkpoint save
    offers what the estimate stages (the dp*cp ranks share the dense weights' writing, the expert
    replicas the experts')."""
    import dataclasses

    from fourfold.plan.frameworks.fourfold import expert_exchange_bytes
    from fourfold.tools.measure import GPU_ONLY_TERMS

    cfg = dataclasses.replace(load_config("mixtral-8x7b"), layers=2)
    job = Job(Layout(dp=8, y=2, ep=4), global_batch=16, micro_batch=1, seq=4096, seq_parallel=True, precision="bf16")
    sim = simulate(cfg, job, rank=0, steps=1)
    ledger = {c["op"]: c["bytes"] for c in sim.collectives_per_step if c["group"] == "ep"}
    priced = expert_exchange_bytes(cfg, job)
    assert ledger["all_to_all_v"] == priced["all_to_all_v"] > 0  # two micro-batches, 4 exchanges a layer
    assert ledger["all_to_all"] == int(priced["all_to_all"])  # the routing counts (int64)
    estimate = fourfold_memory(cfg, job, 80.0)
    step_peak = max(v for k, v in sim.device_peak_bytes.items() if k.startswith("step"))
    assert sum(v for k, v in estimate.terms.items() if k not in GPU_ONLY_TERMS) == pytest.approx(step_peak, rel=0.05)
    # replicas write whole parameters: a rank stages its share give or take one (the embedding's y part)
    table = cfg.vocab // job.y * cfg.hidden * 2
    assert abs(sim.save["bytes_written"] - estimate.checkpoint_host_bytes) <= table
    assert {c["group"] for c in sim.collectives_per_step} >= {"ep", "edp"}  # experts' gradients over their replicas


@pytest.mark.parametrize("pp, virtual, microbatches", [(2, 2, 4), (2, 3, 8), (3, 2, 3), (4, 4, 8), (4, 2, 16)])
def test_a_simulated_rank_runs_its_stages_in_the_interleaved_schedules_order(pp, virtual, microbatches):
    """simulate runs each rank's forwards and backwards in the order torch's ScheduleInterleaved1F1B (the
    runtime's schedule) gives that rank, so the saved tensors alive at once are the schedule's. (The
    schedule's own per-rank method, called with the attributes its constructor sets: torch is pinned,
    and a change to its private API fails here loudly.)"""
    for rank in range(pp):
        me = types.SimpleNamespace(n_local_stages=virtual, pp_group_size=pp, _n_microbatches=microbatches,
                                   microbatches_per_round=microbatches // max(1, microbatches // pp))
        torch_order = [(a.computation_type == _ComputationType.FULL_BACKWARD, a.microbatch_index, a.stage_index // pp)
                       for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(me, rank) if a is not None]
        assert schedule_order(rank, pp, virtual, microbatches, "interleaved-1f1b") == torch_order
    # 1F1B: pp - 1 - rank forwards before the first backward; GPipe: every forward first
    assert schedule_order(0, 4, 1, 6, "1f1b")[:5] == [(False, 0, 0), (False, 1, 0), (False, 2, 0), (False, 3, 0),
                                                      (True, 0, 0)]
    assert [b for b, _, _ in schedule_order(0, 2, 1, 3, "gpipe")] == [False] * 3 + [True] * 3


def test_cli_memory_measured_under_fake_tensors(capsys):
    """`fourfold memory --measure`: the runtime's peak (FakeTensorMode) beside the estimate, as a
    table and as JSON; a pipeline is refused with the fix. In-process (it builds its own fake world)."""
    from fourfold.cli.main import main

    args = ["memory", "--model", "tiny-llama", "--y", "2", "--z", "2", "--micro-batch", "2", "--seq", "512",
            "--measure"]
    assert main([*args, "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["estimate_without_gpu_only_gib"] == pytest.approx(measured["measured_gib"], rel=0.05)
    assert measured["measured_at_peak"]
    assert max(measured["measured_phase_peaks_gib"].values()) == measured["measured_gib"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "measured (FakeTensorMode, rank 0, two steps)" in table and "largest tensors alive at the peak" in table
    assert main([*args, "--pp", "2"]) == 2
    assert "use pp 1" in capsys.readouterr().err


def test_a_deepseek_v3_sized_job_on_2048_ranks_with_expert_parallelism():
    """DeepSeek-V3 (8 of its layers: 3 dense, 5 of 256 experts) on dp64 pp4 y8 ep64, one rank of a
    stage of two mixture layers simulated: the expert group's exchange bytes in the ledger are the
    planner's, the latent attention's gradients summed over its head group (y) are there, and the
    step peak is within 5% of the estimate's terms the fake tensors see."""
    from fourfold.plan.frameworks.fourfold import expert_exchange_bytes
    from fourfold.tools.measure import GPU_ONLY_TERMS

    cfg = load_config("deepseek-v3").with_layers(8)
    job = Job(Layout(dp=64, pp=4, y=8, ep=64), global_batch=256, micro_batch=1, seq=4096, seq_parallel=True,
              precision="bf16")
    assert job.world_size == 2048
    sim = simulate(cfg, job, rank=1024, steps=1)  # (pp stage 2: layers 4 and 5, both mixtures)
    ledger = {(c["group"], c["op"]): c["bytes"] for c in sim.collectives_per_step}
    assert ledger[("ep", "all_to_all_v")] == expert_exchange_bytes(cfg, job)["all_to_all_v"] > 0
    assert ledger[("x_y", "all_reduce")] > 0  # (y8 holds the heads: the non-redundant path's head group)
    step_peak = max(v for k, v in sim.device_peak_bytes.items() if k.startswith("step"))
    estimate = fourfold_memory(cfg.with_layers(8), job, 80.0)
    assert sum(v for k, v in estimate.terms.items() if k not in GPU_ONLY_TERMS) == pytest.approx(step_peak, rel=0.05)
