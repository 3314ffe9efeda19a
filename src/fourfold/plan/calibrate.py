"""Fit the step-time model's constants (`perf.Calibration`) to measured runs, and cross-validate them.

A measured run is a `Run`: a model, the job that ran, the cluster and the measured seconds per
step, read from a CSV in the calibration format (docs/planner.md, "Calibration") or from a
`fourfold train` run directory. Each run is predicted by the planner's own model: `perf.step_time`,
whose total `search.predict` reports as `step_seconds`. The constants are fitted by least squares
on the log of the step time (Levenberg-Marquardt; numpy only) and judged by leave-one-group-out
cross-validation, a group being the runs a user chooses among: one model on one cluster and GPU
count, at one sequence length and global batch.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from fourfold.config import TrainConfig
from fourfold.models.config import ModelConfig, load_config
from fourfold.plan.perf import UNCALIBRATED, Calibration, Profile, RunTraits, model_flops_per_token, step_time
from fourfold.plan.search import check, interleavings, predict, profile_problems, rank
from fourfold.spec.counts import layer_params
from fourfold.spec.hardware import GPUS, Cluster, make_cluster, overridden
from fourfold.spec.job import RECOMPUTE, Job, megatron_stages
from fourfold.spec.layout import Layout

# The published calibration data (outside the repository: ../shared/calibration from its root).
DATA = Path(__file__).resolve().parents[3].parent / "shared" / "calibration"
# What the shipped files leave to their README.md, the same for every row of the file (`read_csv`
# fills it in for a file of that name). The Llama runs' nodes have 4 x 200 Gb/s InfiniBand for 8
# GPUs (12.5 GB/s per GPU); the GPT runs' have 8 x 200 Gb/s, the dgx-a100 preset's 25 GB/s.
# Megatron-LM 2021 predates sequence parallelism.
SHIPPED = {
    "megatron_llama31_8b_a100.csv": dict(model="llama-3.1-8b", global_batch="1024", recompute="none",
                                         flops_convention="megatron", cluster="dgx-a100", inter_node_gbs="12.5"),
    "megatron_gpt_a100_scaling.csv": dict(family="gpt2", tied="true", seq_parallel="false", cluster="dgx-a100",
                                          overlap_dp="false", flash_attention="false"),
    # Megatron-Core r0.8.0's H100 table: gradient reduce and parameter gather overlapped, selective
    # recompute, interleaved pipelines whose stages per rank are not published ("?")
    "megatron_core_gpt_h100.csv": dict(family="gpt2", tied="true", recompute="selective", cluster="dgx-h100",
                                       overlap_dp="true", virtual="?"),
    # NeMo's and Megatron-Bridge's tables (Megatron-Core with Transformer Engine): the architecture in
    # columns, FP8 linears where the notes say so, NeMo's FLOP count (Megatron's formula), gradient
    # reduce and parameter gather overlapped (the recipes' defaults); torchtitan's rows are read apart
    "context_parallel.csv": dict(family="llama", recompute="none", overlap_dp="true"),
}
# The published GPU names of context_parallel.csv and the cluster presets they ran on. The NVL72
# rows give 4 GPUs a node (a compute tray); their NVLink domain, the bandwidth model's node, is 72.
GPU_CLUSTERS = {"h100": "dgx-h100", "b200": "dgx-b200", "gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}
NVLINK_DOMAINS = ("gb200-nvl72", "gb300-nvl72")
# The FLOP counts of NeMo's and Megatron-Bridge's tables, read off the rows that give both TFLOP/s and
# tokens/s (their ratio is the count per token): NeMo's is Megatron's formula, attention unmasked (12 s/h
# a token, layer and h^2: 57.9 GFLOP a token for Llama 3 8B at 8,192, 481 for 70B); Megatron-Bridge's
# halves causal attention's pairs (2,524 GFLOP for 405B, not 2,625)
FLOP_CONVENTIONS = {"nemo model flops": "megatron", "megatron-bridge model flops": "megatron-causal"}
MICRO_BATCHES = (1, 2, 4, 8)  # tried when a source does not say which one ran
TOP1_MARGIN = 0.05  # a favourite within 5% of the measured best counts as right


@dataclass(frozen=True)
class Run:
    """One measured run, as the planner sees it."""

    cfg: ModelConfig
    jobs: tuple[Job, ...]  # the job that ran; without its micro-batch, each that fits (or the smallest)
    cluster: Cluster
    framework: str
    seconds: float  # measured, per optimizer step
    group: str  # the runs a user chooses among: one model, cluster, GPU count, sequence and batch
    source: str  # the file or run directory it was read from
    overlap_dp: bool | None = None  # Megatron's overlap_grad_reduce and overlap_param_gather (None: not published)
    traits: RunTraits = RunTraits()  # flash attention or not, FP8 linears, the cp exchange

    @property
    def model_parallel(self) -> int:
        """tp*cp*pp of the job (of an unpublished grid's alternatives: the least, as the rule picks)."""
        return min(j.layout.pp * j.layout.cp * j.layout.x * j.layout.y * j.layout.z for j in self.jobs)

    @property
    def kind(self) -> str:
        """What parallelism beyond data parallelism the run uses, the most costly first: cp, pp, tp or dp."""
        return job_kind(self.jobs[0])

    @property
    def micro_batch(self) -> int | None:
        return self.jobs[0].micro_batch if len(self.jobs) == 1 else None

    def __str__(self) -> str:
        g = self.jobs[0].layout
        mb = f"mb{self.micro_batch}" if self.micro_batch else "mb?"
        return f"{self.group}: dp{g.dp} pp{g.pp} cp{g.cp} x{g.x} y{g.y} z{g.z} {mb}"


def job_kind(job: Job) -> str:
    g = job.layout
    return "cp" if g.cp > 1 else "pp" if g.pp > 1 else "tp" if g.x * g.y * g.z > 1 else "dp"


def predicted_seconds(run: Run, cal: Calibration) -> float:
    """The model's step time for `run` (the fastest of its possible micro-batches and stages); a run
    that says whether it overlapped the data-parallel collectives sets the overlaps."""
    if run.overlap_dp is not None:
        overlap = float(run.overlap_dp)
        cal = replace(cal, dp_overlap=overlap, param_gather_overlap=overlap)
    return min(step_time(run.cfg, job, run.cluster, cal, run.framework, run.traits).total for job in run.jobs)


def make_run(cfg: ModelConfig, job: Job, cluster: Cluster, framework: str, seconds: float, source: str,
             micro_batch_known: bool = True, virtual_known: bool = True, overlap_dp: bool | None = None,
             traits: RunTraits = RunTraits()) -> Run:
    """A `Run`, its job checked by the planner's rules (a `JobError` names each fix). Without the
    micro-batch, every one of MICRO_BATCHES that the rules accept and that fits in memory; without
    the interleaved stages per rank (pp > 1), each of `interleavings` the rules (`profile_problems`)
    accept, or the plain schedule where they accept none."""
    micro_batches = (job.micro_batch,) if micro_batch_known else MICRO_BATCHES
    jobs = [replace(job, micro_batch=mb) for mb in micro_batches]
    valid = [j for j in jobs if not profile_problems(cfg, j, framework)]
    if not virtual_known and job.layout.pp > 1:
        interleaved = [replace(j, virtual=v, schedule="interleaved-1f1b") for j in jobs
                       for v in interleavings(cfg.layers, job.layout.pp)]
        # the plain schedule only where no interleaving is valid
        valid = [j for j in interleaved if not profile_problems(cfg, j, framework)] or valid
    if micro_batch_known:
        jobs = valid or jobs
    else:
        # the run ran: when the memory model refuses every micro-batch (its rule is cautious), the smallest
        jobs = [j for j in valid if predict(cfg, j, cluster, framework=framework)["fits"]] or valid[:1]
        if not jobs:
            raise ValueError(f"no micro-batch of {MICRO_BATCHES} is valid for {job.layout} and global batch "
                             f"{job.global_batch}; give the run's micro_batch")
    for j in jobs:
        check(cfg, j, framework)
    n = cfg.parameter_count()
    group = (f"{cfg.family} {n / 1e9:.1f}B, {job.world_size} x {cluster.gpu.name} ({cluster.gpus_per_node}/node, "
             f"{cluster.inter_node_gbs:g} GB/s), seq {job.seq}, batch {job.global_batch}")
    return Run(cfg, tuple(jobs), cluster, framework, seconds, group, source, overlap_dp, traits)


# ----- CSV files in the calibration format ---------------------------------------------------------

def flops_per_sequence(convention: str, cfg: ModelConfig, seq: int) -> float:
    """Model FLOPs of one sequence (forward and backward) as a measured TFLOP/s figure counts them."""
    h, layers, vocab = cfg.hidden, cfg.layers, cfg.vocab
    if convention == "megatron96":  # Narayanan et al. 2021: includes the recompute forward
        return 96 * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    if convention == "megatron":  # Megatron-LM's num_floating_point_operations (v0.8): attention unmasked
        gated = 1.5 if cfg.block.gated else 1.0
        query = cfg.heads * cfg.block.head_dim / h
        return 12 * seq * layers * h * h * ((1 + cfg.kv_heads / cfg.heads + seq / h) * query
                                            + cfg.ffn / h * gated + vocab / (2 * layers * h))
    if convention == "megatron-causal":  # the same with causal attention's pairs halved (NeMo's flops_formulas
        # with causal_self_attn, Megatron-Bridge's)
        pairs = 6 * seq * layers * seq * cfg.heads * cfg.block.head_dim
        return flops_per_sequence("megatron", cfg, seq) - pairs
    if convention == "model":  # Megatron-Core's tables: 6 x dense parameters (the head's included) per token,
        # and attention's 12 L h s, causal not halved
        matrices, _ = layer_params(cfg)
        return 6 * seq * (matrices * layers + h * vocab) + 12 * layers * h * seq * seq
    if convention == "fourfold":  # `fourfold train`'s tflops_per_gpu: 6N + 6 L h s per token
        return model_flops_per_token(cfg, seq) * seq
    raise ValueError(f"flops_convention {convention!r} is unknown; use megatron96, megatron, model or fourfold")


def _need(values: dict, key: str, kind=int):
    if key not in values:
        raise ValueError(f"the column {key!r} is missing or empty (docs/planner.md, Calibration, lists the columns)")
    try:
        return kind(values[key])
    except ValueError:
        raise ValueError(f"{key}={values[key]!r} is not a {kind.__name__}") from None


def _flag(values: dict, key: str, default: bool) -> bool:
    return values[key].lower() in ("true", "1", "yes") if key in values else default


def _model(values: dict, framework: str, pp: int) -> ModelConfig:
    if "model" in values and "layers" not in values:  # a preset or a config.json; else the columns say it
        cfg = load_config(values["model"])
    elif "family" not in values:
        raise ValueError("no model: give a `model` column (a preset or a config.json), or the columns family, "
                         "layers, hidden, heads, kv_heads, ffn and vocab")
    else:
        seq = _need(values, "seq")
        cfg = ModelConfig(_need(values, "family", str), _need(values, "hidden"), _need(values, "layers"),
                          _need(values, "heads"), _need(values, "kv_heads"), _need(values, "ffn"),
                          _need(values, "vocab"), seq, _flag(values, "tied", False), 1e-5)
    return cfg


def _csv_cluster(values: dict, base: Cluster | None) -> Cluster:
    gpu = values["gpu"].lower() if "gpu" in values else None
    name = values.get("cluster")
    published = GPU_CLUSTERS.get(gpu.split()[0].split("-")[0]) if gpu else None
    if gpu is not None and name is None and published:  # a published name ("H100-SXM (DGX)", "B200"): its cluster
        name, gpu = published, None
    elif gpu is not None and gpu not in GPUS:
        raise ValueError(f"gpu={values['gpu']!r} is not a preset ({', '.join(GPUS)}) nor a published name "
                         f"({', '.join(GPU_CLUSTERS)}): give a preset's name")
    per_node = int(values.get("gpus_per_node", 0)) or None
    if base is None and name in NVLINK_DOMAINS:
        per_node = None  # a tray's 4 GPUs: the NVLink domain is the rack
    return overridden(base or make_cluster(name), gpu, per_node,
                      float(values.get("intra_node_gbs", 0)) or None, float(values.get("inter_node_gbs", 0)) or None)


def measured_seconds(values: dict, cfg: ModelConfig, job: Job) -> float:
    """Seconds per step from the row's measurement: measured_iter_s, measured_tflops_per_gpu (with
    its flops_convention), or `measured` in `measured_unit` (TFLOP/s/GPU or tokens/s/GPU)."""
    if "measured_iter_s" in values:
        return _need(values, "measured_iter_s", float)
    unit = values.get("measured_unit", "TFLOP/s/GPU") if "measured" in values else "TFLOP/s/GPU"
    value = _need(values, "measured" if "measured" in values else "measured_tflops_per_gpu", float)
    tokens = job.global_batch * job.seq
    if unit == "tokens/s/GPU":
        return tokens / (job.world_size * value)
    if unit != "TFLOP/s/GPU":
        raise ValueError(f"measured_unit={unit!r}: give TFLOP/s/GPU or tokens/s/GPU")
    convention = _need(values, "flops_convention", str)
    flops = flops_per_sequence(FLOP_CONVENTIONS.get(convention.lower(), convention), cfg, job.seq)
    return job.global_batch * flops / (job.world_size * value * 1e12)


def _csv_run(values: dict, cluster: Cluster | None, source: str) -> Run:
    framework = values.get("framework", "megatron")
    sizes = dict(dp=_need(values, "dp"), pp=_need(values, "pp"), cp=int(values.get("cp", 1)),
                 x=int(values.get("x", 1)), y=int(values.get("y") or _need(values, "tp")), z=int(values.get("z", 1)))
    layout = Layout(**sizes)
    world = values.get("gpus") or values.get("world")
    if world and int(world) != layout.world_size:
        raise ValueError(f"{world} GPUs, but dp*pp*cp*x*y*z = {layout.world_size}: correct the grid or the GPU count")
    cfg = _model(values, framework, layout.pp)
    micro_batch = values.get("micro_batch") or values.get("mbs")
    # an unpublished interleaving of a pipeline is each one Megatron can build ("?", or a blank cell)
    virtual_known = values.get("virtual", "1" if layout.pp == 1 else "?") != "?"
    virtual = int(values.get("virtual", 1)) if virtual_known else 1
    stages = ()
    if framework == "megatron" and cfg.layers % (layout.pp * virtual):
        stages = megatron_stages(cfg.layers, layout.pp * virtual)
    job = Job(layout, global_batch=_need(values, "global_batch"), micro_batch=int(micro_batch or 1),
              seq=_need(values, "seq"), recompute=values.get("recompute", "none"),
              seq_parallel=_flag(values, "seq_parallel", True), precision=values.get("precision", "bf16"),
              virtual=virtual, schedule="interleaved-1f1b" if virtual > 1 else "1f1b", stage_layers=stages)
    seconds = measured_seconds(values, cfg, job)
    overlap = _flag(values, "overlap_dp", False) if "overlap_dp" in values else None
    traits = RunTraits(_flag(values, "flash_attention", True),
                       _flag(values, "fp8", values.get("notes", "").upper().startswith("FP8")),
                       values.get("cp_comm", "p2p"))
    return make_run(cfg, job, _csv_cluster(values, cluster), framework, seconds, _source(values, source),
                    micro_batch is not None, virtual_known, overlap, traits)


def _without_cp(run: Run, values: dict, measured: float) -> list[Run]:
    """The best run without context parallelism at the length of `run` (NeMo's long-sequence
    notes: its throughput, not its configuration): a run whose alternatives are every grid with
    cp 1 on the same GPUs (tp up to a node, pp dividing the layers), micro-batch and recompute that
    the profile's rules accept and its memory model fits; none when nothing fits."""
    job, world = run.jobs[0], run.jobs[0].world_size
    jobs = []
    for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if world % (tp * pp) or tp > run.cluster.gpus_per_node:
            continue
        layout = Layout(dp=world // (tp * pp), pp=pp, y=tp)
        for mb, recompute in itertools.product(MICRO_BATCHES, RECOMPUTE):
            j = replace(job, layout=layout, micro_batch=mb, recompute=recompute, virtual=1, schedule="1f1b",
                        stage_layers=())
            if not profile_problems(run.cfg, j, run.framework) and predict(run.cfg, j, run.cluster,
                                                                            framework=run.framework)["fits"]:
                jobs.append(j)
    if not jobs:
        return []
    # the fastest few by the default constants: a fit moves the times, seldom past that many
    jobs = sorted(jobs, key=lambda j: step_time(run.cfg, j, run.cluster, Calibration(), run.framework,
                                                run.traits).total)[:WITHOUT_CP_KEPT]
    seconds = measured_seconds({**values, "measured": str(measured)}, run.cfg, job)
    return [replace(run, jobs=tuple(sorted(jobs, key=lambda j: j.layout.pp * j.layout.y)), seconds=seconds)]


WITHOUT_CP_KEPT = 6


def _source(values: dict, file: str) -> str:
    """The published source of a row (the document its `source` column names, SOURCES: the runs one
    table gives, whatever its revision), else the file's name."""
    text = values.get("source", "")
    return next((name for needle, name in SOURCES if needle in text), file)


# The documents of context_parallel.csv's `source` column, by name
SOURCES = (("performance_long_sequence", "NeMo long-sequence tables"),
           ("torchtitan", "torchtitan H100 tables"),
           ("NeMo framework", "NeMo performance summaries"), ("performance_summary", "NeMo performance summaries"),
           ("Megatron-Bridge", "Megatron-Bridge performance summaries"))
# Rows of the shipped files the planner has no profile for, with why (read_csv skips them)
NOT_PRICED = (("torchtitan", "FSDP (ZeRO-3) with torch's experimental context parallelism: neither the megatron "
               "nor the fourfold profile"),
              ("(MoE)", "its architecture fields are not from the source"))


def read_csv(path: str | Path, cluster: Cluster | None = None) -> list[Run]:
    """The runs of a CSV in the calibration format that ran (rows with outcome other than `ran` are
    skipped); a shipped file's columns left to its README are filled in (SHIPPED). `cluster`: the
    network of rows that do not give theirs (default: each row's `cluster` column, else dgx-h100)."""
    runs = []
    defaults = SHIPPED.get(Path(path).name, {})
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            values = {**defaults, **{k.strip(): v.strip() for k, v in row.items() if k and v and v.strip()}}
            if values.get("outcome", "ran") != "ran":
                continue  # a failed run (out of memory, mostly) has no step time
            if defaults and any(needle in values.get("source", "") + values.get("model", "")
                                for needle, _ in NOT_PRICED):
                continue
            try:
                runs.append(_csv_run(values, cluster, Path(path).name))
                if best := re.search(r"no-CP(?: config)? ([0-9.]+)", values.get("notes", "")):
                    runs.extend(_without_cp(runs[-1], values, float(best.group(1))))
            except ValueError as e:
                raise ValueError(f"{path}, line {line}: {e}") from None
    return runs


def shipped_runs(folder: str | Path = DATA) -> list[Run]:
    """Every run of the shipped calibration files, with their README's facts."""
    folder = Path(folder)
    missing = [name for name in SHIPPED if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {', '.join(missing)}: give the folder of the shipped calibration data")
    return [run for name in SHIPPED for run in read_csv(folder / name)]


def read_run_dir(path: str | Path, cluster: Cluster | None = None) -> Run:
    """A `fourfold train` run: the median step time of log.jsonl (its first step, the warm-up, left
    out) and the job and model saved with its latest checkpoint. `cluster`: the machine it ran on
    (default: the run's [hardware] section)."""
    path = Path(path)
    log = path / "log.jsonl"
    if not log.is_file():
        raise ValueError(f"{path} has no log.jsonl: give a `fourfold train` run directory (its --log.run_dir)")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "seconds" in r and not r.get("skipped")]
    if len(steps) < 2:
        raise ValueError(f"{log} has {len(steps)} timed steps; calibration needs 2 or more (the first is the "
                         f"warm-up): train longer")
    if steps[-1].get("mfu") is None:  # the trainer logs an MFU on GPUs only
        raise ValueError(f"{path} ran on CPU (its log.jsonl has no MFU), and runs on CPU do not calibrate: the "
                         f"presets and the constants' ranges are GPUs'; give runs of `fourfold train` on GPUs, or "
                         f"measured GPU runs as --csv rows (docs/planner.md, Calibration)")
    metas = sorted((path / "checkpoints").glob("step-*/meta.json"))
    if not metas:
        raise ValueError(f"{path}/checkpoints has no complete checkpoint, and the run's job is saved only with its "
                         f"checkpoints (a run with --checkpoint.dir elsewhere, or stopped before its first one): "
                         f"write the run as a CSV row (docs/planner.md, Calibration) and give it with --csv")
    meta = json.loads(metas[-1].read_text())
    try:
        config = TrainConfig(**{f.name: replace(f.default_factory(), **meta["config"].get(f.name, {}))
                                for f in fields(TrainConfig)})
    except TypeError as e:  # a key this version does not know
        raise ValueError(f"{metas[-1]}: the saved configuration does not fit this fourfold ({e}): write the run as "
                         f"a CSV row (docs/planner.md, Calibration) and give it with --csv") from None
    job = config.job()
    if job.precision == "auto":  # what the trainer chooses on GPUs
        job = replace(job, precision="bf16")
    cluster = cluster or config.cluster()
    seconds = statistics.median(r["seconds"] for r in steps[1:])
    try:
        return make_run(ModelConfig.from_dict(meta["model"]), job, cluster, "fourfold", seconds, path.name)
    except ValueError as e:  # the rules' problems: name the run they belong to
        raise ValueError(f"{path}: {e}") from None


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
    each cluster with PROFILE_RUNS or more of the runs. `software` False: only the profiles, of
    every cluster of the runs (the software constants held, nothing else to tell them from)."""
    names = [r.cluster.name for r in runs]
    if not software:
        return [(c, k) for c in sorted(set(names)) for k in HARDWARE_KNOBS]
    clusters = sorted(c for c in set(names) if names.count(c) >= PROFILE_RUNS)
    return [(None, k) for k in SOFTWARE_KNOBS] + [(c, k) for c in clusters for k in HARDWARE_KNOBS]


def log_errors(runs: list[Run], cal: Calibration) -> np.ndarray:
    """log(predicted / measured) step time of each run."""
    return np.array([math.log(predicted_seconds(r, cal) / r.seconds) for r in runs])


def _calibration(start: Calibration, fitted: list[tuple[str | None, Knob]], theta) -> Calibration:
    """`start` with the fitted constants `theta`: the software ones, and a profile per cluster."""
    software = {k.name: k.value(float(t)) for (c, k), t in zip(fitted, theta) if c is None}
    profiles = {}
    for (c, k), t in zip(fitted, theta):
        if c is not None:  # (every hardware knob of a cluster is fitted together)
            profiles.setdefault(c, {})[k.name] = k.value(float(t))
    kept = tuple(p for p in start.profiles if p.cluster not in profiles)
    return replace(start, **software, profiles=kept + tuple(Profile(c, **v) for c, v in sorted(profiles.items())))


def fit(runs: list[Run], start: Calibration = START, iterations: int = 30, tolerance: float = 1e-5,
        software: bool = True) -> Calibration:
    """The constants that minimise the mean squared log error of the runs' step times (`knobs`):
    Levenberg-Marquardt from `start`, each step clipped to the knobs' ranges, with finite-difference
    derivatives (taken inwards at a bound). Only the profiles of the runs' clusters change.
    `software` False: only those profiles are fitted, each from `start`'s."""
    fitted = knobs(runs, software)
    low = np.array([k.coordinate(k.low) for _, k in fitted])
    high = np.array([k.coordinate(k.high) for _, k in fitted])

    def calibration(theta: np.ndarray) -> Calibration:
        return _calibration(start, fitted, theta)

    # a full fit starts every profile mid-range; a profile-only fit from the cluster's current one
    first = {r.cluster.name: START_PROFILE if software else asdict(start.profile(r.cluster))
             for r in runs}
    theta = np.clip([k.coordinate(getattr(start, k.name) if c is None else first[c][k.name]) for c, k in fitted],
                    low, high)
    r = log_errors(runs, calibration(theta))
    cost, damping = r @ r, 1e-2
    steps = 1e-4 * (high - low)
    for _ in range(iterations):
        columns = []
        for i, h in enumerate(steps):
            h = -h if theta[i] + h > high[i] else h
            moved = theta.copy()
            moved[i] += h
            columns.append((log_errors(runs, calibration(moved)) - r) / h)
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
    return calibration(theta)


# ----- cross-validation and scores -----------------------------------------------------------------

def folds(runs: list[Run]) -> list[str]:
    """Each run's cross-validation fold: its group; groups of a single run from one source form one
    fold (a table of one run per model: held out together, a stricter test than one at a time);
    when that leaves a single fold, each run is a fold of its own."""
    groups = [r.group for r in runs]
    fold = [r.source if groups.count(r.group) == 1 else r.group for r in runs]
    return fold if len(set(fold)) > 1 else [str(i) for i in range(len(runs))]


def cross_validate(runs: list[Run], **fit_options) -> list[float]:
    """Each run's step time predicted by constants fitted without its fold (`folds`)."""
    fold = folds(runs)
    predicted = [0.0] * len(runs)
    for held_out in sorted(set(fold)):
        cal = fit([r for r, f in zip(runs, fold) if f != held_out], **fit_options)
        for i, f in enumerate(fold):
            if f == held_out:
                predicted[i] = predicted_seconds(runs[i], cal)
    return predicted


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


def plan_scores(runs: list[Run], predicted: list[float], band: float | Calibration) -> Scores:
    """How `fourfold plan` orders each group (`search.rank`) on the predicted step times: the
    runs within the error band of the fastest prediction first, simplest first, then by time.
    `band`: one error, or a Calibration whose per-kind errors (`cv_errors`) set it."""
    cal = band if isinstance(band, Calibration) else Calibration(cv_error=band, cv_errors=())
    speed = [0.0] * len(runs)
    for group in {r.group for r in runs}:
        members = [dict(fits=True, tight=False, step_seconds=predicted[i], memory_gib=0.0, index=i,
                        micro_batch=r.micro_batch or 0, **r.jobs[0].layout.sizes)
                   for i, r in enumerate(runs) if r.group == group]
        for position, m in enumerate(rank(members, cal)):
            speed[m["index"]] = -position
    return scores(runs, speed, predicted)


def rule_scores(runs: list[Run]) -> Scores:
    """The rule "least tp*cp*pp, then the largest micro-batch" (an unknown micro-batch counts as 0)."""
    return scores(runs, [-r.model_parallel + (r.micro_batch or 0) / 1e3 for r in runs])


@dataclass(frozen=True)
class CrossValidation:
    model: Scores  # the held-out step times' own order
    plan: Scores  # `fourfold plan`'s order of them: ties within the cross-validated error by the rule


def calibrate(runs: list[Run], software: bool = True) -> tuple[Calibration, CrossValidation]:
    """The constants fitted on every run, carrying their cross-validated error (`cv_error`), and the
    cross-validated scores. `software` False: only the profiles of the runs' clusters, from the shipped
    fit (`perf.Calibration`'s defaults), whose software constants (114 published runs) are kept."""
    if len(runs) < 2:
        raise ValueError(f"calibration needs 2 or more measured runs, got {len(runs)}")
    options = {} if software else dict(start=Calibration(), software=False)
    predicted = cross_validate(runs, **options)
    model = model_scores(runs, predicted)
    cal = replace(fit(runs, **options), cv_error=model.error, cv_errors=kind_errors(runs, predicted))
    return cal, CrossValidation(model, plan_scores(runs, predicted, cal))


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
    predicted = [0.0] * len(runs)
    for name in sorted(set(names)):
        cal = fit([r for r, n in zip(runs, names) if n != name])
        for i, n in enumerate(names):
            if n == name:
                predicted[i] = predicted_seconds(runs[i], cal)
    out = []
    for name in sorted(set(names)):
        held = [i for i, n in enumerate(names) if n == name]
        others = [i for i, n in enumerate(names) if n != name]
        band = Calibration(cv_error=None, cv_errors=kind_errors([runs[i] for i in others],
                                                                 [predicted[i] for i in others]))
        mine, times = [runs[i] for i in held], [predicted[i] for i in held]
        cp = [abs(r.seconds / p - 1) for r, p in zip(mine, times) if r.kind == "cp"]
        baseline = mfu_baseline([runs[i] for i in others], mine)
        out.append(HeldOut(name, len(held), model_scores(mine, times), plan_scores(mine, times, band),
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
