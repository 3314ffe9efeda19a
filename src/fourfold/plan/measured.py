"""Measured runs as the planner sees them (`Run`): read from a CSV in the calibration format
(docs/planner.md, "Calibration"), from the published runs shipped with fourfold (`shipped_runs`,
the files of `DATA`), or from a `fourfold train` run directory. `plan.calibrate` fits the
step-time model's constants to them."""

from __future__ import annotations

import csv
import itertools
import json
import re
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path

from fourfold.config import TrainConfig
from fourfold.models.config import ModelConfig, load_config
from fourfold.plan.constants import Calibration
from fourfold.plan.frameworks import FOURFOLD, Framework, named
from fourfold.plan.frameworks.megatron import interleavings
from fourfold.plan.perf import RunTraits, model_flops_per_token, step_time
from fourfold.plan.search import check, predict
from fourfold.spec.counts import layer_params
from fourfold.spec.hardware import GPUS, Cluster, make_cluster, overridden
from fourfold.spec.job import RECOMPUTE, Job
from fourfold.spec.layout import Layout

# The published calibration data shipped with fourfold (a copy of the team's ../shared/calibration,
# each file's facts in its README.md); `shipped_runs` and the benchmarks take another folder.
DATA = Path(__file__).resolve().parent / "data"
# What the shipped files leave to their README.md, the same for every row of the file (`read_csv`
# fills it in for a file of that name). The Llama runs' nodes have 4 x 200 Gb/s InfiniBand for 8
# GPUs (12.5 GB/s per GPU); the GPT runs' have 8 x 200 Gb/s, the dgx-a100 preset's 25 GB/s.
# Megatron-LM 2021 predates sequence parallelism.
SHIPPED = {
    "megatron_llama31_8b_a100.csv": dict(model="llama-3.1-8b", global_batch="1024", recompute="none",
                                         flops_convention="megatron", cluster="dgx-a100", inter_node_gbs="12.5",
                                         virtual="1"),
    "megatron_gpt_a100_scaling.csv": dict(family="gpt2", tied="true", seq_parallel="false", cluster="dgx-a100",
                                          overlap_dp="false", flash_attention="false"),
    # Megatron-Core r0.8.0's H100 table: gradient reduce and parameter gather overlapped, and the
    # tensor-parallel collectives (Megatron-LM's README: "--overlap-grad-reduce --overlap-param-gather",
    # "--tp-comm-overlap"), selective recompute, interleaved pipelines whose stages per rank are not
    # published ("?")
    "megatron_core_gpt_h100.csv": dict(family="gpt2", tied="true", recompute="selective", cluster="dgx-h100",
                                       overlap_dp="true", tp_comm_overlap="true", virtual="?"),
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


@dataclass(frozen=True)
class Run:
    """One measured run, as the planner sees it."""

    cfg: ModelConfig
    jobs: tuple[Job, ...]  # the job that ran; without its micro-batch, each that fits (or the smallest)
    cluster: Cluster
    framework: Framework  # the profile it is priced under: the one of the software it ran
    seconds: float  # measured, per optimizer step
    group: str  # the runs a user chooses among: one model, cluster, GPU count, sequence and batch
    source: str  # the file or run directory it was read from
    overlap_dp: bool | None = None  # Megatron's overlap_grad_reduce and overlap_param_gather (None: not published)
    traits: RunTraits = RunTraits()  # flash attention or not, FP8 linears, the cp exchange
    # a `fourfold train` run's measured split of a step (seconds: compute and the waits by kind,
    # the median rank's, `train.timing`); None where the run did not record one
    split: tuple[tuple[str, float], ...] | None = None

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


def make_run(cfg: ModelConfig, job: Job, cluster: Cluster, framework: Framework, seconds: float, source: str,
             micro_batch_known: bool = True, virtual_known: bool = True, overlap_dp: bool | None = None,
             traits: RunTraits = RunTraits()) -> Run:
    """A `Run`, its job checked by the planner's rules (a `JobError` names each fix). Without the
    micro-batch, every one of MICRO_BATCHES that the rules accept and that fits in memory; without
    the interleaved stages per rank (pp > 1), each of `interleavings` the framework's rules
    accept, or the plain schedule where they accept none."""
    micro_batches = (job.micro_batch,) if micro_batch_known else MICRO_BATCHES
    jobs = [replace(job, micro_batch=mb) for mb in micro_batches]
    valid = [j for j in jobs if not framework.problems(cfg, j)]
    if not virtual_known and job.layout.pp > 1:
        interleaved = [replace(j, virtual=v, schedule="interleaved-1f1b") for j in jobs
                       for v in interleavings(cfg.layers, job.layout.pp)]
        # the plain schedule only where no interleaving is valid
        valid = [j for j in interleaved if not framework.problems(cfg, j)] or valid
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


def _model(values: dict) -> ModelConfig:
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
    framework = named(values.get("framework", "megatron"))
    sizes = dict(dp=_need(values, "dp"), pp=_need(values, "pp"), cp=int(values.get("cp", 1)),
                 x=int(values.get("x", 1)), y=int(values.get("y") or _need(values, "tp")), z=int(values.get("z", 1)))
    layout = Layout(**sizes)
    world = values.get("gpus") or values.get("world")
    if world and int(world) != layout.world_size:
        raise ValueError(f"{world} GPUs, but dp*pp*cp*x*y*z = {layout.world_size}: correct the grid or the GPU count")
    cfg = _model(values)
    micro_batch = values.get("micro_batch") or values.get("mbs")
    # an unpublished interleaving of a pipeline is each one Megatron can build ("?", or a blank cell)
    virtual_known = values.get("virtual", "1" if layout.pp == 1 else "?") != "?"
    virtual = int(values.get("virtual", 1)) if virtual_known else 1
    stages = framework.published_stages(cfg.layers, layout.pp * virtual)
    job = Job(layout, global_batch=_need(values, "global_batch"), micro_batch=int(micro_batch or 1),
              seq=_need(values, "seq"), recompute=values.get("recompute", "none"),
              seq_parallel=_flag(values, "seq_parallel", True), precision=values.get("precision", "bf16"),
              virtual=virtual, schedule="interleaved-1f1b" if virtual > 1 else "1f1b", stage_layers=stages)
    seconds = measured_seconds(values, cfg, job)
    overlap = _flag(values, "overlap_dp", False) if "overlap_dp" in values else None
    recipe = PERFORMANCE_RECIPES.get(_source(values, source), {})
    reduce = values.get("grad_reduce", recipe.get("grad_reduce", "fp32"))
    if reduce not in ("fp32", "bf16"):
        raise ValueError(f"grad_reduce={reduce!r}: give fp32 or bf16 (the gradients' reduce-scatter)")
    traits = RunTraits(_flag(values, "flash_attention", True),
                       _flag(values, "fp8", values.get("notes", "").upper().startswith("FP8")),
                       values.get("cp_comm") or None,
                       _flag(values, "tp_comm_overlap", recipe.get("tp_comm_overlap", False)),
                       2 if reduce == "bf16" else 4)
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
            if not run.framework.problems(run.cfg, j) and predict(run.cfg, j, run.cluster,
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
# What the performance tables' runs ran beyond their columns: NeMo's and Megatron-Bridge's summaries
# come from the recipes' performance settings (NeMo 2.2, nemo/collections/llm/recipes/llama3_70b.py
# and llama31_405b.py, `pretrain_performance_optimizations`): Transformer Engine's tensor-parallel
# communication overlap (MegatronCommOverlapCallback(tp_comm_overlap=True)) and the gradients
# reduced in bf16 (grad_reduce_in_fp32=False). A CSV row may say either (columns tp_comm_overlap,
# grad_reduce).
PERFORMANCE_RECIPES = {
    "NeMo performance summaries": dict(tp_comm_overlap=True, grad_reduce="bf16"),
    "Megatron-Bridge performance summaries": dict(tp_comm_overlap=True, grad_reduce="bf16"),
}
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
        run = make_run(ModelConfig.from_dict(meta["model"]), job, cluster, FOURFOLD, seconds, path.name)
    except ValueError as e:  # the rules' problems: name the run they belong to
        raise ValueError(f"{path}: {e}") from None
    return replace(run, split=measured_split(records))


def measured_split(records: list[dict]) -> tuple[tuple[str, float], ...] | None:
    """The median over a run's timing records (the first, which holds the warm-up, left out when
    there are more) of the median rank's seconds a step by part: compute, then each kind of wait."""
    timings = [r["median"] for r in records if "timing_after_step" in r]
    timings = timings[1:] if len(timings) > 1 else timings
    if not timings:
        return None
    return tuple((part, statistics.median(t[part] for t in timings)) for part in timings[0] if part != "step")
