"""The step-time model's calibration (`fourfold.plan.calibrate`, `fourfold calibrate`): the fit,
its leave-one-group-out figures on the published runs, user runs from CSV files and run
directories, and `plan` marking the candidates its error cannot separate."""

import csv
import dataclasses
import itertools
import json
import re

import numpy as np
import pytest

from fourfold.cli.main import main
from fourfold.config import TrainConfig
from fourfold.models.config import load_config
from fourfold.plan import perf
from fourfold.plan.calibrate import (
    HARDWARE_KNOBS,
    PROFILE_RUNS,
    SOFTWARE_KNOBS,
    UNSPLIT_HARDWARE,
    calibrate,
    dp_scaling,
    fit,
    kind_errors,
    knobs,
    mfu_baseline,
    model_scores,
    plan_scores,
    predicted_job,
    predicted_seconds,
    rule_scores,
    split_parts,
)
from fourfold.plan.constants import UNCALIBRATED, Calibration, Profile, constants
from fourfold.plan.costs import linear_tflops
from fourfold.plan.frameworks import FOURFOLD, MEGATRON
from fourfold.plan.frameworks.fourfold import Fourfold
from fourfold.plan.measured import DATA, Run, flops_per_sequence, make_run, read_csv, read_run_dir, shipped_runs
from fourfold.plan.search import search
from fourfold.spec.hardware import make_cluster
from fourfold.spec.job import Job, megatron_stages
from fourfold.spec.layout import Layout

pytestmark = pytest.mark.torch_free

# docs/planner.md, "Calibration": `python benchmarks/planner_calibration.py`, NeMo's long-sequence
# tables held out (fitted on the other sources' runs)
LONG_SEQUENCE = "NeMo long-sequence tables"
DOCUMENTED = dict(error=0.075, cp_error=0.094, spearman=1.0, mfu_baseline=0.15)


@pytest.fixture(scope="module")
def published():
    return shipped_runs()


def test_the_defaults_are_the_fit_on_every_published_run(published):
    """constants.Calibration's defaults are this fit (rounded) and carry the leave-one-source-out errors."""
    cal, default = fit(published), Calibration()
    assert all(predicted_seconds(r, default) == pytest.approx(predicted_seconds(r, cal), rel=0.005) for r in published)
    assert {k for k, _ in default.cv_errors} == {r.kind for r in published} and 0 < default.cv_error < 0.15


def test_the_llama_a100_runs_are_plain_1f1b_with_their_micro_batch(published):
    """The Llama 3.1 8B A100 runs ran Megatron's plain 1F1B (the data's README): priced with one stage a
    pipeline rank, not the fastest interleaving, so each is one job and the rule sees its micro-batch
    (with interleavings as alternatives its micro-batch read as unknown and the rule scored 0.76, not 0.90)."""
    runs = [r for r in published if r.source == "megatron_llama31_8b_a100.csv"]
    assert len(runs) >= 50 and all(len(r.jobs) == 1 and r.jobs[0].virtual == 1 for r in runs)
    assert all(r.micro_batch in (1, 2) for r in runs)


def test_tensor_collectives_pipelined_with_their_gemms(published):
    """NeMo's and Megatron-Bridge's runs overlap Megatron's sequence-parallel collectives with their
    GEMMs (Transformer Engine's userbuffers; `RunTraits.tp_comm_overlap`, read from the source):
    each is exposed where it outlasts its GEMM's chunks (and a pipelined reduce-scatter's last chunk), over
    slow ones the excess; the runs' gradients are reduced in bf16 (half the reduce-scatter's bytes)."""
    cfg, job = load_config("llama-3.1-70b"), Job(Layout(dp=2, y=8), global_batch=16, micro_batch=1, seq=8192,
                                                 seq_parallel=True, precision="bf16")
    k = constants(Calibration(), make_cluster("dgx-h100"))
    peak = make_cluster("dgx-h100").gpu.bf16_tflops
    plain = MEGATRON.tensor_comm(cfg, job, make_cluster("dgx-h100"), k, 0.0, peak)
    pipelined = MEGATRON.tensor_comm(cfg, job, make_cluster("dgx-h100"), k, 0.0, peak, gemm_overlap=True)
    # NVLink: the gathers hide behind their GEMMs; each pipelined reduce-scatter's last chunk shows
    assert 0 < pipelined < 0.5 * plain
    slow = dataclasses.replace(make_cluster("dgx-h100"), intra_node_gbs=5.0)  # a slow link: the excess shows
    ks = constants(Calibration(), slow)
    assert 0.3 * MEGATRON.tensor_comm(cfg, job, slow, ks, 0.0, peak) < MEGATRON.tensor_comm(
        cfg, job, slow, ks, 0.0, peak, gemm_overlap=True) < MEGATRON.tensor_comm(cfg, job, slow, ks, 0.0, peak)
    no_sp = dataclasses.replace(job, seq_parallel=False)  # (userbuffers overlap the sequence-parallel collectives)
    assert MEGATRON.tensor_comm(cfg, no_sp, slow, ks, 0.0, peak, gemm_overlap=True) == MEGATRON.tensor_comm(
        cfg, no_sp, slow, ks, 0.0, peak)
    exposed = dataclasses.replace(Calibration(), dp_overlap=0.0, param_gather_overlap=0.0)
    fp32, bf16 = (perf.step_time(cfg, job, slow, exposed, MEGATRON, perf.RunTraits(grad_reduce_bytes=b)).dp_comm
                  for b in (4, 2))
    assert 0 < bf16 < fp32
    runs = [r for r in published if r.source in ("NeMo performance summaries", "Megatron-Bridge performance summaries",
                                                 "megatron_core_gpt_h100.csv")]
    assert all(r.traits.tp_comm_overlap for r in runs)  # Megatron-LM's README: --tp-comm-overlap
    runs = [r for r in runs if r.source != "megatron_core_gpt_h100.csv"]
    assert runs and all(r.traits.tp_comm_overlap and r.traits.grad_reduce_bytes == 2 for r in runs)
    assert not any(r.traits.tp_comm_overlap for r in published if r.source == "NeMo long-sequence tables")


def test_long_sequences_and_context_parallelism_hold_on_a_source_left_out(published):
    """NeMo's long-sequence tables (Llama 2 7B and 70B, Llama 3 8B and 70B at 16k to 1M tokens, cp 2
    to 32), fitted on the other sources only: their step times and the order of each table's
    configurations, against one fitted MFU constant and the rule "least tp*cp*pp, then the largest
    micro-batch"."""
    held = [r for r in published if r.source == LONG_SEQUENCE]
    others = [r for r in published if r.source != LONG_SEQUENCE]
    assert len(held) >= 20 and any(r.kind == "cp" for r in held)
    cal = fit(others)
    predicted = [predicted_seconds(r, cal) for r in held]
    model, rule = model_scores(held, predicted), rule_scores(held)
    assert model.error <= DOCUMENTED["error"] + 0.01
    cp = np.mean([abs(r.seconds / p - 1) for r, p in zip(held, predicted) if r.kind == "cp"])
    assert cp <= DOCUMENTED["cp_error"] + 0.01
    baseline = mfu_baseline(others, held)
    assert model.error < np.mean([abs(r.seconds / p - 1) for r, p in zip(held, baseline)]) / 1.5
    assert model.groups >= 2 and model.spearman >= DOCUMENTED["spearman"] - 0.1
    band = Calibration(cv_error=None, cv_errors=kind_errors(others, [predicted_seconds(r, cal) for r in others]))
    jobs = [predicted_job(r, cal)[0] for r in held]
    assert plan_scores(held, predicted, band, jobs).spearman >= DOCUMENTED["spearman"] - 0.1
    # each group sets a published cp run against NeMo's best without cp, whose grid is not published:
    # no rule over grids can place it
    assert rule.groups == 0


def test_llama3_405b_long_context_against_its_8k_row_from_profiles_not_fitted_on_it():
    """Llama 3 405B on 16,384 H100s (arXiv 2407.21783, Table 4; nothing fitted on it): 131,072 tokens
    on tp8 cp16 pp16 dp8 at 380 TFLOP/s a GPU, 8,192 tokens on tp8 pp16 dp128 at 400, 16M tokens a
    step. Both run 16 micro-batches a replica on the same pipeline, so the ratio of their step times
    does not depend on the unpublished stages per rank: the model's must be Meta's within the
    issue's 15%, read with the FLOP count the field uses (PaLM's 6N + 12 L h s, attention unmasked:
    torchtitan's and Megatron's). Under 6N + 6 L h s the measured ratio is 1.69, the model's 2.2."""
    cfg, cluster = load_config("llama-3.1-405b"), make_cluster("dgx-h100")

    def seconds(layout: Layout, seq: int, batch: int, virtual: int) -> float:
        job = Job(layout, global_batch=batch, micro_batch=1, seq=seq, seq_parallel=True, precision="bf16",
                  virtual=virtual, schedule="interleaved-1f1b" if virtual > 1 else "1f1b",
                  stage_layers=megatron_stages(cfg.layers, 16 * virtual))
        return perf.step_time(cfg, job, cluster, Calibration(), MEGATRON, perf.RunTraits(cp_comm="all_gather")).total

    def measured(seq: int, batch: int, tflops: float) -> float:
        return flops_per_sequence("model", cfg, seq) * batch / 16384 / (tflops * 1e12)

    ratio = measured(131072, 128, 380) / measured(8192, 2048, 400)
    assert ratio == pytest.approx(2.27, abs=0.01)
    for virtual in (1, 2, 4):
        model = (seconds(Layout(dp=8, pp=16, cp=16, y=8), 131072, 128, virtual)
                 / seconds(Layout(dp=128, pp=16, y=8), 8192, 2048, virtual))
        assert abs(model / ratio - 1) <= 0.15


def test_the_plan_lists_the_llama_a100_groups_no_worse_than_the_rule_from_a_fit_on_the_others(published):
    """The Llama 3.1 8B A100 groups (16 to 256 GPUs, tp, cp, pp and micro-batch varied), fitted on the
    other sources only: as `fourfold plan` lists them, in tiers within the other sources' per-kind
    error band, each simplest first, their order is no worse than the rule's, and better than the
    predicted times' own (docs/planner.md: 0.93 listed against the rule's 0.90; by predicted time
    alone 0.85). The band here is the other sources' in-sample error (the benchmark's, held out,
    takes six fits)."""
    held = [r for r in published if r.source == "megatron_llama31_8b_a100.csv"]
    others = [r for r in published if r.source != "megatron_llama31_8b_a100.csv"]
    cal = fit(others)
    band = Calibration(cv_error=None, cv_errors=kind_errors(others, [predicted_seconds(r, cal) for r in others]))
    predicted = [predicted_seconds(r, cal) for r in held]
    listed, rule = plan_scores(held, predicted, band), rule_scores(held)
    by_time = model_scores(held, predicted).spearman
    assert listed.groups >= 4 and listed.spearman >= rule.spearman and listed.spearman >= by_time + 0.03


def test_a_fit_changes_only_the_profiles_of_its_clusters():
    cfg, a100, h100 = load_config("llama-3.1-8b"), make_cluster("dgx-a100"), make_cluster("dgx-h100")
    job = Job(Layout(dp=4, y=4), global_batch=64, micro_batch=1, seq=4096, seq_parallel=True, precision="bf16")
    runs = [make_run(cfg, dataclasses.replace(job, layout=Layout(dp=16 // tp, y=tp), micro_batch=mb), a100,
                     MEGATRON, seconds, "made")
            for tp, (mb, seconds) in itertools.product((2, 4), ((1, 3.0), (2, 2.8), (4, 2.7)))]
    assert len(runs) == PROFILE_RUNS
    cal = fit(runs)
    assert [p.cluster for p in cal.profiles] == ["dgx-a100"]
    assert cal.profile(h100) == UNCALIBRATED.profile(h100)  # the H100's measured defaults
    assert cal.profile(h100).efficiency_max == h100.gpu.gemm_efficiency


def test_the_seed_headline_from_the_perlmutter_profile_alone():
    """GPT 80B on 1,024 Perlmutter A100s: the seed paper measured its algorithm at 57% of peak and
    Megatron-LM 26% below (57% / 1.26). Nothing was fitted on Perlmutter: its profile is the preset's
    defaults. Each profile's fastest plan that leaves headroom: fourfold's as the paper's runtime ran
    (its forward collectives waited: no `forward_chunks`) within 20% of 57%, the megatron profile's
    within 20% of Megatron-LM's figure, and their ratio the paper's 1.26 within the model's
    cross-validated error; today's runtime, its forward pipelined, faster still."""
    assert "perlmutter" not in [p.cluster for p in Calibration().profiles]
    cfg, cluster = load_config("gpt-80b"), make_cluster("perlmutter")
    base = Job(global_batch=2048, seq=2048, seq_parallel=True, precision="bf16")

    def fastest(framework) -> float:
        return max(r["mfu"] for r in search(cfg, 1024, cluster, base, framework=framework, top=10)
                   if r["fits"] and not r["tight"])

    fourfold, megatron = fastest(Fourfold(forward_chunks=1)), fastest(MEGATRON)
    assert fastest(FOURFOLD) > fourfold
    assert abs(fourfold / 0.57 - 1) <= 0.2
    assert abs(megatron / (0.57 / 1.26) - 1) <= 0.2
    assert abs(fourfold / megatron / 1.26 - 1) <= Calibration().cv_error


def test_fourfold_prices_megatrons_grid_as_megatron():
    """x = z = 1, y = t with sequence parallelism is Megatron's tensor parallelism, and fourfold's
    runtime overlaps what Megatron's does (the column-parallel input re-gather behind the dX GEMM, the
    input-gradient reduce-scatter behind the dW GEMM): the two profiles' exposed tensor traffic agree.
    With its forward in chunks, fourfold hides part of the forward's collectives: less is exposed, and
    more than Megatron with Transformer Engine's overlap (tp_comm_overlap: every collective pipelined)."""
    cfg, cluster = load_config("gpt-80b"), make_cluster("perlmutter")
    k = constants(Calibration(), cluster)
    for recompute in ("none", "full"):
        job = Job(Layout(dp=32, pp=4, y=8), global_batch=2048, micro_batch=2, seq=2048, seq_parallel=True,
                  precision="bf16", recompute=recompute)
        forward, peak = perf._compute(cfg, job, cluster, k, FOURFOLD).forward, linear_tflops(cluster, k, False)
        megatron = MEGATRON.tensor_comm(cfg, job, cluster, k, forward, peak)
        waited = Fourfold(forward_chunks=1).tensor_comm(cfg, job, cluster, k, forward, peak)
        assert waited > 0 and waited == pytest.approx(megatron)
        pipelined = MEGATRON.tensor_comm(cfg, job, cluster, k, forward, peak, gemm_overlap=True)
        assert pipelined < FOURFOLD.tensor_comm(cfg, job, cluster, k, forward, peak) < waited


def test_the_fit_recovers_constants_the_runs_were_made_with():
    """Runs whose step times the model itself gives under known constants: fitted on some grids
    (more runs than constants), the constants predict the others' times."""
    truth = dataclasses.replace(UNCALIBRATED, attention_ratio=0.45, dp_overlap=0.2, layer_overhead_us=400,
                                profiles=(Profile("dgx-a100", 0.55, 300, 0.8, 0.5),))
    cfg, cluster = load_config("llama-3.1-8b"), make_cluster("dgx-a100")
    runs = []
    for tp, cp, pp, mb, world, seq in [
            (2, 1, 1, 1, 16, 4096), (4, 1, 1, 2, 16, 4096), (8, 1, 1, 1, 16, 4096), (2, 2, 2, 1, 32, 16384),
            (4, 2, 1, 1, 32, 16384), (4, 1, 2, 2, 64, 4096), (8, 1, 2, 1, 64, 4096), (2, 4, 1, 1, 64, 32768),
            (8, 4, 1, 1, 64, 32768), (2, 1, 4, 2, 64, 8192), (4, 1, 1, 4, 128, 2048), (8, 2, 2, 1, 128, 16384),
            (2, 1, 4, 2, 64, 4096), (4, 1, 1, 1, 128, 4096), (8, 2, 1, 1, 128, 16384), (4, 4, 2, 1, 128, 32768)]:
        job = Job(Layout(dp=world // (tp * cp * pp), pp=pp, cp=cp, y=tp), global_batch=512, micro_batch=mb,
                  seq=seq, seq_parallel=True, precision="bf16")
        run = make_run(cfg, job, cluster, MEGATRON, 1.0, "made")
        runs.append(dataclasses.replace(run, seconds=predicted_seconds(run, truth)))
    fitted = fit(runs[:12])
    assert len(runs[:12]) > len(SOFTWARE_KNOBS + HARDWARE_KNOBS)
    for run in runs[12:]:
        assert predicted_seconds(run, fitted) == pytest.approx(run.seconds, rel=0.02)
    assert predicted_seconds(runs[-1], UNCALIBRATED) < 0.8 * runs[-1].seconds  # (the guesses do not)


def test_a_profile_refit_keeps_the_software_constants_and_recovers_the_clusters():
    """A user's runs on a cluster of their own (`fourfold calibrate RUN_DIR...`, `--refit profile`):
    made by the shipped constants with another profile, the refit recovers that profile's step
    times on the runs it did not see, and changes nothing else."""
    shipped = Calibration()
    mine = dataclasses.replace(make_cluster("dgx-h100"), name="my-h100")
    truth = dataclasses.replace(shipped, profiles=(*shipped.profiles, Profile("my-h100", 0.6, 250, 0.7, 0.5)))
    cfg = load_config("llama-3.1-8b")
    runs = []
    for tp, cp, pp, mb, world in [(2, 1, 1, 1, 16), (4, 2, 1, 1, 16), (8, 1, 1, 2, 16), (2, 2, 2, 1, 32),
                                  (4, 1, 2, 2, 32), (8, 2, 1, 1, 32), (4, 4, 1, 1, 64), (2, 1, 4, 1, 64)]:
        job = Job(Layout(dp=world // (tp * cp * pp), pp=pp, cp=cp, y=tp), global_batch=256, micro_batch=mb,
                  seq=16384, seq_parallel=True, precision="bf16")
        run = make_run(cfg, job, mine, MEGATRON, 1.0, "made")
        runs.append(dataclasses.replace(run, seconds=predicted_seconds(run, truth)))
    cal, _ = calibrate(runs[:6], software=False)
    assert [p for p in cal.profiles if p.cluster != "my-h100"] == list(shipped.profiles)
    assert all(getattr(cal, k.name) == getattr(shipped, k.name) for k in SOFTWARE_KNOBS)
    for run in runs[6:]:
        assert predicted_seconds(run, cal) == pytest.approx(run.seconds, rel=0.02)
    assert abs(predicted_seconds(runs[-1], shipped) / runs[-1].seconds - 1) > 0.05  # (the preset's defaults do not)


def test_a_fit_puts_the_time_where_the_recorded_split_measured_it():
    """Runs on a cluster of the user's own whose links are slow (made by the shipped constants with
    that profile): with the runs' recorded splits (`fourfold train`'s timing: compute, data-parallel,
    the layers' and the pipeline's waits; `split_parts`) the profile-only fit sets all four of its
    constants and puts each part's time where the run measured it; from the step times alone it sets
    only the two they can tell (`UNSPLIT_HARDWARE`), and cannot place NVLink's slowness."""
    shipped = Calibration()
    mine = dataclasses.replace(make_cluster("dgx-h100"), name="my-h100")
    truth = dataclasses.replace(shipped, profiles=(*shipped.profiles, Profile("my-h100", 0.6, 250, 0.25, 0.4)))
    cfg = load_config("llama-3.1-8b")
    runs = []
    for tp, cp, pp, mb, world in [(8, 1, 1, 2, 16), (2, 2, 2, 1, 32)]:
        job = Job(Layout(dp=world // (tp * cp * pp), pp=pp, cp=cp, y=tp), global_batch=256, micro_batch=mb,
                  seq=16384, seq_parallel=True, precision="bf16")
        p = perf.step_time(cfg, job, mine, truth, MEGATRON)
        split = (("compute", p.compute + p.optimizer), ("dp", p.dp_comm), ("tensor", p.exposed_comm), ("cp", 0.0),
                 ("ep", 0.0), ("pipeline", p.bubble + p.tied_embedding))
        runs.append(dataclasses.replace(make_run(cfg, job, mine, MEGATRON, 1.0, "made"), seconds=p.total, split=split))
    timed = fit(runs, start=shipped, software=False)
    untimed = fit([dataclasses.replace(r, split=None) for r in runs], start=shipped, software=False)

    def layers_error(cal):  # the layers' exposed collectives, model against measured
        return max(abs(model / measured - 1) for r in runs for part, measured, model in split_parts(r, cal)
                   if part == "layers")

    assert all(predicted_seconds(r, timed) == pytest.approx(r.seconds, rel=0.01) for r in runs)
    assert layers_error(timed) < 0.05 < 0.2 < layers_error(untimed), (layers_error(timed), layers_error(untimed))
    assert [k.name for _, k in knobs(runs, software=False)] == [k.name for k in HARDWARE_KNOBS]
    assert ([k.name for _, k in knobs([dataclasses.replace(r, split=None) for r in runs], software=False)]
            == list(UNSPLIT_HARDWARE))


COLUMNS = ["model", "gpu", "gpus_per_node", "cluster", "inter_node_gbs", "seq", "tp", "cp", "pp", "dp", "micro_batch",
           "global_batch", "measured_tflops_per_gpu", "flops_convention", "outcome"]


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, COLUMNS)
        out.writeheader()
        for row in rows:
            out.writerow({"model": "llama-3.1-8b", "gpu": row["gpu"], "gpus_per_node": row["gpus_per_node"],
                          "cluster": "dgx-a100", "inter_node_gbs": 12.5, "seq": row["seq"], "tp": row["tp"],
                          "cp": row["cp"], "pp": row["pp"], "dp": row["dp"], "micro_batch": row["mbs"],
                          "global_batch": 1024, "measured_tflops_per_gpu": row["measured_tflops_per_gpu"],
                          "flops_convention": "megatron", "outcome": row["outcome"]})


def test_calibrate_command_on_a_csv_predicts_other_runs(tmp_path, capsys):
    """A CSV in the calibration format of the runs on 16 to 64 GPUs -> cal.json -> the runs on 128
    and 256 GPUs, predicted better than by the guesses; plan takes the file and prints its error."""
    rows = list(csv.DictReader(open(DATA / "megatron_llama31_8b_a100.csv")))
    _write_csv(tmp_path / "small.csv", [r for r in rows if int(r["world"]) in (16, 32, 64)])
    _write_csv(tmp_path / "large.csv", [r for r in rows if int(r["world"]) in (128, 256)])
    fitted = ["calibrate", "--csv", str(tmp_path / "small.csv"), "--refit", "all", "-o", str(tmp_path / "cal.json")]
    assert main(fitted) == 0
    out = capsys.readouterr().out
    assert "fitted (cross-validated)" in out and "least tp*cp*pp" in out
    assert re.search(r"pp1v1 cp2 x1y4z1 ep1 mb1 +2,4,8 ", out)  # the grids measured at three dp: how they scale
    saved = json.loads((tmp_path / "cal.json").read_text())
    assert saved["fit"]["runs"] == 33 and saved["fit"]["groups"] == 3 and 0 < saved["cv_error"] < 0.2
    cal = Calibration.load(str(tmp_path / "cal.json"))
    held_out = read_csv(tmp_path / "large.csv")
    scores = model_scores(held_out, [predicted_seconds(r, cal) for r in held_out])
    guesses = model_scores(held_out, [predicted_seconds(r, UNCALIBRATED) for r in held_out])
    assert len(held_out) == 22 and scores.error < 0.15 and scores.error < guesses.error / 2
    assert scores.spearman > guesses.spearman
    plan = ["plan", "--model", "llama-3.1-8b", "--gpus", "64", "--cluster", "dgx-a100", "--gpu", "a100-40gb",
            "--seq", "8192", "--framework", "megatron", "--calibrate", str(tmp_path / "cal.json")]
    assert main([*plan, "--json", "--top", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["cv_error"] == saved["cv_error"]
    first = printed["candidates"][0]  # the fastest, unless others are as fast within the error: then the simplest
    fastest = min(c["step_seconds"] for c in printed["candidates"])
    assert first["tie"] or first["step_seconds"] == fastest


def test_a_grids_cost_that_adding_replicas_does_not_shrink_is_told_from_its_work():
    """Runs made as 120 s of work a replica over dp plus 3 s that does not shrink (over the gradients'
    group g = dp * cp, as (g - 1) / g), given out of order: the fit gives both back, and that over the
    job's 64 micro-batches. Not fitted with them: the same grid under full recompute (another job),
    and a grid measured at two dp."""
    cfg, a100 = load_config("llama-3.1-8b"), make_cluster("dgx-a100")
    job = Job(Layout(cp=2, pp=2, y=4), global_batch=64, micro_batch=1, seq=4096, seq_parallel=True,
              precision="bf16")

    def run(layout: Layout, seconds: float, **changes) -> Run:
        return make_run(cfg, dataclasses.replace(job, layout=layout, **changes), a100, MEGATRON, seconds, "made")

    runs = [run(Layout(dp=dp, cp=2, pp=2, y=4), 120 / dp + 3 * (2 * dp - 1) / (2 * dp)) for dp in (4, 2, 8)]
    runs += [run(Layout(dp=16, cp=2, pp=2, y=4), 1.0, recompute="full"), run(Layout(dp=2, y=8), 50.0),
             run(Layout(dp=4, y=8), 25.0)]
    (only,) = dp_scaling(runs, Calibration())
    assert only.dps == (2, 4, 8) and only.run is runs[2]
    assert only.work == pytest.approx(120) and only.fixed == pytest.approx(3) and only.worst < 1e-9
    assert only.fixed_per_micro_batch == pytest.approx(3 / 64)
    assert only.model_work > 0 and only.model_fixed > 0  # the model's own: its bubble and gradients
    # experts over ep=2 (a grid of dp 1 would be no layout at all): grouped apart from the same grid at ep 1
    mixtral = load_config("mixtral-8x7b")
    experts = [make_run(mixtral, dataclasses.replace(job, layout=Layout(dp=dp, ep=ep, y=8)), a100, MEGATRON,
                        80 / dp + 2 * ep * (dp - 1) / dp, "made") for dp, ep in itertools.product((2, 4, 8), (1, 2))]
    assert sorted((round(d.work), round(d.fixed)) for d in dp_scaling(experts, Calibration())) == [(80, 2), (80, 4)]


def _run_dir(path, grid: dict, seconds: list[float], checkpoint: bool = True, mfu: float | None = 0.3,
             splits: list[dict] = ()):
    """What `fourfold train` leaves in a run directory: log.jsonl and a checkpoint's meta.json (a run
    on GPUs; `mfu=None`: on CPU); `splits`: its timing records' median splits, one after each step."""
    path.mkdir()
    cfg = TrainConfig()
    for dim, n in grid.items():
        setattr(cfg.grid, dim, n)
    cfg.batch.global_batch, cfg.batch.micro_batch, cfg.batch.seq = 16, 2, 128
    records = [dict(step=i, loss=5.0, seconds=s, skipped=False, peak_memory_gib=0.5, mfu=mfu)
               for i, s in enumerate(seconds)]
    for i, split in enumerate(splits):  # (the trainer writes each before the steps it covers)
        records.insert(2 * i, dict(timing_after_step=i + 1, steps=1, median=split, slowest=[], stragglers=[]))
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if checkpoint:
        meta = path / "checkpoints" / "step-00000010" / "meta.json"
        meta.parent.mkdir(parents=True)
        meta.write_text(json.dumps(dict(step=10, config=cfg.to_dict(),
                                        model=dataclasses.asdict(load_config(cfg.model.preset)))))


def test_a_run_directory_gives_its_job_and_median_step(tmp_path, capsys):
    _run_dir(tmp_path / "a", {"dp": 2, "x": 2}, [9.0, 1.0, 1.2, 1.1])
    run = read_run_dir(tmp_path / "a")
    assert run.jobs[0].layout.sizes == dict(dp=2, pp=1, cp=1, x=2, y=1, z=1)
    assert run.jobs[0].precision == "bf16"  # precision auto, on GPUs
    assert run.seconds == 1.1 and run.framework is FOURFOLD  # the first step (warm-up) left out
    _run_dir(tmp_path / "b", {"dp": 4}, [5.0, 2.0, 2.2])
    def parts(compute, dp, tensor):
        return dict(step=compute + dp + tensor, compute=compute, dp=dp, tensor=tensor, pipeline=0.0, cp=0.0, ep=0.0)

    _run_dir(tmp_path / "c", {"y": 2, "dp": 2}, [5.0, 1.5, 1.5], splits=[parts(4, 0.5, 0.5), parts(1.2, 0.1, 0.2),
                                                                        parts(1.0, 0.3, 0.2)])
    # the measured split: each part's median over the timing records after the first (the warm-up)
    assert read_run_dir(tmp_path / "c").split == (("compute", 1.1), ("dp", 0.2), ("tensor", 0.2), ("pipeline", 0.0),
                                                  ("cp", 0.0), ("ep", 0.0))
    assert read_run_dir(tmp_path / "b").split is None
    args = ["calibrate", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"), "-o", str(tmp_path / "c.json")]
    assert main(args) == 0
    # `--refit profile`, the default: the cluster's profile only; not every run split: what step times fit
    constants = len(UNSPLIT_HARDWARE)
    out = capsys.readouterr().out
    assert f"3 runs (4 recorded parts of steps) for {constants} constants" not in out  # c's parts: 7 measurements
    assert main(args[:3] + args[4:]) == 0  # a and b: step times only
    assert f"2 runs (0 recorded parts of steps) for {constants} constants: the fit is underdetermined" in (
        capsys.readouterr().out)
    assert re.search(r"^c +measured +1\.100 +0\.200 +0\.200 +0\.000$", out, re.M), out
    assert re.search(r"^c +model +\d+\.\d{3} +\d+\.\d{3} +\d+\.\d{3} +0\.000$", out, re.M), out
    _run_dir(tmp_path / "bare", {"dp": 2}, [1.0, 1.0], checkpoint=False)
    with pytest.raises(ValueError, match="give it with --csv"):
        read_run_dir(tmp_path / "bare")
    with pytest.raises(ValueError, match="has no log.jsonl"):
        read_run_dir(tmp_path)
    _run_dir(tmp_path / "wide", {"dp": 16}, [1.0, 1.0])  # 16 sequences over dp16 * micro-batch 2
    with pytest.raises(ValueError, match="wide: batch.global_batch=16 must be a multiple of dp\\*micro_batch"):
        read_run_dir(tmp_path / "wide")


def test_runs_on_cpu_are_refused_by_name_before_any_fit(tmp_path, capsys):
    _run_dir(tmp_path / "gpu", {"dp": 2}, [1.0, 1.0, 1.1])
    _run_dir(tmp_path / "cpu", {"dp": 2, "cp": 2}, [1.0, 1.0, 1.1], mfu=None)  # cp: the rules ask GPUs' flash kernel
    assert main(["calibrate", str(tmp_path / "gpu"), str(tmp_path / "cpu"), "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'cpu'} ran on CPU" in err and "give runs of `fourfold train` on GPUs, or" in err
    assert "--csv rows" in err and not (tmp_path / "c.json").exists()


def test_a_singular_fit_names_the_cause(monkeypatch):
    """Runs too alike to determine the constants make the normal equations singular (how soon depends
    on the runs' numbers: the solver is made to fail here)."""
    def singular(*_):
        raise np.linalg.LinAlgError("Singular matrix")

    monkeypatch.setattr(np.linalg, "solve", singular)
    cfg, cluster = load_config("llama-3.1-8b"), make_cluster("dgx-a100")
    job = Job(Layout(dp=2, y=4), global_batch=512, micro_batch=1, seq=4096, seq_parallel=True, precision="bf16")
    runs = [make_run(cfg, job, cluster, FOURFOLD, seconds, "made") for seconds in (1.0, 1.1)]
    constants = len(SOFTWARE_KNOBS)  # (one run: no profile)
    singular = f"the fit on 1 runs is singular: too few distinct runs or groups for {constants}"
    with pytest.raises(ValueError, match=singular):
        calibrate(runs)


def test_plan_marks_candidates_within_the_error_as_ties(tmp_path, capsys):
    plan = ["plan", "--model", "llama-2-7b", "--gpus", "8", "--global-batch", "16", "--calibrate"]
    loose, unknown = tmp_path / "loose.json", tmp_path / "unknown.json"
    loose.write_text(json.dumps({"cv_error": 0.5}))
    unknown.write_text(json.dumps({"cv_error": None}))
    assert main([*plan, str(loose)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("dp")]
    ties = [r for r in rows if "  ~ " in r]
    assert len(ties) >= 2 and ties[0] == rows[0]  # the ties lead
    assert "+-50.0% (the model's cross-validated error)" in table
    assert main([*plan, str(unknown)]) == 0
    table = capsys.readouterr().out
    assert "  ~ " not in table and "the model's error is unknown" in table


def test_calibration_files_name_what_is_wrong(tmp_path, capsys):
    assert main(["estimate", "--model", "llama-3.1-8b", "--calibrate", str(tmp_path / "none.json")]) == 2
    assert f"--calibrate {tmp_path / 'none.json'}: no such file; give the cal.json" in capsys.readouterr().err
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"efficiency_max": 0.7, "bandwidth_factor": 0.8}))
    with pytest.raises(ValueError, match="give its value as intra_node_efficiency and inter_node_efficiency"):
        Calibration.load(str(old))
    old.write_text(json.dumps({"efficiency": 0.7}))
    with pytest.raises(ValueError, match="unknown constants efficiency; the constants are"):
        Calibration.load(str(old))
