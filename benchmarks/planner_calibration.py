"""Does the planner rank configurations the way measured runs do? Cross-validated on the published
Megatron-LM runs of ../shared/calibration (docs/planner.md, "Calibration").

Fits the step-time model's constants (`fourfold.plan.calibrate`) leaving out one group of runs at
a time, and prints the scores of the held-out predictions beside those of the uncalibrated
guesses and of the rule "least tp*cp*pp, then the largest micro-batch"; then the constants fitted
on every run, as `perf.Calibration`'s defaults are written.

    python benchmarks/planner_calibration.py [--data ../shared/calibration]
"""

from __future__ import annotations

import argparse
import dataclasses

from fourfold.plan.calibrate import DATA, calibrate, comparison, folds, predicted_seconds, shipped_runs
from fourfold.plan.perf import Calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA), help="the folder of the shipped calibration CSVs")
    runs = shipped_runs(parser.parse_args().data)
    cal, cross = calibrate(runs)
    print(f"{len(runs)} runs, {len({r.group for r in runs})} groups, {len(set(folds(runs)))} cross-validation folds")
    print(comparison(runs, cross))
    print("\nfitted on every run (perf.Calibration's defaults):")
    for field in dataclasses.fields(Calibration):
        value = getattr(cal, field.name)
        print(f"  {field.name} = {value:.4g}" if value is not None else f"  {field.name} = None")
    drift = max(abs(predicted_seconds(r, Calibration()) / predicted_seconds(r, cal) - 1) for r in runs)
    print(f"perf.py's defaults predict every run within {drift:.2%} of this fit (their rounding; more: stale)")


if __name__ == "__main__":
    main()
