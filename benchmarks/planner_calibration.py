"""Do the planner's step times and rankings hold on runs it was not fitted on? Cross-validated on
the published runs shipped with fourfold (fourfold/plan/data, docs/planner.md, "Calibration").

1. The constants fitted on every run, as `constants.Calibration`'s defaults are written.
2. Leave one source out: each published table (a file, or a document of context_parallel.csv)
   predicted by constants fitted on the others, its groups ranked by the predicted step time, as
   `fourfold plan` lists them (ties within the per-kind band of the other sources' held-out
   errors, simplest first) and by the rule "least tp*cp*pp, then the largest micro-batch", beside
   one MFU constant fitted on the other runs. The same leaving one GPU generation out.
3. Llama 3 405B's long-context run (131,072 tokens, tp8 cp16 pp16 dp8 on 16,384 H100s, 380
   TFLOP/s a GPU, arXiv 2407.21783 Table 4): a check, never fitted; and its step time over the
   8,192-token row's on the same GPUs and pipeline (400 TFLOP/s), where the unpublished
   interleaving cancels.

    python benchmarks/planner_calibration.py [--data DIR]   # default: the shipped fourfold/plan/data
    python benchmarks/planner_calibration.py --residuals megatron_llama31_8b_a100.csv  # one source held out, run by run
    python benchmarks/planner_calibration.py --dp-scaling megatron_llama31_8b_a100.csv  # a grid's cost as dp grows
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from fourfold.models.config import load_config
from fourfold.plan.calibrate import (
    dp_scaling_table,
    fit,
    generation,
    held_out_table,
    kind_errors,
    leave_out,
    model_scores,
    predicted_job,
    predicted_seconds,
    rule_scores,
)
from fourfold.plan.constants import Calibration
from fourfold.plan.frameworks import MEGATRON
from fourfold.plan.measured import DATA, NOT_PRICED, flops_per_sequence, shipped_runs
from fourfold.plan.perf import RunTraits, step_time
from fourfold.spec.hardware import make_cluster
from fourfold.spec.job import Job, megatron_stages
from fourfold.spec.layout import Layout

LLAMA3_LONG = dict(gpus=16384, seq=131072, global_batch=128, tflops=380.0)  # 16M tokens a step
LLAMA3_SHORT = dict(gpus=16384, seq=8192, global_batch=2048, tflops=400.0)  # the same GPUs and pipeline at 8k
CONVENTIONS = ("fourfold", "model")  # 6N + 6Lhs (causal pairs), 6N + 12Lhs (unmasked: PaLM's, torchtitan's)


def _llama3_seconds(cfg, cluster, cal: Calibration, row: dict, layout: Layout, virtual: int, comm: str) -> float:
    job = Job(layout, global_batch=row["global_batch"], micro_batch=1, seq=row["seq"], recompute="none",
              seq_parallel=True, precision="bf16", virtual=virtual,
              schedule="interleaved-1f1b" if virtual > 1 else "1f1b",
              stage_layers=megatron_stages(cfg.layers, 16 * virtual))
    return step_time(cfg, job, cluster, cal, MEGATRON, RunTraits(cp_comm=comm)).total


def _measured_seconds(cfg, row: dict, convention: str) -> float:
    return flops_per_sequence(convention, cfg, row["seq"]) * row["global_batch"] / row["gpus"] / (row["tflops"] * 1e12)


def llama3_long_context(cal: Calibration) -> list[str]:
    """The 405B long-context row under the megatron profile (Meta's grid is 1D tensor parallel with
    sequence parallelism), Meta's stages (7, 8 x 14, 7), both cp exchanges and schedules; beside it,
    the ratio of its step time to the 8k-token row's on the same 16,384 GPUs and pipeline (pp16, 16
    micro-batches a replica): the unpublished stages per rank and the bubble cancel in it, so it
    checks the price of 131k tokens alone. Meta's FLOP count is not published: measured seconds
    are given in both conventions."""
    cfg, cluster = load_config("llama-3.1-405b"), make_cluster("dgx-h100")
    measured = {c: (_measured_seconds(cfg, LLAMA3_LONG, c), _measured_seconds(cfg, LLAMA3_SHORT, c))
                for c in CONVENTIONS}
    lines = [f"{'stages/rank':>11} {'cp exchange':>11} {'seconds':>8} {'TFLOP/s (6N+6Lhs)':>18} {'(6N+12Lhs)':>11}"
             f" {'8k row s':>8} {'131k/8k':>7}"]
    for virtual in (1, 2, 4):
        short = _llama3_seconds(cfg, cluster, cal, LLAMA3_SHORT, Layout(dp=128, pp=16, y=8), virtual, "p2p")
        for comm in ("all_gather", "p2p"):
            seconds = _llama3_seconds(cfg, cluster, cal, LLAMA3_LONG, Layout(dp=8, pp=16, cp=16, y=8), virtual, comm)
            per_gpu = [LLAMA3_LONG["tflops"] * measured[c][0] / seconds for c in CONVENTIONS]
            lines.append(f"{virtual:>11} {comm:>11} {seconds:8.2f} {per_gpu[0]:11.0f} ({per_gpu[0] / 380 - 1:+.0%})"
                         f" {per_gpu[1]:6.0f} ({per_gpu[1] / 380 - 1:+.0%}) {short:8.2f} {seconds / short:7.2f}")
    lines.append("measured: " + "; ".join(
        f"{'6N+6Lhs' if c == 'fourfold' else '6N+12Lhs'} {long:.2f} s and {short:.2f} s (ratio {long / short:.2f})"
        for c, (long, short) in measured.items()) + " (131k row at 380 TFLOP/s, 8k row at 400)")
    return lines


def in_sample(runs, cal: Calibration) -> str:
    """The fit on every run scored on the same runs: what the model's structure can reach at best (a
    held-out score cannot beat it by much)."""
    predicted = [predicted_seconds(r, cal) for r in runs]
    lines = [f"{'fitted on every run, scored on it':<38} {'runs':>4} {'error':>6} {'by time':>7} {'rule':>5}"]
    for source in sorted({r.source for r in runs}):
        mine = [i for i, r in enumerate(runs) if r.source == source]
        model = model_scores([runs[i] for i in mine], [predicted[i] for i in mine])
        rule = rule_scores([runs[i] for i in mine])
        rho = (f"{model.spearman:7.2f}" if model.groups else f"{'-':>7}") + (
            f" {rule.spearman:5.2f}" if rule.groups else f" {'-':>5}")
        lines.append(f"{source:<38} {len(mine):>4} {model.error:6.1%} {rho}")
    lines.append(f"{'every run':<38} {len(runs):>4} {model_scores(runs, predicted).error:6.1%}")
    return "\n".join(lines)


def residuals(runs, source: str) -> None:
    """Each run of `source` predicted by a fit on the other sources, by group, fastest measured first:
    measured and predicted seconds and the model's parts (where a held-out error comes from)."""
    cal = fit([r for r in runs if r.source != source])
    held = [r for r in runs if r.source == source]
    if not held:
        raise SystemExit(f"no run of {source!r}; the sources are {', '.join(sorted({r.source for r in runs}))}")
    for group in dict.fromkeys(r.group for r in held):
        print(group)
        for r in sorted((r for r in held if r.group == group), key=lambda r: r.seconds):
            job, parts = predicted_job(r, cal)
            g, p = job.layout, parts.total
            print(f"  dp{g.dp} pp{g.pp} v{job.virtual} cp{g.cp} tp{g.x * g.y * g.z} mb{job.micro_batch}: measured "
                  f"{r.seconds:8.2f} s, predicted {p:8.2f} ({r.seconds / p - 1:+.0%}); "
                  + ", ".join(f"{k} {v:.2f}" for k, v in parts.breakdown().items() if v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA), help="the folder of the shipped calibration CSVs")
    parser.add_argument("--residuals", metavar="SOURCE", help="only: SOURCE's runs held out, one by one")
    parser.add_argument("--dp-scaling", metavar="SOURCE", help="only: how SOURCE's grids slow as dp grows")
    args = parser.parse_args()
    runs = shipped_runs(args.data)
    if args.residuals:
        return residuals(runs, args.residuals)
    if args.dp_scaling:
        return print(dp_scaling_table([r for r in runs if r.source == args.dp_scaling], Calibration()))
    print(f"{len(runs)} runs from {len({r.source for r in runs})} sources; not priced: "
          + "; ".join(f"rows of {needle} ({why})" for needle, why in NOT_PRICED))
    cal = fit(runs)
    by_source, predicted = leave_out(runs, lambda r: r.source)
    errors = [abs(r.seconds / p - 1) for r, p in zip(runs, predicted)]
    cp = [e for r, e in zip(runs, errors) if r.kind == "cp"]
    cal = dataclasses.replace(cal, cv_error=float(np.mean(errors)), cv_errors=kind_errors(runs, predicted))
    print("\n" + held_out_table(by_source, "source"))
    print(f"every run held out with its source: error {np.mean(errors):.1%} overall, {np.mean(cp):.1%} on the "
          f"{len(cp)} runs with cp > 1")
    by_generation, _ = leave_out(runs, generation)
    print("\n" + held_out_table(by_generation, "GPU generation"))
    print("\nLlama 3 405B, 131,072 tokens, tp8 cp16 pp16 dp8 on 16,384 H100s: 380 TFLOP/s measured (not fitted)")
    print("\n".join(llama3_long_context(cal)))
    print("\n" + in_sample(runs, cal))
    print("\nfitted on every run (constants.Calibration's defaults; cv_error and cv_errors: leave one source out):")
    for field in dataclasses.fields(Calibration):
        value = getattr(cal, field.name)
        if field.name == "profiles":
            for p in value:
                print(f"  {p}")
        elif field.name == "cv_errors":
            print(f"  cv_errors = {tuple((k, round(e, 4)) for k, e in value)}")
        else:
            print(f"  {field.name} = {value:.4g}" if value is not None else f"  {field.name} = None")
    drift = max(abs(predicted_seconds(r, Calibration()) / predicted_seconds(r, cal) - 1) for r in runs)
    print(f"perf.py's defaults predict every run within {drift:.2%} of this fit (their rounding; more: stale)")


if __name__ == "__main__":
    main()
