"""The planner: the seed paper's formulas, search invariants, CLI output; no processes needed."""

import dataclasses
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fourfold.models.config import load_config
from fourfold.plan.constants import Calibration
from fourfold.plan.frameworks import FOURFOLD, MEGATRON, Megatron, named
from fourfold.plan.frameworks.fourfold import ORDERS, Fourfold
from fourfold.plan.memory import GIB, fourfold_memory, megatron_memory
from fourfold.plan.perf import compute_bound, placement_bound, step_time
from fourfold.plan.search import beats, check, kind, rank, rounded_seconds, search
from fourfold.spec.hardware import make_cluster
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.schedule import held_layers

pytestmark = pytest.mark.torch_free

LLAMA7 = load_config("llama-2-7b")


def job(*, dp=1, pp=1, cp=1, x=1, y=1, z=1, micro_batch=1, seq=4096, global_batch=1024, recompute="none") -> Job:
    """A planner job (bf16, sequence parallelism) on the grid given."""
    return Job(Layout(dp=dp, pp=pp, cp=cp, x=x, y=y, z=z), micro_batch=micro_batch, seq=seq,
               global_batch=global_batch, recompute=recompute, seq_parallel=True, precision="bf16")


def test_megatron_formulas_by_hand_llama2_7b():
    # t=2, p=1, c=1, d=4, b=1, s=4096; h=4096, F=11008, a=k=32, v=32000, L=32, untied
    h, F, v, L, t, d, s = 4096, 11008, 32000, 32, 2, 4, 4096
    layer = 2 * h * h * (1 + 1) + 3 * h * F  # matrices; plus 2h of norms not divided by t
    params = L * (layer / t + 2 * h) + h * v / t + h * v / t + h
    assert params == 3369340928
    mem = megatron_memory(LLAMA7, job(dp=d, y=t, seq=s, micro_batch=1), 80)
    assert mem.terms["weights_and_grads"] == 6 * params
    assert mem.terms["optimizer"] == 12 * params / d
    assert mem.terms["activations"] == L * s * h * (12 + 4 + 8 * F / h) / t == 10066329600
    assert mem.terms["first_stage_inputs"] == 8 * s * h / t
    assert mem.terms["logits"] == 4 * s * h * (1 + v / h) / t
    assert mem.total == 40753205248
    assert mem.limit_bytes == 0.8 * 80 * GIB and mem.fits  # 37.95 GiB < 64 GiB


def test_megatron_pipeline_terms_by_hand_llama3_70b():
    cfg = load_config("llama-3.1-70b")  # GQA: k/a = 8/64
    h, F, v, L, t, p, c, d, b, s = 8192, 28672, 128256, 80, 8, 4, 2, 4, 2, 8192
    mem = megatron_memory(cfg, job(dp=d, pp=p, cp=c, y=t, micro_batch=b, seq=s), 80)
    params = L / p * ((2 * h * h * (1 + 8 / 64) + 3 * h * F) / t + 2 * h) + h * v / t  # no head: not on stage 1
    assert mem.terms["weights_and_grads"] == pytest.approx(6 * params, rel=1e-15)
    assert mem.terms["optimizer"] == pytest.approx(12 * params / (d * c), rel=1e-15)
    assert mem.terms["activations"] == pytest.approx(L * (s / c) * b * h * (12 + 4 * 8 / 64 + 8 * F / h) / t, rel=1e-15)
    assert mem.terms["first_stage_inputs"] == 8 * (s / c) * b * h * p / t
    assert "logits" not in mem.terms
    assert not megatron_memory(cfg, job(y=1, seq=s), 80).fits
    assert megatron_memory(cfg, job(dp=d, pp=p, cp=c, y=t, micro_batch=b, seq=s), 80,
                           rule80=False).limit_bytes == 80 * GIB
    # interleaved over v chunks a stage: p + (p - 1) / v micro-batches of its layers (m > p), p when m = p
    v = 2
    interleaved = replace(job(dp=d, pp=p, cp=c, y=t, micro_batch=b, seq=s), virtual=v, schedule="interleaved-1f1b")
    activations = L * (s / c) * b * h * (12 + 4 * 8 / 64 + 8 * F / h) / t / p  # a stage's layers, one micro-batch
    assert megatron_memory(cfg, interleaved, 80).terms["activations"] == pytest.approx((p + (p - 1) / v) * activations)
    alone = replace(interleaved, global_batch=d * b * p)  # m = p micro-batches: every forward first
    assert megatron_memory(cfg, alone, 80).terms["activations"] == pytest.approx(p * activations)


CLUSTER = make_cluster("dgx-h100")
SMALL = load_config("llama-2-7b")


@given(gpus=st.sampled_from([8, 16, 32, 64]), framework=st.sampled_from([FOURFOLD, MEGATRON]))
@settings(max_examples=8, deadline=None)
def test_every_candidate_multiplies_out_and_divides(gpus, framework):
    found = search(SMALL, gpus, CLUSTER, job(seq=2048, global_batch=64), include_unfit=True, framework=framework)
    assert found
    for r in found:
        assert r["dp"] * r["pp"] * r["cp"] * r["x"] * r["y"] * r["z"] == gpus
        assert r["job"].layout.sizes == {d: r[d] for d in ("dp", "pp", "cp", "x", "y", "z")}
        assert SMALL.heads % r["y"] == 0 and SMALL.layers % r["pp"] == 0 and r["micro_batch"] % r["z"] == 0
        assert 64 % (r["dp"] * r["micro_batch"]) == 0
        if framework is MEGATRON:
            assert r["x"] == r["z"] == 1 and SMALL.layers % (r["pp"] * r["virtual"]) == 0  # even stages
        assert (r["virtual"] > 1) == (r["job"].schedule == "interleaved-1f1b") and (r["pp"] > 1 or r["virtual"] == 1)
    if gpus >= 16:  # pipelines exist: the search tries them interleaved too
        assert any(r["virtual"] > 1 for r in found)
    # best first: those that fit; those with headroom in tiers: the fastest left and every other left
    # within the model's error of it (the band of the wider of the two kinds: cp, pp, tp, dp), each
    # simplest first; the fastest's tier marked as ties; then the tight ones, by step time to four digits
    fitting = [r for r in found if r["fits"]]
    assert found[: len(fitting)] == fitting
    band = Calibration().error_band

    def simplest(r: dict) -> tuple:
        return r["pp"] * r["cp"] * r["x"] * r["y"] * r["z"], r["ep"], r["virtual"], -r["micro_batch"]

    left, tiers = [r for r in fitting if not r["tight"]], []
    while left:
        leader = min(left, key=lambda r: r["step_seconds"])
        tier = [r for r in left if r["step_seconds"] <= leader["step_seconds"] * (
            1 + max(band(kind(r)), band(kind(leader))))]
        tiers.append(sorted(tier, key=simplest))  # a tier's members listed together, simplest first,
        left = [r for r in left if all(r is not t for t in tier)]
    # except that a row another beats on both time and memory is never above it: it takes the place
    shown = {id(r): (rounded_seconds(r["step_seconds"]), round(r["memory_gib"], 1)) for r in fitting}
    expected, left = [], [r for tier in tiers for r in tier]
    while left:
        pick = left[0]
        while (better := next((r for r in left if _beats(shown[id(r)], shown[id(pick)])), None)) is not None:
            pick = better
        expected.append(pick)
        left.remove(pick)
    tiered, listed = fitting[: len(expected)], fitting[len(expected):]
    assert [id(r) for r in tiered] == [id(r) for r in expected]
    tier_of = {id(r): i for i, tier in enumerate(tiers) for r in tier}
    assert [r["tier"] for r in tiered] == [min(tier_of[id(r)] for r in tiered[i:]) for i in range(len(tiered))]
    ties = [r for r in fitting if r["tie"]]  # the first tier's rows, where it has several
    assert fitting[: len(ties)] == ties and all(r["tier"] == 0 for r in ties)
    assert len(ties) == (sum(r["tier"] == 0 for r in tiered) if len(ties) else 0)
    rest = [rounded_seconds(r["step_seconds"]) for r in listed]
    assert all(r["tight"] for r in listed) and rest == sorted(rest)


def test_without_a_known_error_the_plan_lists_by_time_alone():
    """No cross-validated error (constants without one): no tiers, no ties; times equal to four digits
    are equally fast, less context parallelism first."""
    def row(seconds: float, cp: int, pp: int = 1) -> dict:
        return dict(fits=True, tight=False, step_seconds=seconds, memory_gib=1.0, micro_batch=1, dp=8 // cp // pp,
                    pp=pp, cp=cp, x=1, y=1, z=1)

    rows = [row(1.0, 2), row(1.00001, 1), row(0.9, 4), row(1.2, 1, pp=2)]
    ranked = rank(rows, Calibration(cv_error=None, cv_errors=()))
    assert [(r["step_seconds"], r["cp"]) for r in ranked] == [(0.9, 4), (1.00001, 1), (1.0, 2), (1.2, 1)]
    assert not any(r["tie"] for r in ranked) and [r["tier"] for r in ranked] == [0, 1, 2, 3]


def _beats(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[0] and a[1] < b[1]


def test_no_row_is_listed_above_one_that_beats_it_on_time_and_memory():
    """The trial's DeepSeek-V3 on 256 GPUs listed mb2 (70.8 GiB, 22.70 s) above mb1 (64.1 GiB, 21.61 s):
    one tier, the larger micro-batch simpler. The faster, smaller row comes first and keeps its tier; a
    row it passes that was in a later tier joins the tier it is listed in."""
    def row(seconds: float, gib: float, mb: int, pp: int = 32) -> dict:
        return dict(fits=True, tight=False, step_seconds=seconds, memory_gib=gib, micro_batch=mb, dp=256 // pp,
                    pp=pp, cp=1, x=1, y=1, z=1, ep=8)

    cal = Calibration(cv_error=0.087, cv_errors=(("pp", 0.095),))
    ranked = rank([row(22.703, 70.8, 2), row(21.606, 64.1, 1), row(22.647, 64.9, 4)], cal)
    assert [(r["micro_batch"], r["tier"]) for r in ranked] == [(1, 0), (4, 0), (2, 0)]
    # across tiers: the fastest (data parallel: a 1.3% band) leads a tier the pipelined row at 10.9 s joins
    # (its 9.5% band), and a data-parallel row at 10.5 s does not; it beats the pipelined row, so it is
    # listed above it, in its tier
    dp_only = dict(pp=1, dp=256)
    cal = Calibration(cv_error=0.087, cv_errors=(("dp", 0.013), ("pp", 0.095)))
    rows = [dict(row(10.0, 60.0, 1), **dp_only), dict(row(10.9, 70.0, 1), pp=2, dp=128),
            dict(row(10.5, 65.0, 1), **dp_only)]
    ranked = rank(rows, cal)
    assert [(r["step_seconds"], r["tier"]) for r in ranked] == [(10.0, 0), (10.5, 0), (10.9, 0)]
    found = [r for r in search(SMALL, 64, CLUSTER, job(seq=4096, global_batch=128)) if r["tier"] is not None]
    shown = [(rounded_seconds(r["step_seconds"]), round(r["memory_gib"], 1)) for r in found]
    assert not [(i, j) for i in range(len(found)) for j in range(i + 1, len(found)) if _beats(shown[j], shown[i])]
    assert beats(found[0], found[-1]) == _beats(shown[0], shown[-1])
    tiers = [r["tier"] for r in found]
    assert tiers == sorted(tiers)


def test_the_plan_says_why_its_first_row_leads(capsys):
    from fourfold.cli.main import main

    assert main(["plan", "--model", "llama-3.1-70b", "--gpus", "64", "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    reason = next(line for line in out.splitlines() if line.startswith("first row: "))
    # (its first row, pp2 y4 z8, is 4.9% slower than the fastest and beats a simpler row on both counts)
    assert reason.startswith("first row: 4.9% slower than the fastest (row 5, 111.561 s), within the model's "
                             "+-9.5%; above row 3, which is simpler (less model parallelism: tp*cp*pp 16 against "
                             "64), as it beats it on both time and memory"), reason
    assert len(reason) < 250, reason


@given(gpus=st.sampled_from([16, 64, 128]), framework=st.sampled_from([FOURFOLD, MEGATRON]),
       top=st.sampled_from([1, 3, 10]))
@settings(max_examples=6, deadline=None)
@example(gpus=16, framework=FOURFOLD, top=10)  # (where a cutoff at the fastest's band stopped too soon)
def test_a_search_for_the_top_few_ranks_them_as_the_whole_search_does(gpus, framework, top):
    base = job(seq=4096, global_batch=128)
    whole = search(SMALL, gpus, CLUSTER, base, framework=framework)
    few = search(SMALL, gpus, CLUSTER, base, framework=framework, top=top)
    assert few.considered == whole.considered and len(few) <= len(whole)
    shown = max(top, sum(r["tie"] for r in whole))
    assert [(r["job"], r["step_seconds"], r["tie"], r["tier"]) for r in few[:shown]] == \
        [(r["job"], r["step_seconds"], r["tie"], r["tier"]) for r in whole[:shown]]


SETUPS = st.builds(
    job, dp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
    x=st.sampled_from([1, 2, 4]), y=st.sampled_from([1, 2, 4]), z=st.sampled_from([1, 2]),
    micro_batch=st.sampled_from([2, 4]), seq=st.just(4096), global_batch=st.just(256),
    recompute=st.sampled_from(["none", "selective", "full"]))


@given(s=SETUPS, framework=st.sampled_from([FOURFOLD, MEGATRON, Megatron("all_gather"), Megatron("a2a")]),
       per_node=st.sampled_from([2, 4, 8]))
@settings(max_examples=150, deadline=None)
def test_the_search_bounds_are_below_every_placements_step_time(s, framework, per_node):
    # The search stops on these bounds, so a bound above a step time would drop a better job.
    if isinstance(framework, Megatron):
        s = s.with_layout(x=1, z=1)
    cluster = replace(CLUSTER, gpus_per_node=per_node)
    variants = [s, replace(s, keep_gathered_inputs=True)] if framework is FOURFOLD else [s]
    loose = compute_bound(SMALL, s, cluster, framework=framework)
    tight = placement_bound(SMALL, variants[-1], cluster, framework=framework)  # as the search asks it
    times = [step_time(SMALL, v.with_layout(order=o), cluster, framework=framework).total
             for v in variants for o in ORDERS]
    assert loose <= tight * (1 + 1e-12) and tight <= min(times) * (1 + 1e-12)


@given(s=SETUPS)
@settings(max_examples=200, deadline=None)
def test_memory_is_monotone_in_micro_batch(s):
    bigger = replace(s, micro_batch=2 * s.micro_batch)
    for profile in (fourfold_memory, lambda c, st_, m: megatron_memory(c, st_.with_layout(x=1, z=1), m)):
        assert profile(SMALL, bigger, 80).total >= profile(SMALL, s, 80).total


@given(s=SETUPS, dim=st.sampled_from(["x", "y", "z", "pp", "dp", "cp"]))
@settings(max_examples=300, deadline=None)
def test_doubling_a_parallel_dim_never_raises_sharded_terms(s, dim):
    doubled = s.with_layout(**{dim: 2 * getattr(s, dim)})
    before, after = fourfold_memory(SMALL, s, 80).terms, fourfold_memory(SMALL, doubled, 80).terms
    if dim in ("x", "y", "z", "pp"):
        for term in ("weights", "gradients", "optimizer"):
            assert after[term] <= before[term] * (1 + 1e-12), term
    assert after["optimizer"] <= before["optimizer"] * (1 + 1e-12)
    if dim in ("x", "y", "z", "cp"):
        assert after["activations"] <= before["activations"] * (1 + 1e-12)


class _OneDimensionalTensors(Fourfold):
    """A third profile, as a user adds one (docs/planner.md): fourfold's costs and memory, but a
    framework whose tensor parallelism is over y alone (Megatron-style), so no x or z."""

    name = "fourfold-1d"

    def runs_grid(self, cfg, pp, x, z):
        return x == z == 1 and super().runs_grid(cfg, pp, x, z)


def test_a_third_profile_is_one_subclass_and_the_search_follows_its_rules():
    third, base = _OneDimensionalTensors(), job(seq=2048, global_batch=64)
    mine = search(SMALL, 16, CLUSTER, base, framework=third)
    everything = search(SMALL, 16, CLUSTER, base)
    assert mine and all(r["x"] == r["z"] == 1 for r in mine)
    assert any(r["x"] > 1 or r["z"] > 1 for r in everything)
    # the same grids are priced as fourfold prices them
    fourfold = {r["job"]: r["step_seconds"] for r in everything}
    assert [r["step_seconds"] for r in mine] == [fourfold[r["job"]] for r in mine]


def test_a_large_first_chunk_is_held_as_often_as_the_schedule_holds_it():
    """A user's split with one large stage on the first rank: interleaved over 2 stages a rank, the
    first rank's steady state runs its first stage's forwards while its second stage's backwards
    free a layer each, so at its peak it holds the first stage for all 4 micro-batches (4 x 7 + 1 =
    29 layers), more than its 8 layers times its average in-flight micro-batches (2.5: 20)."""
    assert held_layers(10, 2, 2, 4, "interleaved-1f1b", (7, 1, 1, 1)) == 29
    s = replace(job(pp=2, micro_batch=1, global_batch=4), virtual=2, schedule="interleaved-1f1b",
                stage_layers=(7, 1, 1, 1))
    small = dataclasses.replace(SMALL, layers=10)
    one_layer = fourfold_memory(small, replace(s, layout=Layout(), virtual=1, schedule="1f1b", stage_layers=()), 80)
    per_layer = one_layer.terms["activations"] / 10  # no pipeline: one micro-batch of every layer
    assert fourfold_memory(small, s, 80).terms["activations"] == pytest.approx(29 * per_layer)


def test_invalid_configurations_name_the_fix():
    with pytest.raises(ValueError, match="32 layers cannot fill 40 pipeline stages; use pp\\*virtual of at most 32"):
        check(SMALL, job(pp=40))
    with pytest.raises(ValueError, match="micro_batch=1 must be divisible by z=2"):
        check(SMALL, job(z=2, micro_batch=1))
    with pytest.raises(ValueError,
                       match="batch.seq=4097 does not divide; use a sequence length that is a multiple of 4"):
        check(SMALL, job(cp=2, seq=4097))
    with pytest.raises(ValueError, match="the megatron profile has 1D tensor parallelism"):
        check(SMALL, job(x=2), MEGATRON)
    # Megatron-LM builds layers // pp on every stage (layers // (pp * virtual) per chunk); fourfold splits unevenly
    check(SMALL, job(pp=3))
    for uneven in (job(pp=3), replace(job(pp=4), virtual=3, schedule="interleaved-1f1b")):
        with pytest.raises(ValueError, match=f"pp \\* virtual = {uneven.pp * uneven.virtual} does not divide the "
                                             "model's 32 layers; choose --pp"):
            check(SMALL, uneven, MEGATRON)
    megatron = search(SMALL, 24, CLUSTER, job(seq=2048, global_batch=24), framework=MEGATRON, include_unfit=True)
    assert megatron and all(r["pp"] in (1, 2, 4, 8) for r in megatron)


def test_a_search_tries_the_interleavings_it_is_given():
    base = job(seq=2048, global_batch=64)
    plain = search(SMALL, 16, CLUSTER, base, include_unfit=True, virtuals=(1,))
    assert plain and all(r["virtual"] == 1 for r in plain) and any(r["pp"] > 1 for r in plain)
    four = search(SMALL, 16, CLUSTER, base, include_unfit=True, virtuals=(4,))
    assert four and all(r["virtual"] == (4 if r["pp"] > 1 else 1) for r in four) and any(r["pp"] > 1 for r in four)


def test_a_search_keeps_the_users_own_pipeline_split():
    """With stage_layers (grid.auto on a config that splits the layers) the search tries only the pp
    whose stages that split fills, with the config's own schedule (no pp of 1 that the split cannot
    fill, no interleaving it was not written for)."""
    split = replace(job(seq=2048, global_batch=64), stage_layers=(3, 5, 4, 4, 4, 4, 5, 3))
    found = search(SMALL, 16, CLUSTER, split, include_unfit=True)
    assert found and all((r["pp"], r["virtual"]) == (8, 1) for r in found)
    interleaved = replace(split, virtual=2, schedule="interleaved-1f1b")
    found = search(SMALL, 16, CLUSTER, interleaved, include_unfit=True)
    assert found and all((r["pp"], r["virtual"], r["job"].schedule) == (4, 2, "interleaved-1f1b") for r in found)


def test_planner_does_not_import_torch():
    code = "import sys, fourfold.cli.plan, fourfold.plan.search; print(any(m.startswith('torch') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_volume_functions_are_the_runtimes():
    import fourfold.plan.costs as costs
    import fourfold.plan.frameworks.fourfold as fourfold_profile
    import fourfold.spec.volumes as volumes

    assert fourfold_profile.block_passes is volumes.block_passes and costs.bytes_sent is volumes.bytes_sent


def _cli(*args):
    out = subprocess.run([sys.executable, "-m", "fourfold.cli.main", *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


KEYS = {"dp", "pp", "cp", "x", "y", "z", "virtual", "seq_parallel", "micro_batch", "recompute", "memory_gib",
        "memory_limit_gib", "fits", "step_seconds", "tokens_per_second", "model_tflops_per_gpu", "mfu",
        "memory_breakdown_gib", "time_breakdown_seconds"}


def test_cli_json_objects(tmp_path):
    one = json.loads(_cli("estimate", "--model", "llama-3.1-8b", "--tp", "4", "--dp", "2", "--json"))
    assert KEYS <= one.keys() and (one["x"], one["y"], one["z"]) == (1, 4, 1)
    slower = json.loads(_cli("estimate", "--model", "llama-3.1-8b", "--tp", "4", "--dp", "2", "--json",
                             "--latency-us", "1000"))
    assert slower["step_seconds"] > one["step_seconds"] and slower["memory_gib"] == one["memory_gib"]
    memory = json.loads(_cli("memory", "--model", "llama-3.1-8b", "--x", "2", "--y", "2", "--z", "2", "--json",
                             "--micro-batch", "2", "--gpu", "a100-80gb"))
    assert memory["memory_limit_gib"] == 80 and "step_seconds" not in memory
    plan = json.loads(_cli("plan", "--model", "llama-3.1-8b", "--gpus", "16", "--global-batch", "64", "--json",
                           "--plot", str(tmp_path / "plan.png")))
    candidates = plan["candidates"]
    assert candidates and all(KEYS <= c.keys() for c in candidates) and all(c["fits"] for c in candidates)
    ties = sum(c["tie"] for c in candidates)  # the ties lead (the ranking: test_every_candidate_...)
    assert all(c["tie"] and c["tier"] == 0 for c in candidates[:ties])
    roomy = [c for c in candidates if not c["tight"]]  # then the tiers in turn, each simplest first
    assert candidates[: len(roomy)] == roomy and [c["tier"] for c in roomy] == sorted(c["tier"] for c in roomy)
    times = [rounded_seconds(c["step_seconds"]) for c in candidates[len(roomy):]]
    assert times == sorted(times) and all(c["tier"] is None for c in candidates[len(roomy):])
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_a_candidate_without_headroom_is_marked_and_ranked_after_the_others(capsys):
    """Some of the fast jobs here fit with under 5% of the card free. They keep `fits`, are marked in
    the table with a footnote, and come after every candidate that leaves room."""
    from fourfold.cli.main import main

    found = search(SMALL, 4, CLUSTER, job(global_batch=16))
    flags = [r["tight"] for r in found if r["fits"]]
    assert any(flags) and flags == sorted(flags)  # every tight candidate after every roomy one
    ranked = min((r for r in found if r["tight"]), key=lambda r: r["step_seconds"])  # the fastest tight one
    assert ranked["fits"] and ranked["memory_gib"] > 0.95 * 80
    assert any(not r["tight"] and r["step_seconds"] > ranked["step_seconds"] for r in found)  # slower, ranked before
    grid = [arg for d in ("dp", "pp", "cp", "x", "y", "z") for arg in (f"--{d}", str(ranked[d]))]
    args = ["estimate", "--model", "llama-2-7b", *grid, "--micro-batch", str(ranked["micro_batch"]),
            "--recompute", ranked["recompute"], "--global-batch", "16"]
    if ranked["keep_gathered_inputs"]:
        args.append("--keep-gathered-inputs")
    assert main(args) == 0
    table = capsys.readouterr().out
    assert " yes* " in table and "* fits with less than 5% of the GPU's memory free" in table
    assert main(["plan", "--model", "llama-2-7b", "--gpus", "4", "--global-batch", "16", "--top", "0"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dp")]
    assert rows and not any(" yes* " in r for r in rows)  # the top ten leave room (the legend names yes*)


def test_cli_error_is_clear():
    out = subprocess.run([sys.executable, "-m", "fourfold.cli.main", "estimate", "--model", "llama-2-7b", "--pp", "40"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "32 layers cannot fill 40 pipeline stages; use pp*virtual of at most 32" in out.stderr


def test_plan_says_what_the_rules_refuse_when_they_refuse_every_grid(capsys):
    from fourfold.cli.main import main

    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq", "1000000"]) == 2
    out = capsys.readouterr()
    assert "nothing fits" not in out.out
    assert "the rules refuse every configuration of 8 GPUs; with dp=8:\n  --seq 1000000 is longer than the model's " \
           "131072 positions; use a sequence of at most 131072 tokens" in out.err
    for gpus in ("0", "-2"):
        with pytest.raises(SystemExit):
            main(["plan", "--model", "llama-3.1-8b", "--gpus", gpus])
        assert f"argument --gpus: {gpus} is not a positive count; give 1 or more" in capsys.readouterr().err


def test_tp_with_a_3d_grid_is_refused(capsys):
    from fourfold.cli.main import main

    assert main(["estimate", "--model", "llama-3.1-8b", "--tp", "8", "--x", "2"]) == 2
    assert "--tp 8 is Megatron's 1D tensor parallelism (y=8, x = z = 1) and cannot go with --x 2: give either --tp " \
           "or --x/--y/--z" in capsys.readouterr().err


def test_rule_errors_name_the_planners_flags(capsys):
    from fourfold.cli.main import main

    assert main(["estimate", "--model", "llama-3.1-8b", "--global-batch", "16", "--dp", "32", "--seq", "0"]) == 2
    err = capsys.readouterr().err
    assert "--seq is 0; set --seq >= 1" in err and "batch." not in err
    assert main(["estimate", "--model", "llama-3.1-8b", "--global-batch", "16", "--dp", "32", "--y", "8",
                 "--seq", "100"]) == 2
    err = capsys.readouterr().err
    assert "--global-batch 16 must be a multiple of dp*micro_batch = 32*1" in err
    assert "or give --no-seq-parallel" in err and "batch." not in err


def test_megatron_takes_the_split_that_counts_embedding_and_loss_as_layers(capsys):
    """Llama 3 405B's 126 layers over 16 stages: Megatron-Core to 0.9 cannot split them; Megatron-
    Bridge's recipes count the embedding and the loss as a layer each (7, 8 x 14, 7). The profile
    names that split, takes it given, and hands it on to estimate and train."""
    from fourfold.cli.main import main

    split = ",".join(["7"] + ["8"] * 14 + ["7"])
    grid = ["estimate", "--model", "llama-3.1-405b", "--framework", "megatron", "--dp", "8", "--pp", "16", "--tp", "8",
            "--seq", "8192", "--global-batch", "128", "--recompute", "full", "--json"]
    assert main(grid) == 2
    assert f"the embedding and the loss as a layer each: [{split.replace(',', ', ')}]" in capsys.readouterr().err
    assert main([*grid, "--stage-layers", split]) == 0
    commands = json.loads(capsys.readouterr().out)["commands"]
    assert f"--stage-layers {split}" in commands["estimate"] and f"--pipeline.stage_layers {split}" in commands["train"]
    assert main([*grid, "--stage-layers", "8," * 15 + "6"]) == 2  # not Megatron's split


def test_a_sliding_window_prices_only_the_pairs_it_keeps():
    """A 64k-token job of an 8B model with a 4096-token window: its attention's FLOPs and seconds are
    the causal ones scaled by the pairs the window keeps (about 2 * 4096 / 65536 of them), the
    linear layers' unchanged, and the step's compute less than half the global-attention model's."""
    from fourfold.plan.constants import constants
    from fourfold.plan.costs import attention_seconds
    from fourfold.spec.counts import attended_pairs, flops_per_token

    full = load_config("llama-3.1-8b")
    windowed = replace(full, sliding_window=4096)
    seq = 65536
    ratio = attended_pairs(seq, 4096) / attended_pairs(seq, 0)
    assert 0.12 < ratio < 0.125
    attention = 6 * full.layers * full.hidden * seq  # 6 L h s a token
    assert flops_per_token(windowed, seq) == pytest.approx(flops_per_token(full, seq) - attention * (1 - ratio),
                                                           rel=1e-4)
    args = (seq, 8, 1, 4, 128, 989.0, constants(Calibration(), CLUSTER))
    assert windowed.attention_share(seq) == ratio and windowed.attention_share(4096) == 1.0
    assert attention_seconds(*args, share=ratio) == pytest.approx(attention_seconds(*args) * ratio)
    job = Job(Layout(cp=8, x=1, y=8), global_batch=1, micro_batch=1, seq=seq)
    full_step, windowed_step = (step_time(cfg, job, CLUSTER) for cfg in (full, windowed))
    assert windowed_step.compute < 0.5 * full_step.compute
    assert windowed_step.flops_per_gpu < 0.6 * full_step.flops_per_gpu  # (6N is about half of the full one)


def test_megatrons_a2a_context_exchange_by_hand():
    """cp_comm a2a (Ulysses): Q, K, V and the output all-to-all over cp in forward, dO, dQ, dK, dV in
    backward, each rank sending (cp-1)/cp of each; Llama 3.1 8B, y2 cp4 in one H100 node, 32k tokens."""
    from fourfold.plan.constants import constants
    from fourfold.plan.perf import _a2a_seconds

    cfg, cluster = load_config("llama-3.1-8b"), make_cluster("dgx-h100")
    s = job(dp=1, cp=4, y=2, seq=32768, micro_batch=1, global_batch=8)
    k = constants(Calibration(), cluster)
    rows = 32768 // 4 * 128  # one head's rows of a rank
    elements = 2 * (16 * rows + 4 * rows)  # Q and the output on 16 heads, K and V on 4, a pass
    seconds = 2 * elements * 2 * 3 / 4 / (450e9 * k.intra_node_efficiency) + 8 * 3 * k.latency_us * 1e-6
    assert abs(_a2a_seconds(cfg, s, cluster, k, Megatron("a2a")) / seconds - 1) < 1e-12
    recomputed = _a2a_seconds(cfg, replace(s, recompute="full"), cluster, k, Megatron("a2a"))
    assert abs(recomputed / seconds - 1.5) < 1e-12  # the forward's four again
    assert not Megatron("a2a").problems(cfg, s)
    eight = Megatron("a2a").problems(cfg, replace(s, layout=replace(s.layout, cp=8, dp=1)))
    assert any("does not divide its 16 query and 4 key/value heads" in p.what for p in eight)


def test_the_cp_exchange_is_the_megatron_profiles_choice():
    assert named("megatron") is MEGATRON and named("megatron", "p2p") is MEGATRON
    assert named("fourfold", "p2p") is FOURFOLD
    assert named("megatron", "a2a").cp_comm == "a2a"
    with pytest.raises(ValueError, match="give --framework megatron"):
        named("fourfold", "all_gather")
    with pytest.raises(ValueError, match="give one of p2p, all_gather, a2a"):
        Megatron("ring")


def test_cli_prices_each_cp_exchange(capsys):
    from fourfold.cli.main import main

    args = ["estimate", "--model", "llama-3.1-8b", "--seq", "32768", "--global-batch", "16", "--dp", "2", "--cp", "4",
            "--tp", "2", "--framework", "megatron", "--json"]
    steps = {}
    for comm in ("p2p", "all_gather", "a2a"):
        assert main([*args, "--cp-comm", comm]) == 0
        out = json.loads(capsys.readouterr().out)
        steps[comm] = out["step_seconds"]
        assert f"--cp-comm {comm}" in out["commands"]["estimate"]
    assert len(set(steps.values())) == 3
    assert main(["estimate", "--model", "llama-3.1-8b", "--cp", "2", "--dp", "2", "--cp-comm", "a2a"]) != 0
    assert "give --framework megatron" in capsys.readouterr().err


def test_the_plan_echoes_its_inputs_and_prints_the_command_that_runs_it(capsys):
    """The defaulted global batch is named (it sets the step time); more GPUs than a node run through
    `fourfold slurm`; the run commands name the data (a placeholder: without data flags a run trains on
    the bundled corpus), and the search reports its progress to whoever asks."""
    from fourfold.cli.main import main

    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "64", "--seq", "8192"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("llama 8.0B on 64 x h100-80gb (8 a node), fourfold profile; a step: 1,024 sequences "
                               "(the default: --global-batch) x 8,192 tokens = 8.4M tokens, bf16"), lines[0]
    run = next(line for line in lines if line.startswith("run it"))
    assert run.startswith("run it on 8 nodes: fourfold slurm --nodes 8 --gpus-per-node 8 --output job.sbatch ")
    assert "--data.files YOUR-CORPUS" in run and any("bundled King James Bible" in line for line in lines)
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "a step: 64 sequences x 4,096 tokens" in lines[0]
    assert next(line for line in lines if line.startswith("run it")).startswith("run it:              fourfold train ")
    told = []
    search(SMALL, 16, CLUSTER, job(global_batch=128), progress=lambda done, total: told.append((done, total)))
    assert told and told[-1][0] <= told[-1][1] and [d for d, _ in told] == sorted(d for d, _ in told)
