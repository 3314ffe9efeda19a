"""Fit the step-time model's constants (`constants.Calibration`) to measured runs
(`measured.Run`), and cross-validate them.

Each run is predicted by the planner's own model: `perf.step_time`, whose total `search.predict`
reports as `step_seconds`. The constants are fitted by least squares on the log of the step time
(Levenberg-Marquardt; numpy only) and judged by leave-one-group-out cross-validation, a group
being the runs a user chooses among: one model on one cluster and GPU count, at one sequence
length and global batch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace

import numpy as np

from fourfold.plan.constants import UNCALIBRATED, Calibration, Profile
from fourfold.plan.measured import Run
from fourfold.plan.perf import StepTime, model_flops_per_token, step_time
from fourfold.plan.search import rank
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout

TOP1_MARGIN = 0.05  # a favourite within 5% of the measured best counts as right
def predicted_job(run: Run, cal: Calibration) -> tuple[Job, StepTime]:
    """The model's step for `run` and the job it is of (the fastest of its possible micro-batches and
    stages); a run that says whether it overlapped the data-parallel collectives sets the overlaps."""
    if run.overlap_dp is not None:
        overlap = float(run.overlap_dp)
        cal = replace(cal, dp_overlap=overlap, param_gather_overlap=overlap)
    return min(((job, step_time(run.cfg, job, run.cluster, cal, run.framework, run.traits)) for job in run.jobs),
               key=lambda pair: pair[1].total)


def predicted_seconds(run: Run, cal: Calibration) -> float:
    return predicted_job(run, cal)[1].total


# A measured part of a step under this share of it is timer noise to a fit on logs: parts are
# compared at no less than it
SPLIT_FLOOR = 0.02


def split_parts(run: Run, cal: Calibration, step: StepTime | None = None) -> list[tuple[str, float, float]]:
    """(part, measured, model) seconds a step of a run that recorded its split (`Run.split`): compute
    (with the optimizer's update), the data-parallel waits, the layers' collectives (tensor, cp,
    ep) and the pipeline's waits (its bubble and tied embedding); [] for a run without one. `step`:
    the model's step for the run, when the caller has it (`predicted_job`)."""
    if not run.split:
        return []
    m, p = dict(run.split), step or predicted_job(run, cal)[1]
    return [("compute", m["compute"], p.compute + p.optimizer), ("dp", m["dp"], p.dp_comm),
            ("layers", m["tensor"] + m["cp"] + m["ep"], p.exposed_comm),
            ("pipeline", m["pipeline"], p.bubble + p.tied_embedding)]


# ----- the fit -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Knob:
    """A fitted constant and the physically plausible range it may take (log: fitted on a log scale)."""

    name: str
    low: float
    high: float
    log: bool = False

    def coordinate(self, value: float) -> float:
        return math.log(value) if self.log else value

    def value(self, coordinate: float) -> float:
        return math.exp(coordinate) if self.log else coordinate


# Software: the same on every cluster, fitted across all the runs.
SOFTWARE_KNOBS = (
    # flash attention's best rate against the GEMMs': FlashAttention-2 about 190 of the A100 GEMMs'
    # 270 TFLOP/s (causal, head dimension 128: 0.7), FlashAttention-3 and cuDNN 0.6-0.75 on H100
    Knob("attention_ratio", 0.2, 1.0),
    # keys per query and kernel call at half that rate: published curves are within 3/4 of their
    # best from 512 keys on (Dao 2023, Fig. 4): at most 512
    Knob("attention_half", 16.0, 512.0, log=True),
    # FP8 GEMMs: twice bf16's peak on Hopper and Blackwell, reached less well (cuBLAS on H100: about 1.6x)
    Knob("fp8_speedup", 1.4, 1.8),
    # (ring_overlap is not fitted: both runtimes send the next block while attending the current one)
    Knob("dp_overlap", 0.0, 1.0),
    Knob("layer_overhead_us", 0.0, 5000.0),
    # a micro-batch's host work (a schedule step: forward and backward calls, the loss, p2p calls) is
    # milliseconds; kernel launches are the per-layer constant. Unbounded, the Llama runs take 43 ms
    # and push the H100 profile's GEMM efficiency to 1.0 (its measured best is 0.80): docs/planner.md
    Knob("micro_batch_overhead_us", 0.0, 10000.0),
)
# Hardware: a `perf.Profile` per cluster the runs were measured on.
HARDWARE_KNOBS = (
    Knob("efficiency_max", 0.3, 1.0),
    Knob("efficiency_half", 1.0, 4096.0, log=True),
    Knob("intra_node_efficiency", 0.1, 1.0, log=True),  # a collective cannot beat the link
    Knob("inter_node_efficiency", 0.3, 1.0, log=True),  # NCCL reaches well over 30% of the NICs' rate
)
# What step times alone fit of a cluster's profile. Without a recorded split of each step they cannot
# tell the GEMM curve's half point and NVLink's efficiency from the rest (fitted on the published
# runs, those trade with attention's rate and the NICs along flat valleys: docs/planner.md): they keep
# their preset's figures (the GPU's ridge; 0.8 of NVLink)
UNSPLIT_HARDWARE = ("efficiency_max", "inter_node_efficiency")
# Where every fit starts: mid-range (every fold starts here, never from another fold's answer).
# No profiles: a cluster the runs do not cover keeps its preset's defaults, never the shipped fit's.
START = Calibration(attention_ratio=0.6, attention_half=512, fp8_speedup=1.5, dp_overlap=0.5, layer_overhead_us=100,
                    micro_batch_overhead_us=1000, cv_error=None, profiles=())
START_PROFILE = dict(efficiency_max=0.6, efficiency_half=128, intra_node_efficiency=0.5, inter_node_efficiency=0.5)


# A cluster's hardware profile is fitted from this many runs on it; with fewer it keeps its preset's
# measured defaults (one or two runs cannot tell four constants apart from the software ones)
PROFILE_RUNS = 6


def knobs(runs: list[Run], software: bool = True) -> list[tuple[str | None, Knob]]:
    """The constants a fit to `runs` sets: (None, software knob), then (cluster, hardware knob) for
    each cluster with PROFILE_RUNS or more of the runs: all of HARDWARE_KNOBS where every run of the
    cluster recorded its split, else UNSPLIT_HARDWARE. `software` False: only the profiles, of every
    cluster of the runs (the software constants held, nothing else to tell them from)."""
    names = [r.cluster.name for r in runs]
    clusters = sorted(set(names)) if not software else sorted(c for c in set(names) if names.count(c) >= PROFILE_RUNS)

    def hardware(c: str) -> list[Knob]:  # a cluster whose every run recorded its split: all four
        split = all(r.split for r in runs if r.cluster.name == c)
        return [k for k in HARDWARE_KNOBS if split or k.name in UNSPLIT_HARDWARE]

    return [(None, k) for k in SOFTWARE_KNOBS if software] + [(c, k) for c in clusters for k in hardware(c)]


def residuals(run: Run, cal: Calibration) -> list[float]:
    """log(predicted / measured) of the run's step time and, where it recorded its split, of each
    part (`split_parts`, each taken at no less than SPLIT_FLOOR of the step): a user's timed runs
    tell the fit which constant a step's error belongs to (GEMMs, the links inside or across nodes)."""
    floor, step = SPLIT_FLOOR * run.seconds, predicted_job(run, cal)[1]
    return [math.log(step.total / run.seconds)] + [
        math.log(max(model, floor) / max(measured, floor)) for _, measured, model in split_parts(run, cal, step)]


def log_errors(runs: list[Run], cal: Calibration) -> np.ndarray:
    """The residuals (`residuals`) of every run, one after another."""
    return np.array([e for r in runs for e in residuals(r, cal)])


def _calibration(start: Calibration, fitted: list[tuple[str | None, Knob]], theta,
                 presets: dict[str, Profile]) -> Calibration:
    """`start` with the fitted constants `theta`: the software ones, and a profile per cluster (the
    constants not fitted: its preset's, `presets`)."""
    software = {k.name: k.value(float(t)) for (c, k), t in zip(fitted, theta) if c is None}
    profiles = {}
    for (c, k), t in zip(fitted, theta):
        if c is not None:  # (every hardware knob of a cluster is fitted together)
            profiles.setdefault(c, {})[k.name] = k.value(float(t))
    kept = tuple(p for p in start.profiles if p.cluster not in profiles)
    fitted_profiles = tuple(replace(presets[c], **v) for c, v in sorted(profiles.items()))
    return replace(start, **software, profiles=kept + fitted_profiles)


# The fit's landscape has basins of nearly the same error that predict other runs differently (its
# constants trade along flat directions: attention's rate against the H100 profile's NICs; docs/planner.md):
# a full fit descends from START and from attention's rate near either end of its range, and keeps the lowest
STARTS = (START, replace(START, attention_ratio=0.3), replace(START, attention_ratio=0.8))


def fit(runs: list[Run], start: Calibration | None = None, iterations: int = 30, tolerance: float = 1e-5,
        software: bool = True) -> Calibration:
    """The constants that minimise the mean squared log error of the runs' step times (`knobs`):
    Levenberg-Marquardt from `start` (None: from each of STARTS, the lowest error kept), each step
    clipped to the knobs' ranges, with finite-difference derivatives (taken inwards at a bound).
    Only the profiles of the runs' clusters change. `software` False: only those profiles are
    fitted, each from `start`'s."""
    starts = (start,) if start is not None else STARTS if software else (START,)
    return min((_descend(runs, s, iterations, tolerance, software) for s in starts), key=lambda fitted: fitted[1])[0]


def _descend(runs: list[Run], start: Calibration, iterations: int, tolerance: float,
             software: bool) -> tuple[Calibration, float]:
    """`fit` from one start: the constants it ends at, and their error."""
    fitted = knobs(runs, software)
    low = np.array([k.coordinate(k.low) for _, k in fitted])
    high = np.array([k.coordinate(k.high) for _, k in fitted])

    presets = {r.cluster.name: (UNCALIBRATED if software else start).profile(r.cluster) for r in runs}

    def calibration(theta: np.ndarray) -> Calibration:
        return _calibration(start, fitted, theta, presets)

    # a full fit starts every profile mid-range; a profile-only fit from the cluster's current one
    first = {r.cluster.name: START_PROFILE if software else asdict(start.profile(r.cluster))
             for r in runs}
    theta = np.clip([k.coordinate(getattr(start, k.name) if c is None else first[c][k.name]) for c, k in fitted],
                    low, high)
    # a cluster's constants move only its own runs' residuals: their derivatives elsewhere are zero
    per_run = [residuals(run, calibration(theta)) for run in runs]
    r = np.array([e for errors in per_run for e in errors])
    ends = np.cumsum([len(errors) for errors in per_run])
    rows = [np.arange(end - len(errors), end) for errors, end in zip(per_run, ends)]
    moves = [list(range(len(runs))) if c is None else [j for j, run in enumerate(runs) if run.cluster.name == c]
             for c, _ in fitted]
    moved_rows = [np.concatenate([rows[j] for j in m]) if m else np.array([], int) for m in moves]
    cost, damping = r @ r, 1e-2
    steps = 1e-4 * (high - low)
    for _ in range(iterations):
        columns = []
        for i, h in enumerate(steps):
            h = -h if theta[i] + h > high[i] else h
            moved = theta.copy()
            moved[i] += h
            column = np.zeros(len(r))
            column[moved_rows[i]] = (log_errors([runs[j] for j in moves[i]], calibration(moved)) - r[moved_rows[i]]) / h
            columns.append(column)
        jacobian = np.column_stack(columns)
        a, g = jacobian.T @ jacobian, jacobian.T @ r
        while damping < 1e8:
            try:
                step = np.linalg.solve(a + damping * np.diag(np.diag(a) + 1e-12), g)
            except np.linalg.LinAlgError:  # runs too alike to tell the constants apart
                raise ValueError(f"the fit on {len(runs)} runs is singular: too few distinct runs or groups for "
                                 f"{len(fitted)} constants (cross-validation leaves a group, or with one group a run, "
                                 f"out of each fit); add runs that differ (other grids, micro-batches, GPU counts)"
                                 ) from None
            trial_theta = np.clip(theta - step, low, high)
            trial = log_errors(runs, calibration(trial_theta))
            if trial @ trial < cost:
                break
            damping *= 4
        else:
            break  # no step lowers the error: a minimum
        improvement = (cost - trial @ trial) / cost
        theta, r, cost, damping = trial_theta, trial, trial @ trial, damping / 3
        if improvement < tolerance:
            break
    return calibration(theta), cost


# ----- cross-validation and scores -----------------------------------------------------------------

def folds(runs: list[Run]) -> list[str]:
    """Each run's cross-validation fold: its group; groups of a single run from one source form one
    fold (a table of one run per model: held out together, a stricter test than one at a time);
    when that leaves a single fold, each run is a fold of its own."""
    groups = [r.group for r in runs]
    fold = [r.source if groups.count(r.group) == 1 else r.group for r in runs]
    return fold if len(set(fold)) > 1 else [str(i) for i in range(len(runs))]


def cross_validate(runs: list[Run], **fit_options) -> tuple[list[float], list[Job]]:
    """Each run's step time predicted by constants fitted without its fold (`folds`), and the job
    it is of (`predicted_job`: of a run's alternatives, the fastest by those constants)."""
    return _held_out(runs, folds(runs), **fit_options)


def _held_out(runs: list[Run], fold: list[str], **fit_options) -> tuple[list[float], list[Job]]:
    """Each run's step time and job (`predicted_job`) by constants fitted on the runs of the other folds."""
    predicted, jobs = [0.0] * len(runs), [r.jobs[0] for r in runs]
    for held_out in sorted(set(fold)):
        cal = fit([r for r, f in zip(runs, fold) if f != held_out], **fit_options)
        for i, f in enumerate(fold):
            if f == held_out:
                jobs[i], step = predicted_job(runs[i], cal)
                predicted[i] = step.total
    return predicted, jobs


def _ranks(values: list[float]) -> np.ndarray:
    """Ranks from 1, ties given their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = np.empty(len(values))
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (0 where either side is all ties)."""
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclass(frozen=True)
class Scores:
    spearman: float  # median over groups of 2 or more configurations, of the rank correlation with the measured speed
    top1: float  # share of those groups whose favourite runs within TOP1_MARGIN of the measured best
    groups: int  # how many groups of 2 or more runs
    error: float | None  # mean |predicted / measured throughput - 1| over every run (None: a rule, no times)


def scores(runs: list[Run], speed: list[float], error_of: list[float] | None = None) -> Scores:
    """How `speed` (higher is faster; ties allowed) ranks each group's runs against their measured
    speed. `error_of`: predicted step seconds, for the error figures."""
    by_group: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        by_group.setdefault(r.group, []).append(i)
    rhos, hits = [], []
    for members in by_group.values():
        if len({runs[i].jobs for i in members}) < 2:
            continue  # one run, or one configuration measured again (another release): no choice to rank
        measured = [1 / runs[i].seconds for i in members]
        rhos.append(spearman([speed[i] for i in members], measured))
        top = max(speed[i] for i in members)
        favourites = [i for i in members if speed[i] == top]  # a tie counts as a draw among its members
        hits.append(sum(1 / runs[i].seconds >= (1 - TOP1_MARGIN) * max(measured) for i in favourites)
                    / len(favourites))
    error = None
    if error_of is not None:  # predicted / measured throughput = measured / predicted seconds
        error = float(np.mean([abs(r.seconds / p - 1) for r, p in zip(runs, error_of)]))
    return Scores(float(np.median(rhos)) if rhos else math.nan, float(np.mean(hits)) if hits else math.nan,
                  len(rhos), error)


def model_scores(runs: list[Run], predicted: list[float]) -> Scores:
    return scores(runs, [1 / p for p in predicted], predicted)


def plan_scores(runs: list[Run], predicted: list[float], band: float | Calibration,
                jobs: list[Job] | None = None) -> Scores:
    """How `fourfold plan` orders each group (`search.rank`) on the predicted step times: in tiers,
    the fastest left and those within the error band of it, each simplest first.
    `band`: one error, or a Calibration whose per-kind errors (`cv_errors`) set it. `jobs`: the job
    each time is of (`predicted_job`), which `plan` would list; else each run's first (an unpublished
    grid's or micro-batch's then counts as its simplest alternative, micro-batch unknown)."""
    cal = band if isinstance(band, Calibration) else Calibration(cv_error=band, cv_errors=())
    speed = [0.0] * len(runs)
    for group in {r.group for r in runs}:
        members = [dict(fits=True, tight=False, step_seconds=predicted[i], memory_gib=0.0, index=i,
                        micro_batch=jobs[i].micro_batch if jobs else r.micro_batch or 0,
                        **(jobs[i] if jobs else r.jobs[0]).layout.sizes)
                   for i, r in enumerate(runs) if r.group == group]
        for position, m in enumerate(rank(members, cal)):
            speed[m["index"]] = -position
    return scores(runs, speed, predicted)


def rule_scores(runs: list[Run]) -> Scores:
    """The rule "least tp*cp*pp, then the largest micro-batch" (an unknown micro-batch counts as 0),
    on the runs whose grid was published: a rule over configurations cannot place an unpublished one
    (NeMo's "best without cp", whose alternatives the model's default constants pick)."""
    known = [r for r in runs if len({j.layout for j in r.jobs}) == 1]
    return scores(known, [-r.model_parallel + (r.micro_batch or 0) / 1e3 for r in known])


@dataclass(frozen=True)
class CrossValidation:
    model: Scores  # the held-out step times' own order
    plan: Scores  # `fourfold plan`'s order of them: tiers within the cross-validated error, by the rule


def calibrate(runs: list[Run], software: bool = True) -> tuple[Calibration, CrossValidation]:
    """The constants fitted on every run, carrying their cross-validated error (`cv_error`), and the
    cross-validated scores. `software` False: only the profiles of the runs' clusters, from the shipped
    fit (`constants.Calibration`'s defaults), whose software constants (114 published runs) are kept."""
    if len(runs) < 2:
        raise ValueError(f"calibration needs 2 or more measured runs, got {len(runs)}")
    options = {} if software else dict(start=Calibration(), software=False)
    predicted, jobs = cross_validate(runs, **options)
    model = model_scores(runs, predicted)
    cal = replace(fit(runs, **options), cv_error=model.error, cv_errors=kind_errors(runs, predicted))
    return cal, CrossValidation(model, plan_scores(runs, predicted, cal, jobs))


def comparison(runs: list[Run], cross: CrossValidation) -> str:
    """A table of the cross-validated scores `cross` of the fit, beside those of the uncalibrated
    guesses and of the rule on the same runs."""
    before = model_scores(runs, [predicted_seconds(r, UNCALIBRATED) for r in runs])
    lines = [f"{'':<30} {'Spearman':>8} {'top-1':>6} {'error':>6}"]
    for name, s in (("fitted (cross-validated)", cross.model), ("  as `fourfold plan` orders it", cross.plan),
                    ("uncalibrated guesses", before), ("least tp*cp*pp, then most mb", rule_scores(runs))):
        error = f"{s.error:6.1%}" if s.error is not None else "     -"
        lines.append(f"{name:<30} {s.spearman:8.2f} {s.top1:6.0%} {error}")
    lines.append(f"Spearman: median over the {cross.model.groups} groups of 2 or more runs; top-1: share of them whose "
                 f"favourite runs within {TOP1_MARGIN:.0%} of the measured best; error: mean over the {len(runs)} "
                 f"runs of |predicted / measured throughput - 1|")
    return "\n".join(lines)


def split_table(runs: list[Run], cal: Calibration) -> str | None:
    """For the runs that recorded their step's split (`Run.split`), the measured seconds a step by
    part beside the model's: compute (and the optimizer's update), the data-parallel waits, the
    layers' collectives (tensor, cp, ep) and the pipeline's waits (its bubble). None: no such run."""
    timed = [r for r in runs if r.split]
    if not timed:
        return None
    lines = [f"{'run':<24} {'':<9} {'compute':>8} {'dp':>8} {'layers':>8} {'pipeline':>8}"]
    for r in timed:
        parts = split_parts(r, cal)
        for what, values in (("measured", [m for _, m, _ in parts]), ("model", [p for _, _, p in parts])):
            lines.append(f"{r.source[:24]:<24} {what:<9} " + " ".join(f"{v:8.3f}" for v in values))
    lines.append("seconds a step: the median rank's (log.jsonl's timing records) against the fitted model's; "
                 "layers: the tensor-, context- and expert-parallel collectives that compute does not hide")
    return "\n".join(lines)


@dataclass(frozen=True)
class DpScaling:
    """One grid and micro-batch measured at three or more dp (everything else of the job and run
    the same: model, cluster, sequence, global batch, recompute, framework), its step times fitted
    as T(dp) = work / dp + fixed * (g - 1) / g, g = dp * cp the gradients' group, by least squares
    on the relative error: `work` the step on one replica, `fixed` the part that does not shrink as
    replicas are added (a ring collective's volume does not), `worst` the fit's largest relative
    error on a run; the same fit of the model's step times beside it (`model_work`, `model_fixed`)."""

    run: Run  # the grid's run at its largest dp
    dps: tuple[int, ...]
    work: float
    fixed: float
    worst: float
    model_work: float
    model_fixed: float

    @property
    def fixed_per_micro_batch(self) -> float:
        """`fixed` over the job's micro-batches a step (every replica's): a cost that grows with dp at
        each replica's every micro-batch looks constant here."""
        job = self.run.jobs[0]
        return self.fixed * job.micro_batch / job.global_batch


def _work_and_fixed(dps: np.ndarray, cp: int, seconds: np.ndarray) -> tuple[np.ndarray, float]:
    """(work, fixed) of T(dp) = work / dp + fixed * (g - 1) / g fitted on the relative error, and
    the largest relative error of the fit."""
    group = dps * cp
    basis = np.stack([1 / dps, (group - 1) / group], axis=1)
    coefficients = np.linalg.lstsq(basis / seconds[:, None], np.ones_like(seconds), rcond=None)[0]
    return coefficients, float(np.max(np.abs(basis @ coefficients / seconds - 1)))


def dp_scaling(runs: list[Run], cal: Calibration) -> list[DpScaling]:
    """Each grid and micro-batch of `runs` measured at three or more dp (its runs of a published job)."""
    grids: dict[tuple, list[Run]] = {}
    for r in runs:
        if len(r.jobs) == 1:
            j = r.jobs[0]  # the job but its dp (a layout of dp 1 need not be valid: ep must divide dp*cp)
            grid = (replace(j, layout=Layout()), tuple(n for d, n in j.layout.sizes.items() if d != "dp"),
                    j.layout.ep, j.layout.order)
            grids.setdefault((grid, r.cfg, r.cluster, r.framework, r.overlap_dp, r.traits), []).append(r)
    out = []
    for mine in grids.values():
        if len({r.jobs[0].layout.dp for r in mine}) < 3:
            continue
        mine = sorted(mine, key=lambda r: r.jobs[0].layout.dp)
        dps, cp = np.array([r.jobs[0].layout.dp for r in mine], dtype=float), mine[0].jobs[0].layout.cp
        (work, fixed), worst = _work_and_fixed(dps, cp, np.array([r.seconds for r in mine]))
        (model_work, model_fixed), _ = _work_and_fixed(dps, cp, np.array([predicted_seconds(r, cal) for r in mine]))
        out.append(DpScaling(mine[-1], tuple(int(d) for d in dps), float(work), float(fixed), worst,
                             float(model_work), float(model_fixed)))
    return out


def dp_scaling_table(runs: list[Run], cal: Calibration) -> str | None:
    """`dp_scaling` as a table; None where no grid was measured at three or more dp."""
    rows = dp_scaling(runs, cal)
    if not rows:
        return None
    grids = [f"pp{d.run.jobs[0].layout.pp}v{d.run.jobs[0].virtual} cp{d.run.jobs[0].layout.cp}"
             f" x{d.run.jobs[0].layout.x}y{d.run.jobs[0].layout.y}z{d.run.jobs[0].layout.z}"
             f" ep{d.run.jobs[0].layout.ep} mb{d.run.jobs[0].micro_batch}" for d in rows]
    width = max(len(g) for g in [*grids, "grid"])
    lines = [f"{'source':<14} {'grid':<{width}} {'dp':>14} {'work':>8} {'fixed':>7} {'/job mb':>8} {'worst':>6}"
             f" {'model':>8} {'fixed':>7}"]
    for d, grid in zip(rows, grids):
        lines.append(f"{d.run.source[:14]:<14} {grid:<{width}} {','.join(map(str, d.dps)):>14} {d.work:8.2f}"
                     f" {d.fixed:7.2f} {d.fixed_per_micro_batch * 1e3:5.1f} ms {d.worst:6.1%} {d.model_work:8.2f}"
                     f" {d.model_fixed:7.2f}")
    lines.append("seconds a step fitted as work / dp + fixed * (g - 1) / g, g = dp * cp (least squares on the relative "
                 "error; worst: its largest on a run): work, one replica's step; fixed, what adding replicas does not "
                 "shrink (the model's: its bubble, gradient collectives and their buffer's passes), and it over the "
                 "job's micro-batches a step")
    return "\n".join(lines)


# ----- leave one source out ----------------------------------------------------------------------------

def generation(run: Run) -> str:
    """The GPU generation a run ran on (Ampere, Hopper, Blackwell), from the preset's name."""
    name = run.cluster.gpu.name
    return "Ampere" if name.startswith("a100") else "Blackwell" if name.startswith(("b", "gb")) else "Hopper"


@dataclass(frozen=True)
class HeldOut:
    """The runs of one source (or generation), predicted by constants fitted without them."""

    name: str
    runs: int
    model: Scores  # ranked by the predicted step times
    plan: Scores  # as `fourfold plan` lists them: ties within the per-kind error band by the rule
    rule: Scores  # "least tp*cp*pp, then the largest micro-batch"
    cp_error: float | None  # mean error of the held-out runs with cp > 1 (None: none)
    baseline: float  # the error of one MFU constant fitted on the other runs


def leave_out(runs: list[Run], key) -> tuple[list[HeldOut], list[float]]:
    """Each value of `key(run)` held out in turn (a source, a GPU generation): fitted on the other
    runs, its runs predicted and ranked. The band of the plan's ties is the per-kind error
    (`kind_errors`) of the other values' held-out predictions, never of the held-out runs' own (their
    data did enter the fits that predicted the others: one fit per value, not a nested
    cross-validation, which would cost a fit per value and fold). Also returns every run's held-out
    prediction."""
    names = [key(r) for r in runs]
    predicted, chosen = _held_out(runs, names)
    out = []
    for name in sorted(set(names)):
        held = [i for i, n in enumerate(names) if n == name]
        others = [i for i, n in enumerate(names) if n != name]
        band = Calibration(cv_error=None, cv_errors=kind_errors([runs[i] for i in others],
                                                                 [predicted[i] for i in others]))
        mine, times = [runs[i] for i in held], [predicted[i] for i in held]
        cp = [abs(r.seconds / p - 1) for r, p in zip(mine, times) if r.kind == "cp"]
        baseline = mfu_baseline([runs[i] for i in others], mine)
        out.append(HeldOut(name, len(held), model_scores(mine, times),
                           plan_scores(mine, times, band, [chosen[i] for i in held]),
                           rule_scores(mine), float(np.mean(cp)) if cp else None,
                           float(np.mean([abs(r.seconds / p - 1) for r, p in zip(mine, baseline)]))))
    return out, predicted


def kind_errors(runs: list[Run], predicted: list[float]) -> tuple[tuple[str, float], ...]:
    """The error of a predicted ratio of two step times, by kind of run (`Run.kind`: cp, pp, tp, dp):
    what decides whether the model can tell two configurations of one job apart. An error shared
    by a group's runs (the cluster's, the model size's) does not change their order, so each run's
    log error is taken relative to its group's mean, over the groups of 2 or more runs; a kind
    seen in no such group takes the mean error of its runs."""
    logs = [math.log(r.seconds / p) for r, p in zip(runs, predicted)]
    by_group: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        by_group.setdefault(r.group, []).append(i)
    relative: dict[str, list[float]] = {}
    absolute: dict[str, list[float]] = {}
    for members in by_group.values():
        centre = statistics.mean(logs[i] for i in members)
        for i in members:
            absolute.setdefault(runs[i].kind, []).append(abs(math.exp(logs[i]) - 1))
            if len(members) > 1:
                relative.setdefault(runs[i].kind, []).append(abs(math.exp(logs[i] - centre) - 1))
    return tuple((k, float(np.mean(relative.get(k) or absolute[k]))) for k in sorted(absolute))


def held_out_table(rows: list[HeldOut], what: str) -> str:
    def rho(s: Scores) -> str:
        return f"{s.spearman:5.2f}" if s.groups else "    -"

    lines = [f"{what + ' held out':<38} {'runs':>4} {'groups':>6} {'error':>6} {'cp err':>6} {'MFU':>6} "
             f"{'by time':>7} {'listed':>6} {'rule':>5}"]
    for h in rows:
        cp = f"{h.cp_error:6.1%}" if h.cp_error is not None else "     -"
        lines.append(f"{h.name:<38} {h.runs:>4} {h.model.groups:>6} {h.model.error:6.1%} {cp} {h.baseline:6.1%} "
                     f"{rho(h.model):>7} {rho(h.plan):>6} {rho(h.rule):>5}")
    lines.append("error: mean |predicted / measured throughput - 1| of the held-out runs; cp err: of those with "
                 "cp > 1; MFU: the error of one MFU constant fitted on the other runs; by time, listed, rule: median "
                 "Spearman over the held-out groups of 2 or more runs, ranked by the predicted step time, as "
                 "`fourfold plan` lists them, and by the rule")
    return "\n".join(lines)


def mfu_baseline(fitted: list[Run], runs: list[Run]) -> list[float]:
    """`runs`' step seconds as one MFU constant predicts them: the geometric mean of the MFU of
    the `fitted` runs (the model's FLOPs over the peak), the same least squares on log times."""
    def peak_seconds(r: Run) -> float:  # at 100% MFU
        job = r.jobs[0]
        flops = model_flops_per_token(r.cfg, job.seq) * job.global_batch * job.seq / job.world_size
        return flops / (r.cluster.gpu.bf16_tflops * 1e12)

    mfu = math.exp(statistics.mean(math.log(peak_seconds(r) / r.seconds) for r in fitted))
    return [peak_seconds(r) / mfu for r in runs]
