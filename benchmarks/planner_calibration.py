"""Do the planner's step times and rankings hold on runs it was not fitted on? Cross-validated on
the published Megatron-LM runs of ../shared/calibration (docs/planner.md, "Calibration").

1. Leave one group out: fits the step-time model's constants (`fourfold.plan.calibrate`) leaving
   out one group of runs at a time, and prints the scores of the held-out predictions beside those
   of the uncalibrated guesses and of the rule "least tp*cp*pp, then the largest micro-batch".
2. Leave one cluster out: fits on the A100 runs and scores the H100 runs, and the reverse, beside
   one MFU constant fitted on the same runs.
3. The constants fitted on every run, as `perf.Calibration`'s defaults are written.

    python benchmarks/planner_calibration.py [--data ../shared/calibration]
"""

from __future__ import annotations

import argparse
import dataclasses

from fourfold.plan.calibrate import (
    DATA,
    calibrate,
    cluster_runs,
    cluster_table,
    comparison,
    cross_validate,
    fit,
    folds,
    leave_one_cluster_out,
    model_scores,
    plan_scores,
    predicted_seconds,
)
from fourfold.plan.perf import Calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA), help="the folder of the shipped calibration CSVs")
    by_cluster = cluster_runs(parser.parse_args().data)
    runs = [r for rs in by_cluster.values() for r in rs]
    cal, cross = calibrate(runs)
    print(f"{len(runs)} runs, {len({r.group for r in runs})} groups, {len(set(folds(runs)))} cross-validation folds")
    print(comparison(runs, cross))
    print("\nleave one cluster out:")
    print(cluster_table(leave_one_cluster_out(by_cluster)))
    for held_out, runs_out in by_cluster.items():  # the ranking a user sees: `fourfold plan`'s order
        if max(sum(r.group == g for r in runs_out) for g in {r.group for r in runs_out}) < 2:
            continue  # no group of 2 or more runs to rank
        others = [r for name, rs in by_cluster.items() if name != held_out for r in rs]
        cv_error = model_scores(others, cross_validate(others)).error
        fitted = fit(others)
        planned = plan_scores(runs_out, [predicted_seconds(r, fitted) for r in runs_out], cv_error)
        print(f"{held_out} held out, as `fourfold plan` orders it (ties within the other runs' cross-validated "
              f"error, {cv_error:.1%}, simplest first): Spearman {planned.spearman:.3f}, top-1 {planned.top1:.0%}")
    print("\nfitted on every run (perf.Calibration's defaults):")
    for field in dataclasses.fields(Calibration):
        value = getattr(cal, field.name)
        if field.name == "profiles":
            for p in value:
                print(f"  {p}")
        else:
            print(f"  {field.name} = {value:.4g}" if value is not None else f"  {field.name} = None")
    drift = max(abs(predicted_seconds(r, Calibration()) / predicted_seconds(r, cal) - 1) for r in runs)
    print(f"perf.py's defaults predict every run within {drift:.2%} of this fit (their rounding; more: stale)")


if __name__ == "__main__":
    main()
