"""`fourfold memory | estimate | plan | calibrate`: argument parsing and printing (table or JSON)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from fourfold.cli.options import layer_counts
from fourfold.config import as_overrides, job_settings
from fourfold.models.config import ModelConfig, load_config
from fourfold.plan.constants import Calibration
from fourfold.plan.frameworks import CP_COMMS, FRAMEWORKS, named
from fourfold.plan.memory import GIB
from fourfold.plan.search import HEADROOM, as_json, kind, predict, rounded_seconds, search, simplest
from fourfold.spec.hardware import CLUSTERS, GPUS, Cluster, make_cluster
from fourfold.spec.job import FP8_RECIPES, PRECISIONS, RECOMPUTE, Job
from fourfold.spec.layout import DEFAULT_ORDER, DIMS, GridError, Layout
from fourfold.spec.rules import problems, with_flags

# The rules name the training config's keys; the planner's commands take these flags instead.
FLAGS = {"batch.global_batch": "--global-batch", "batch.micro_batch": "--micro-batch", "batch.seq": "--seq",
         "turn seq_parallel off": "give --no-seq-parallel"}


GLOBAL_BATCH = 1024  # sequences a step when --global-batch is not given (said in the plan's first line)


def positive(text: str) -> int:
    """An argparse type: a count of 1 or more (argparse names the flag in the error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count; give 1 or more")
    return value


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a preset name or a Hugging Face config.json (or its directory)")
    add_machine(p, "dgx-h100")
    p.add_argument("--latency-us", type=float, help="cost per collective step, microseconds (default 10; "
                                                    "benchmarks/planner_ordering.py fits it on a measured run)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-batch", type=int, help=f"sequences per optimizer step (default {GLOBAL_BATCH})")
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--recompute", choices=RECOMPUTE)
    p.add_argument("--seq-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="sequence parallelism (default on)")
    p.add_argument("--precision", choices=[p for p in PRECISIONS if p != "auto"], default="bf16",
                   help="parameters and activations (default bf16)")
    p.add_argument("--fp8", choices=[r for r in FP8_RECIPES if r], default="",
                   help="the linears' GEMMs in FP8 with torchao's recipe (GPUs with FP8 tensor cores; default bf16)")
    p.add_argument("--framework", choices=list(FRAMEWORKS), default="fourfold")
    p.add_argument("--cp-comm", choices=CP_COMMS,
                   help="megatron profile: context parallelism's exchange, Megatron-Core's cp_comm_type (default p2p)")
    p.add_argument("--no-80-rule", action="store_true", help="megatron profile: compare with the whole card")
    p.add_argument("--calibrate", help="JSON of the step-time model's constants (`fourfold calibrate` writes one)")
    p.add_argument("--json", action="store_true")


def add_machine(p: argparse.ArgumentParser, cluster: str | None) -> None:
    p.add_argument("--cluster", choices=sorted(CLUSTERS), default=cluster,
                   help=f"cluster preset (default: {cluster or 'what each run records'})")
    p.add_argument("--gpu", choices=sorted(GPUS), help="GPU preset (default: the cluster's)")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--intra-node-gbs", type=float, help="intra-node bandwidth per GPU, GB/s")
    p.add_argument("--inter-node-gbs", type=float, help="inter-node bandwidth per GPU, GB/s")


def add_config(p: argparse.ArgumentParser) -> None:
    for dim in DIMS:
        p.add_argument(f"--{dim}", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallelism: a mixture's experts split over ep of the "
                                                     "dp*cp ranks (no ranks added; the config's grid.ep)")
    p.add_argument("--virtual", type=int, default=1, help="pipeline stages per pp rank (interleaved 1F1B when > 1)")
    p.add_argument("--tp", type=int, help="Megatron's 1D tensor parallelism: y=TP (x = z = 1)")
    p.add_argument("--order", default=None, help="placement order, innermost first")
    p.add_argument("--keep-gathered-inputs", action="store_true",
                   help="linears keep their gathered input for backward (a plan row's `keep` column)")
    p.add_argument("--stage-layers", type=layer_counts, default=(),
                   help="layers per pipeline stage (pp * virtual of them), e.g. 7,8,8,...,7 (default even)")


def _job(args, layout: Layout = Layout(), virtual: int = 1) -> Job:
    return Job(layout, global_batch=args.global_batch, micro_batch=args.micro_batch or 1, seq=args.seq,
               recompute=args.recompute or "none", seq_parallel=args.seq_parallel, precision=args.precision,
               virtual=virtual, schedule="interleaved-1f1b" if virtual > 1 else "1f1b",
               keep_gathered_inputs=getattr(args, "keep_gathered_inputs", False),
               stage_layers=getattr(args, "stage_layers", ()), fp8=args.fp8)


def _context(args):
    cluster = make_cluster(args.cluster, args.gpu, args.gpus_per_node, args.intra_node_gbs, args.inter_node_gbs,
                           args.latency_us)
    if args.calibrate and not Path(args.calibrate).is_file():
        raise ValueError(f"--calibrate {args.calibrate}: no such file; give the cal.json `fourfold calibrate ... -o` "
                         f"wrote")
    cal = Calibration.load(args.calibrate) if args.calibrate else Calibration()
    if args.latency_us is not None:  # the flag wins over a calibrated latency
        cal = dataclasses.replace(cal, latency_us=None)
    cfg = load_config(args.model)
    if getattr(args, "layers", None):
        cfg = cfg.with_layers(args.layers)
    return cfg, cluster, cal


def inputs_line(args, cfg: ModelConfig, cluster) -> str:
    """What the plan is for, the defaults it took named: the model, the machine, a step's batch."""
    n = cfg.parameter_count()
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    default = " (the default: --global-batch)" if args.global_batch_defaulted else ""
    tokens = args.global_batch * args.seq
    return (f"{cfg.family} {size} on {args.gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} a node), "
            f"{args.framework} profile; a step: {args.global_batch:,} sequences{default} x {args.seq:,} tokens = "
            f"{tokens / 1e6:.1f}M tokens, {args.precision}")


@contextlib.contextmanager
def _progress_bar():
    """A progress callback for the search: a bar on a terminal's stderr, nothing elsewhere."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc="searching", unit=" candidates", file=sys.stderr, leave=False) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            if done - bar.n >= 64 or done == total:
                bar.update(done - bar.n)

        yield progress


def _one(args) -> tuple[ModelConfig, Job, dict, Calibration, Cluster]:
    cfg, cluster, cal = _context(args)
    sizes = {d: getattr(args, d) for d in DIMS}
    if args.tp:
        given = [f"--{d} {sizes[d]}" for d in ("x", "y", "z") if sizes[d] != 1]
        if given:  # --tp sets x, y and z: a --x it overrode would be silently ignored
            raise ValueError(f"--tp {args.tp} is Megatron's 1D tensor parallelism (y={args.tp}, x = z = 1) and cannot "
                             f"go with {' '.join(given)}: give either --tp or --x/--y/--z")
        sizes.update(x=1, y=args.tp, z=1)
    order = tuple(d.strip() for d in args.order.split(",")) if args.order else DEFAULT_ORDER
    job = _job(args, Layout(**sizes, order=order, ep=args.ep), args.virtual)
    return (cfg, job, predict(cfg, job, cluster, cal, not args.no_80_rule, named(args.framework, args.cp_comm)), cal,
            cluster)


# The run commands' data: a placeholder the user replaces (no data flags would train on the bundled corpus)
DATA = "YOUR-CORPUS"
DATA_NOTE = (f"{DATA}: your text, JSONL, Parquet or Arrow files, or globs (README, Training); with no --data.* "
             f"flag fourfold trains on the bundled King James Bible")


def reproduce(args: argparse.Namespace, job: Job, gpus_per_node: int) -> dict[str, str]:
    """The commands that give `job` again: `fourfold estimate` (the same prediction), the `fourfold
    train` overrides that run it (what `train --grid.auto` hands its ranks) on `DATA`, and for more
    GPUs than a node, the `fourfold slurm` line that writes its sbatch script."""
    machine = {"--cluster": args.cluster, "--gpu": args.gpu, "--gpus-per-node": args.gpus_per_node,
               "--intra-node-gbs": args.intra_node_gbs, "--inter-node-gbs": args.inter_node_gbs,
               "--latency-us": args.latency_us, "--calibrate": args.calibrate}
    estimate = ["fourfold", "estimate", "--model", args.model, *(v for flag, value in machine.items()
                                                                 if value is not None for v in (flag, str(value)))]
    estimate += ["--seq", job.seq, "--global-batch", job.global_batch, "--micro-batch", job.micro_batch,
                 "--recompute", job.recompute, "--seq-parallel" if job.seq_parallel else "--no-seq-parallel",
                 "--precision", job.precision, "--framework", args.framework, *(["--no-80-rule"] * args.no_80_rule),
                 *(["--cp-comm", args.cp_comm] * bool(args.cp_comm)),
                 *(v for d in (*DIMS, "ep") for v in (f"--{d}", getattr(job.layout, d))), "--virtual", job.virtual,
                 "--order", ",".join(job.layout.order), *(["--keep-gathered-inputs"] * job.keep_gathered_inputs),
                 *(["--stage-layers", ",".join(map(str, job.stage_layers))] * bool(job.stage_layers)),
                 *(["--fp8", job.fp8] * bool(job.fp8))]
    model = "--model.hf" if Path(args.model).is_dir() else "--model.preset"
    hardware = [v for key, value in (("gpu", args.gpu), ("cluster", args.cluster)) if value
                for v in (f"--hardware.{key}", value)]
    overrides = [model, args.model, "--data.files", DATA, "--batch.seq", job.seq, "--batch.global_batch",
                 job.global_batch, "--train.precision", job.precision, *as_overrides(job_settings(job)), *hardware]
    out = {"estimate": shlex.join(map(str, estimate)), "train": shlex.join(map(str, ["fourfold", "train", *overrides]))}
    nodes = -(-job.world_size // gpus_per_node)
    if nodes > 1 and job.world_size % nodes == 0:  # (12 GPUs of 8-GPU nodes: 2 nodes of 6)
        slurm = ["fourfold", "slurm", "--nodes", nodes, "--gpus-per-node", job.world_size // nodes, "--output",
                 "job.sbatch", *overrides]
        out["slurm"] = shlex.join(map(str, slurm))
    return out


def _measure(cfg: ModelConfig, job: Job, r: dict) -> None:
    """Add fourfold's measured peak (FakeTensorMode, fourfold.tools.measure) to the result `r`."""
    from fourfold.tools.measure import GPU_ONLY_TERMS, measure_peak

    m = measure_peak(cfg, job)
    r["measured_gib"] = m.peak_bytes / GIB
    r["measured_phase_peaks_gib"] = {phase: b / GIB for phase, b in m.phase_peaks.items()}
    r["measured_at_peak"] = [{"gib": b / GIB, "tensor": what} for b, what in m.at_peak]
    r["estimate_without_gpu_only_gib"] = sum(v for k, v in r["memory_breakdown_gib"].items() if k not in GPU_ONLY_TERMS)


def _print_measured(r: dict) -> None:
    est, measured = r["estimate_without_gpu_only_gib"], r["measured_gib"]
    print(f"measured (FakeTensorMode, rank 0, two steps): {measured:.2f} GiB; the estimate without the GPU-only "
          f"terms: {est:.2f} GiB ({100 * (est / measured - 1):+.1f}%)")
    print("peak by phase (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in r["measured_phase_peaks_gib"].items()))
    print("largest tensors alive at the peak:")
    for t in r["measured_at_peak"]:
        print(f"  {t['gib']:8.3f} GiB  {t['tensor']}")


def grid_text(r: dict) -> str:
    """A result's grid as the table shows it (ep only when a mixture's experts are split, v only
    when the pipeline is interleaved)."""
    ep = f" ep{r['ep']}" if r.get("ep", 1) > 1 else ""
    v = f" v{r['virtual']}" if r.get("virtual", 1) > 1 else ""
    return f"dp{r['dp']} pp{r['pp']}{v} cp{r['cp']} x{r['x']} y{r['y']} z{r['z']}{ep}"


def row(r: dict, tie: bool = False) -> str:
    grid = grid_text(r)
    kept = "yes" if r["keep_gathered_inputs"] else "no"
    fits = ("yes*" if r["tight"] else "yes") if r["fits"] else "NO "
    memory = (f"{grid:<32} mb{r['micro_batch']:<2} {r['recompute']:<9} {kept:<4} "
              f"{r['memory_gib']:8.1f}/{r['memory_limit_gib']:<6.1f} {fits:<4}")
    if "step_seconds" not in r:  # `fourfold memory`
        return f"{memory}  {r['order']}"
    timed = (f"{memory} {TIE if tie else ' '}{r['step_seconds']:8.3f} {r['tokens_per_second']:12.0f}"
             f" {r['model_tflops_per_gpu']:7.1f} {100 * r['mfu']:5.1f}%  {r['order']}")
    if "tier" not in r:  # `estimate`: one job, nothing ranked
        return timed
    return f"{timed:<{len(HEADER) - 4}} {'-' if r['tier'] is None else r['tier']}"


MEMORY_HEADER = f"{'grid':<32} {'mb':<3} {'recompute':<9} {'keep':<4} {'GiB/limit':>15} {'fits':<4}"
TIMED_HEADER = f"{MEMORY_HEADER} {'step s':>9} {'tokens/s':>12} {'TFLOP/s':>7} {'MFU':>6}  order"
HEADER = f"{TIMED_HEADER:<{len(TIMED_HEADER) + 10}} tier"  # (`plan`'s table: the order and its tier)


TIGHT_NOTE = (f"* fits with less than {HEADROOM:.0%} of the GPU's memory free: the estimate's error or allocator "
              f"fragmentation can push it over (the plan ranks these after candidates with headroom)")
TIE = "~"


def error_note(cal: Calibration) -> str:
    if cal.cv_error is None:
        return ("step times: the model's error is unknown with these constants (no cross-validation: "
                "`fourfold calibrate` measures it)")
    kinds = "; " + ", ".join(f"{k} {e:.1%}" for k, e in cal.cv_errors) if cal.cv_errors else ""
    return (f"step times +-{cal.cv_error:.1%} (the model's cross-validated error{kinds}); {TIE}: within it of the "
            f"fastest; tier: rows it cannot tell apart, simplest first unless another beats one on time and memory")


def why_first(found: list[dict], cal: Calibration) -> str:
    """The reason the first row leads, in a few words: the fastest; or as fast as the model can tell and
    simpler in the first way the listing orders by; or faster and smaller than such a simpler row."""
    first = found[0]
    if not first["fits"]:
        return "first row: nothing fits; the rows are listed by step time"
    if first["tight"]:
        return f"first row: the fastest that fits (none leaves {HEADROOM:.0%} of the memory free)"
    rows = [r for r in found if r["fits"] and not r["tight"]]
    fastest = min(rows, key=lambda r: r["step_seconds"])
    if rounded_seconds(fastest["step_seconds"]) >= rounded_seconds(first["step_seconds"]):
        return f"first row: the fastest that leaves {HEADROOM:.0%} of the memory free"
    slower = (f"{first['step_seconds'] / fastest['step_seconds'] - 1:.1%} slower than the fastest "
              f"({_row(found, fastest)}, {fastest['step_seconds']:.3f} s), within the model's "
              f"+-{max(cal.error_band(kind(first)), cal.error_band(kind(fastest))):.1%}")
    simpler_row = min((r for r in rows if r["tier"] == first["tier"]), key=simplest)
    if simplest(simpler_row) < simplest(first):  # it leads because it beats a simpler row on both counts
        return (f"first row: {slower}; above {_row(found, simpler_row)}, which is simpler "
                f"({_simpler(simpler_row, first)}), as it beats it on both time and memory: time them before choosing")
    return f"first row: {slower}; first for {_simpler(first, fastest)}, which measured runs favour: time both"


def _row(found: list[dict], r: dict) -> str:
    """A row by its place in the listing, and its grid where the table may not show it."""
    at = found.index(r) + 1
    return f"row {at}" if at <= 10 else f"row {at}: {grid_text(r)} mb{r['micro_batch']}"


def _simpler(a: dict, b: dict) -> str:
    """How `a` is simpler than `b`, in the first way the listing orders by (`simplest`)."""
    ways = ("tp*cp*pp", "ep", "virtual stages", "micro-batch")
    words = ("less model parallelism", "less expert parallelism", "fewer virtual stages", "a larger micro-batch")
    for name, word, mine, theirs in zip(ways, words, simplest(a), simplest(b)):
        if mine != theirs:
            return f"{word}: {name} {abs(mine)} against {abs(theirs)}"
    return "as simple"


def passed_over(found: list[dict]) -> str:
    """How the first row was chosen, and the faster candidate a tight fit, if any, that it passed over."""
    rule = (f"ranked: rows leaving {HEADROOM:.0%} of the memory free, in tiers (none above a row that beats it on "
            f"time and memory), then tight fits (yes*) by time, then what does not fit")
    first = found[0]
    faster = [r for r in found if r["fits"] and r["tight"] and r["step_seconds"] < first["step_seconds"]]
    if first["tight"] or not faster:
        return rule
    r = faster[0]
    return (f"{rule}; passed over: {grid_text(r)} "
            f"mb{r['micro_batch']} {r['recompute']}, {r['step_seconds']:.3f} s but {r['memory_gib']:.1f} of "
            f"{r['memory_limit_gib']:.1f} GiB (the estimate's error or fragmentation can push it over)")


def _print_one(r: dict, memory_only: bool) -> None:
    print(f"{MEMORY_HEADER}  order" if memory_only else TIMED_HEADER)
    print(row(r))
    if r["tight"]:
        print(TIGHT_NOTE)
    print("memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in r["memory_breakdown_gib"].items()))
    print(f"checkpoints: a save or load adds nothing on the GPU (it reads and writes the rank's own tensors); "
          f"an async save stages {r['async_checkpoint_host_gib']:.2f} GiB in host memory")
    if not memory_only:
        print("time (s):     " + ", ".join(f"{k} {v:.3f}" for k, v in r["time_breakdown_seconds"].items()))


def run(args: argparse.Namespace) -> int:
    if args.command != "calibrate":
        args.global_batch_defaulted = args.global_batch is None
        args.global_batch = GLOBAL_BATCH if args.global_batch is None else args.global_batch
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command in ("memory", "estimate"):
            cfg, job, r, cal, cluster = _one(args)
            r = as_json(r) | {"commands": reproduce(args, job, cluster.gpus_per_node)}
            if args.command == "memory":
                timing = ("step_seconds", "tokens_per_second", "model_tflops_per_gpu", "mfu", "time_breakdown_seconds")
                r = {k: v for k, v in r.items() if k not in timing}
                if args.measure:
                    _measure(cfg, job, r)
            if args.json:
                print(json.dumps(r, indent=1))
            else:
                _print_one(r, args.command == "memory")
                if "measured_gib" in r:
                    _print_measured(r)
                if args.command == "estimate" and cal.cv_error is not None:
                    print(f"step time: +-{cal.cv_error:.1%} (the model's cross-validated error)")
                elif args.command == "estimate":
                    print(error_note(cal))
            return 0 if r["fits"] else NO_FIT
        if args.plot and not Path(args.plot).expanduser().resolve().parent.is_dir():  # before the search, not after
            raise ValueError(f"--plot {args.plot}: the folder {Path(args.plot).parent} does not exist; create it or "
                             f"give a path in an existing folder")
        cfg, cluster, cal = _context(args)
        if not args.json:
            print(inputs_line(args, cfg, cluster), flush=True)
        start = time.perf_counter()
        mbs = (args.micro_batch,) if args.micro_batch else (1, 2, 4, 8)
        recomputes = (args.recompute,) if args.recompute else RECOMPUTE
        # A table, or a JSON of the first --top, needs only the best (the search stops early);
        # a plot and --all need every candidate.
        top = None if args.plot or args.all else args.top if args.json else args.top or 10
        with _progress_bar() as progress:
            found = search(cfg, args.gpus, cluster, _job(args), micro_batches=mbs, recomputes=recomputes, cal=cal,
                           rule80=not args.no_80_rule, include_unfit=args.all,
                           framework=named(args.framework, args.cp_comm), top=top,
                           virtuals=tuple(dict.fromkeys(args.virtual)) if args.virtual else None, progress=progress)
        if not found.considered:  # not a question of memory: say what the rules refuse, with its fix
            simplest = problems(cfg, _job(args, Layout(dp=args.gpus)), gpu=True)
            raise ValueError("\n  ".join([f"the rules refuse every configuration of {args.gpus} GPUs; "
                                          f"with dp={args.gpus}:", *map(str, simplest)]))
        if args.json:
            shown = found[: args.top] if args.top else found
            rows = [as_json(r) | {"commands": reproduce(args, r["job"], cluster.gpus_per_node)} for r in shown]
            print(json.dumps({"cv_error": cal.cv_error, "candidates": rows}))
        else:
            print(f"{found.considered} candidates in {time.perf_counter() - start:.1f} s")
            per_node = cluster.gpus_per_node
            if args.gpus > per_node and args.gpus % per_node:
                print(f"note: {args.gpus} GPUs are not whole nodes of {per_node}: a grid's groups then straddle nodes "
                      f"unevenly; {args.gpus // per_node * per_node} or {(args.gpus // per_node + 1) * per_node} "
                      f"GPUs plan whole nodes")
            print(HEADER)
            shown = found[: args.top or 10]
            for r in shown:
                print(row(r, r["tie"]))
            if any(r["tight"] for r in shown):
                print(TIGHT_NOTE)
            if not found:
                print("nothing fits: add GPUs, enable recompute, or lower the micro-batch")
            else:
                print(error_note(cal))
                print(why_first(found, cal))
                print(passed_over(found))
                commands = reproduce(args, found[0]["job"], cluster.gpus_per_node)
                print(f"the first row again: {commands['estimate']}")
                if "slurm" in commands:
                    print(f"run it on {-(-args.gpus // cluster.gpus_per_node)} nodes: {commands['slurm']}, then "
                          f"sbatch job.sbatch")  # (the nodes: as `reproduce` counts them)
                else:
                    print(f"run it:              {commands['train']}")
                print(DATA_NOTE)
        if args.plot:
            from fourfold.plan.plots import plot_candidates

            plot_candidates(found, args.plot, f"{args.model} on {args.gpus} GPUs")
        return 0
    except BrokenPipeError:
        raise  # the reader stopped reading (`| head`): `main` ends quietly
    except (ValueError, GridError, OSError) as err:
        message = err if args.command == "calibrate" else with_flags(str(err), FLAGS)
        print(f"fourfold: error: {message}", file=sys.stderr)
        return 2


# `memory`/`estimate`'s exit status when the configuration does not fit (2: the input is wrong)
NO_FIT = 3


def _calibrate(args) -> int:
    """`fourfold calibrate`: fit the constants to the runs given, cross-validate, write the JSON."""
    from fourfold.plan.calibrate import calibrate, comparison, dp_scaling_table, knobs, split_parts, split_table
    from fourfold.plan.measured import read_csv, read_run_dir, shipped_runs

    machine = (args.cluster, args.gpu, args.gpus_per_node, args.intra_node_gbs, args.inter_node_gbs)
    cluster = make_cluster(*machine) if any(v is not None for v in machine) else None
    runs = [read_run_dir(d, cluster) for d in args.runs] + [r for f in args.csv for r in read_csv(f, cluster)]
    if args.shipped:
        runs += shipped_runs()
    if not runs:
        raise ValueError("no runs: give `fourfold train` run directories, --csv files and/or --shipped")
    software = args.refit == "all"
    cal, cross = calibrate(runs, software)
    n_groups = len({r.group for r in runs})
    fit = {"runs": len(runs), "groups": n_groups, "sources": sorted({r.source for r in runs}), "refit": args.refit,
           "cross_validated": dataclasses.asdict(cross)}
    with open(args.output, "w") as f:
        json.dump(dict(dataclasses.asdict(cal), fit=fit), f, indent=1)
    print(f"{len(runs)} runs in {n_groups} groups (one model, cluster, GPU count, sequence and batch each)")
    shown = [f"{k} {v:.4g}" for k, v in dataclasses.asdict(cal).items()
             if k not in ("cv_error", "cv_errors", "profiles") and v is not None]
    print(("constants: " if software else "constants (the shipped fit's, kept): ") + ", ".join(shown))
    for p in cal.profiles:  # a fit changes only the profiles of the clusters its runs ran on
        print(f"profile of {p.cluster}: " + ", ".join(f"{k} {v:.4g}" for k, v in dataclasses.asdict(p).items()
                                                      if k != "cluster"))
    print(comparison(runs, cross))
    for table in (split_table(runs, cal), dp_scaling_table(runs, cal)):
        if table:
            print(table)
    fitted = len(knobs(runs, software))
    parts = sum(len(split_parts(r, cal)) for r in runs)  # a recorded split is one measurement a part
    if len(runs) + parts <= fitted:
        print(f"{len(runs)} runs ({parts} recorded parts of steps) for {fitted} constants: the fit is "
              f"underdetermined; add runs (other grids, micro-batches, GPU counts), timed by `fourfold train`")
    print(f"wrote {args.output}: use it with plan/estimate --calibrate {args.output}")
    return 0


def add_commands(commands) -> None:
    memory = commands.add_parser("memory", help="memory per GPU of one configuration")
    add_common(memory)
    add_config(memory)
    memory.add_argument("--measure", action="store_true",
                        help="also run two training steps of rank 0 under FakeTensorMode and report the measured peak "
                             "(needs no GPU; the whole model unless --layers)")
    memory.add_argument("--layers", type=int, help="override the model's layer count (estimate and measurement)")
    estimate = commands.add_parser("estimate", help="memory and speed of one configuration")
    add_common(estimate)
    add_config(estimate)
    plan = commands.add_parser("plan", help="search every configuration of a GPU count, best first")
    add_common(plan)
    plan.add_argument("--gpus", type=positive, required=True)
    plan.add_argument("--all", action="store_true", help="also list candidates that do not fit")
    plan.add_argument("--top", type=int, default=0, help="how many to print (table default 10, JSON default all)")
    plan.add_argument("--plot", help="write a PNG: throughput against memory, and the top time breakdowns")
    plan.add_argument("--virtual", type=positive, action="append",
                      help="stages per pipeline rank to try (repeatable; default: 1, 2 and 4 for fourfold, Megatron's "
                           "even ones for megatron; --virtual 1: no interleaving)")
    calibrate = commands.add_parser("calibrate", help="fit the step-time model's constants to measured runs",
                                    description="Fit the step-time model's constants to measured runs (`fourfold "
                                                "train` run directories and CSV files in the calibration format, "
                                                "docs/planner.md), report their leave-one-group-out error, and "
                                                "write them for plan/estimate --calibrate.")
    calibrate.add_argument("runs", nargs="*", metavar="RUN_DIR", help="`fourfold train` run directories")
    calibrate.add_argument("--csv", action="append", default=[], help="a CSV in the calibration format (repeatable)")
    calibrate.add_argument("--shipped", action="store_true",
                           help="also the published runs shipped with fourfold (docs/planner.md, Calibration)")
    calibrate.add_argument("-o", "--output", required=True, help="the JSON file to write")
    calibrate.add_argument("--refit", choices=("profile", "all"), default="profile",
                           help="profile (default): only the hardware profile of the runs' clusters, the software "
                                "constants kept from the shipped fit on the published runs; all: every constant, "
                                "from the runs given alone (needs many runs that differ)")
    add_machine(calibrate, None)  # the machine the runs ran on (default: each run's own record)
