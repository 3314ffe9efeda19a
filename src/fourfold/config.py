"""The training configuration: a TOML file, `--section.key value` overrides, and every check that
can be made before a process group exists (so a bad config fails in seconds, naming the fix).

Torch-free and above only `models` and `spec`: the checks that read the data's files are
`fourfold.data.checks`, where the files are read."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shutil
import textwrap
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from fourfold import extras
from fourfold.models.config import ModelConfig, load_config
from fourfold.spec.hardware import DEVICES, Cluster, make_cluster
from fourfold.spec.job import Job
from fourfold.spec.layout import DIMS, GridError, Layout
from fourfold.spec.rules import describe, problems


@dataclass
class ModelSection:
    preset: str = "tiny-llama"  # a preset name or a config.json path
    hf: str = ""  # a Hugging Face checkpoint directory to start from (overrides preset)
    seed: int = 0  # the initial values' seed (any grid gives the same model)
    init_std: float = 0.02  # standard deviation of the initial weights
    # A mixture's expert capacity: each expert takes at most ceil(factor * top_k * tokens / experts)
    # of the tokens a rank routes per micro-batch, the most heavily weighted (Megatron's capacity
    # factor, "probs" drop policy); 0: dropless (transformers' arithmetic)
    capacity_factor: float = 0.0
    # The pad token's embedding row (config.json's pad_token_id) is kept as transformers keeps it: no
    # gradient from the lookup (nn.Embedding's padding_idx). true: train it like every row
    train_padding_row: bool = False


# [grid]: the sizes of the dims Layout declares, the placement order (innermost first, e.g.
# "x,y,z,cp,dp,pp", the default) and `auto` (take the planner's best job for `hardware`).
GridSection = dataclasses.make_dataclass(
    "GridSection", [(d, int, 1) for d in DIMS] + [("ep", int, 1), ("order", str, ""), ("auto", bool, False),
                                                  ("elastic", bool, False), ("fallbacks", str, "")])


@dataclass
class BatchSection:
    global_batch: int = 16  # sequences per optimizer step
    micro_batch: int = 2  # sequences per forward/backward on one data-parallel replica
    seq: int = 128  # tokens per sequence


@dataclass
class PipelineSection:
    schedule: str = "1f1b"  # gpipe, 1f1b or interleaved-1f1b (with pp > 1)
    virtual: int = 1  # virtual stages per rank (interleaved-1f1b)
    stage_layers: list[int] = field(default_factory=list)  # uneven split; empty = even


@dataclass
class OptimizerSection:
    lr: float = 3e-3  # peak learning rate, after the warmup
    min_lr: float = 3e-4  # where the cosine decay ends, at train.steps
    warmup: int = 10  # steps of linear warmup
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on the weight matrices and embeddings
    # weight decay on norms' weights and biases too (as fourfold did before 2026-12-04; Megatron and HF exclude them)
    decay_norms_and_biases: bool = False
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    clip: float = 1.0  # the global gradient norm is clipped to this (0: no clipping)
    zero1: bool = True  # shard the optimizer state over the data-parallel ranks (ZeRO-1)
    overlap_param_gather: bool = True  # ZeRO-1's parameter all-gather behind the next forward, bucket by bucket
    # DeepSeek-V3's aux-loss-free balancing: after each step every expert's bias moves by this toward balance
    # (+ when it took fewer than the mean of the step's choices, - when more); 0 keeps the biases as loaded
    balance_bias_speed: float = 0.001




@dataclass
class TrainSection:
    steps: int = 100  # optimizer steps of the whole run (the learning-rate schedule's length)
    # auto: CUDA (NCCL, one GPU per rank) when every rank of a node has a visible GPU of its own, CPU
    # (gloo) when there is none, else an error before launch; or cpu, cuda
    device: str = "auto"
    precision: str = "auto"  # auto: bf16 parameters/activations on GPU, float32 on CPU; or bf16, float32, float64
    recompute: str = "none"  # activation recomputation: none, selective (attention core) or full (block)
    seq_parallel: bool = True  # the planner's assumption too (plan/estimate --seq-parallel)
    keep_gathered_inputs: bool = False  # linears keep their gathered input (more memory, one all-gather less)
    overlap: bool = True  # overlap the tensor-parallel collectives with compute
    max_bad_steps: int = 3  # non-finite losses in a row before the run stops
    eval_every: int = 0  # score the held-out tail every N steps (0: never)
    eval_tokens: int = 1 << 20  # tokens of the held-out tail each evaluation scores (0: all of it)
    # torch.compile: each block whole where it traces as one graph (no tensor or context parallelism,
    # no mixture or window), else its norms, RoPE and activations (needs a C++ compiler on CPU, Triton
    # on GPUs); off until a GPU run confirms it pays (docs/benchmarks.md)
    compile: bool = False
    # the blocks' linears' GEMMs in FP8 with torchao's recipe "tensorwise" or "rowwise" (GPUs with FP8:
    # H100, H200, L40S, B200; emulated on CPU, for checks only); "": off. Needs the fp8 extra (torchao)
    fp8: str = ""


@dataclass
class DataSection:
    text: str = ""  # a UTF-8 text file; empty (and no `files`) = the bundled King James Bible
    # or: text/.jsonl (also .gz), .parquet, .arrow files, save_to_disk dirs; paths/globs, comma-separated
    files: str = ""
    field: str = "text"  # the JSONL field or Parquet column that holds each document
    skip_bad_records: bool = False  # JSONL lines that are no document (not JSON, no text field): leave out, counted
    tokens: str = ""  # an already tokenized .npy file (then `tokenizer` names its tokenizer.json)
    # a tokenizer.json (or a directory with one), used as it is; empty = train a byte-level BPE of `vocab` tokens
    tokenizer: str = ""
    vocab: int = 4096  # the trained byte-level BPE's vocabulary (without data.tokenizer)
    workers: int = 0  # processes that tokenize the corpus; 0 = one per CPU core
    cache_dir: str = "~/.cache/fourfold"  # tokenized corpora and tokenizers, by content hash
    seed: int = 0  # the batch order's seed
    # "stream": windows cut one after another from the token stream. "documents": each window starts
    # at a document start and holds that document and the whole ones after it, the last cut at the
    # window's end; the next window starts at that cut document (its cut part is seen twice). A
    # document longer than a window is cut into consecutive windows, each starting where the last
    # ended. The held-out tail is then whole documents. Needs end-of-document ids in data.tokens.
    packing: str = "stream"
    # "causal": each token attends to every token before it in its window. "document": only to those of
    # its own document (a block-diagonal causal mask from the end-of-document ids in the window: the
    # end-of-document token closes its document); positions are kept. On every grid, cp included.
    attention: str = "causal"


ATTENTIONS = ("causal", "document")  # data.attention
PACKINGS = ("stream", "documents")  # data.packing


@dataclass
class CheckpointSection:
    dir: str = ""  # default: RUN/checkpoints
    every: int = 50  # save every N steps (and at the end, and on SIGTERM); 0: never
    keep: int = 2  # the newest checkpoints kept
    resume: bool = True  # continue from the latest complete checkpoint in `dir`
    load: str = ""  # start from this checkpoint (any grid; or a run's checkpoint dir: its latest) when `dir` has none
    async_save: bool = False  # write in the background (host memory: one rank's share of the state)
    # a save that fails (a full disk): "stop" the run (resume it from the last checkpoint), or "continue"
    # training and save again at the next checkpoint.every (its partial files are removed either way)
    on_failure: str = "stop"


@dataclass
class LogSection:
    run_dir: str = "runs/default"  # log.jsonl, loss.png, summary.json, checkpoints/ and tensorboard/ go here
    # Steps' numbers are read from the device every N steps, one host sync for N (also before an
    # evaluation or a checkpoint); a step's seconds are then the mean over those N; printed every N.
    # (A stop signal is agreed on every step, host to host, one step behind: it needs no read.)
    every: int = 1
    progress: bool = True  # a progress bar when stderr is a terminal (else a JSON line every `every` steps)
    tensorboard: bool = True  # event files in RUN/tensorboard, when the tensorboard package is installed
    wandb_project: str = ""  # a Weights & Biases project to log to (needs the wandb package); empty = none
    # A rank whose compute takes this fraction longer than the median of its pipeline stage's ranks
    # is named a straggler at each read of the steps' numbers (log.jsonl's timing records); 0: 0.25
    # on GPUs, 2.0 on CPU processes (which share cores: their compute varies by up to 133% here)
    straggler_margin: float = 0.0


@dataclass
class HardwareSection:
    cluster: str = ""  # a cluster preset, for grid.auto (default dgx-h100)
    gpu: str = ""  # a GPU preset (default: the cluster's), MFU is measured against it on GPUs
    gpus_per_node: int = 0  # 0: the cluster's


@dataclass
class FaultSection:  # fault injection, to test recovery
    kill_rank: int = -1  # this rank kills itself once, at kill_step
    kill_step: int = -1  # the step kill_rank dies at
    nan_steps: list[int] = field(default_factory=list)  # these steps' losses are made NaN
    signal_rank: int = -1  # this rank sends itself `signal` once, at the start of signal_step
    signal_step: int = -1  # the step signal_rank sends its signal at
    signal: str = "SIGTERM"  # or SIGINT


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    grid: GridSection = field(default_factory=GridSection)
    batch: BatchSection = field(default_factory=BatchSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    hardware: HardwareSection = field(default_factory=HardwareSection)
    fault: FaultSection = field(default_factory=FaultSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ----- derived values ---------------------------------------------------------------------
    def data_source(self) -> str:
        """What the run trains on, as the user named it; the bundled corpus, which nothing names, by name."""
        if not (self.data.text or self.data.files or self.data.tokens):
            return "the bundled King James Bible (no --data.text, --data.files or --data.tokens given)"
        return ", ".join(filter(None, (self.data.text, self.data.files))) or self.data.tokens

    def model_config(self) -> ModelConfig:
        return load_config(str(Path(self.model.hf).expanduser()) if self.model.hf else self.model.preset)

    def layout(self) -> Layout:
        g = self.grid
        sizes = {d: getattr(g, d) for d in (*DIMS, "ep")}
        return Layout(**sizes, order=tuple(g.order.split(","))) if g.order else Layout(**sizes)

    def job(self) -> Job:
        b, p, t = self.batch, self.pipeline, self.train
        return Job(self.layout(), global_batch=b.global_batch, micro_batch=b.micro_batch, seq=b.seq,
                   recompute=t.recompute, seq_parallel=t.seq_parallel, schedule=p.schedule, virtual=p.virtual,
                   stage_layers=tuple(p.stage_layers), precision=t.precision,
                   keep_gathered_inputs=t.keep_gathered_inputs, fp8=t.fp8)

    def cluster(self) -> Cluster:
        """The machine of [hardware], as the planner's --cluster, --gpu and --gpus-per-node make it."""
        h = self.hardware
        return make_cluster(h.cluster or None, h.gpu or None, h.gpus_per_node or None)

    def use_job(self, job: Job) -> None:
        """Take the settings of `job` (the planner's choice) that `job_settings` names."""
        for key, value in job_settings(job).items():
            section, name = key.split(".")
            setattr(getattr(self, section), name, value)

    @property
    def tokenizer(self) -> str:
        """data.tokenizer (a tokenizer.json, or a Hugging Face directory holding one), else
        model.hf's own tokenizer.json (fine-tuning a Hub model on text feeds it ids of its own
        vocabulary), else "" (a byte-level BPE is trained on the corpus)."""
        if self.data.tokenizer:
            named = Path(self.data.tokenizer).expanduser()
            return str(named / "tokenizer.json") if named.is_dir() else self.data.tokenizer
        if not self.model.hf:
            return ""
        own = Path(self.model.hf).expanduser() / "tokenizer.json"
        return str(own) if own.is_file() else ""

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.log.run_dir) / "checkpoints")


class ConfigError(ValueError):
    """A training configuration that cannot run; the message names the fix."""


def parse_fallbacks(text: str) -> list[dict[str, int]]:
    """grid.fallbacks' grids: "dp=2,x=2; dp=4" -> [{"dp": 2, "x": 2}, {"dp": 4}] (dims left out are 1)."""
    out = []
    for grid in filter(None, (g.strip() for g in text.split(";"))):
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in grid.split(","))):
            dim, _, value = part.partition("=")
            if dim not in (*DIMS, "ep") or not value.isdigit() or int(value) < 1:
                raise ConfigError(f"grid.fallbacks: {part!r} in {grid!r} is not DIM=N with DIM one of "
                                  f"{', '.join((*DIMS, 'ep'))} and N >= 1 (e.g. \"dp=2,x=2;dp=4\")")
            if dim in sizes:
                raise ConfigError(f"grid.fallbacks: {grid!r} gives {dim} twice; give each dim once")
            sizes[dim] = int(value)
        out.append(sizes)
    return out


def _coerce(text: str, like, where: str):
    if isinstance(like, bool):
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where} takes true or false, not {text!r}")
    if isinstance(like, list):
        return [int(v) for v in text.split(",") if v]
    try:
        return type(like)(text)
    except ValueError:
        raise ConfigError(f"{where} takes {_a(type(like).__name__)}, not {text!r}") from None


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def config_keys() -> list[str]:
    """Every key of the config, as section.key."""
    return [f"{s.name}.{f.name}" for s in fields(TrainConfig) for f in fields(s.default_factory())]


# What other frameworks (Megatron, torchtitan, transformers' Trainer, nanoGPT) call fourfold's keys
OTHER_NAMES = {
    "optimizer.lr": ("learning_rate", "max_lr", "lr_max", "peak_lr"),
    "optimizer.min_lr": ("min_learning_rate", "lr_min", "final_lr"),
    "optimizer.warmup": ("warmup_steps", "lr_warmup_steps", "lr_warmup_iters", "warmup_iters"),
    "optimizer.beta1": ("adam_beta1",), "optimizer.beta2": ("adam_beta2",),
    "optimizer.clip": ("clip_grad", "grad_clip", "max_grad_norm", "clip_grad_norm", "gradient_clipping", "max_norm"),
    "optimizer.zero1": ("use_distributed_optimizer",),
    "train.steps": ("train_iters", "max_steps", "total_steps", "training_steps", "train_steps", "num_steps"),
    "train.eval_every": ("eval_interval", "eval_steps", "eval_freq"),
    "train.recompute": ("recompute_granularity", "activation_checkpointing", "gradient_checkpointing"),
    "train.seq_parallel": ("sequence_parallel",), "train.precision": ("bf16", "fp16", "mixed_precision", "dtype"),
    "batch.global_batch": ("global_batch_size",),  # (batch_size: per device in some, global in others)
    "batch.micro_batch": ("micro_batch_size", "per_device_train_batch_size", "local_batch_size"),
    "batch.seq": ("seq_length", "seq_len", "max_seq_len", "max_seq_length", "sequence_length", "context_length",
                  "block_size"),
    "checkpoint.every": ("save_interval", "save_steps", "checkpoint_interval"),
    "log.every": ("log_interval", "logging_steps", "log_freq"),
    "grid.y": ("tensor_model_parallel_size", "tp"), "grid.pp": ("pipeline_model_parallel_size",),
    "grid.cp": ("context_parallel_size",), "grid.ep": ("expert_model_parallel_size",),
    "grid.dp": ("data_parallel_size", "data_parallel_replicate_degree"),
}
_OTHER = {other: ours for ours, names in OTHER_NAMES.items() for other in names}


def did_you_mean(name: str, known: list[str]) -> str:
    """" (did you mean X?)" for the known name closest to `name` (a key given without its section,
    e.g. eval_every, finds train.eval_every; another framework's name, learning_rate, finds
    optimizer.lr), or ""."""
    bare = name.lstrip("-").replace("-", "_")
    other = _OTHER.get(bare.split(".")[-1])
    if other in known or f"--{other}" in known:
        return f" (did you mean {other if other in known else f'--{other}'}?)"
    same_key = [k for k in known if k.lstrip("-").replace("-", "_").split(".")[-1] == bare]
    longer = [k for k in known if k.startswith(name)]  # what an abbreviation used to mean
    close = same_key or longer or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _apply(cfg: TrainConfig, section: str, key: str, value, where: str) -> None:
    sections = {f.name for f in fields(TrainConfig)}
    if section not in sections:
        raise ConfigError(f"{where}: unknown section [{section}]{did_you_mean(section, sorted(sections))}; sections "
                          f"are {', '.join(sorted(sections))}")
    part = getattr(cfg, section)
    keys = {f.name for f in fields(part)}
    if key not in keys:
        raise ConfigError(f"{where}: unknown key {section}.{key}{did_you_mean(f'{section}.{key}', config_keys())}; "
                          f"[{section}] takes {', '.join(sorted(keys))}")
    current = getattr(part, key)
    if isinstance(value, str) and not isinstance(current, str):
        value = _coerce(value, current, f"{section}.{key}")
    elif isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(current):
        raise ConfigError(f"{where}: {section}.{key} takes {_a(type(current).__name__)}, got {value!r}")
    setattr(part, key, value)


def _shown(value) -> str:
    """A default as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "''"
    return str(value) if value != "" else "''"


_FIELD = re.compile(r"^    (\w+): [^=]+=.*?(?:#\s*(.*))?$")


def key_help() -> dict[str, str]:
    """Each key's meaning: the comment beside it (or the comment lines above it) in this file's
    section classes, the one place a key is explained."""
    meaning = {f"grid.{d}": f"ranks along {d}" for d in DIMS}
    meaning.update({"grid.ep": "expert parallelism: a mixture's experts split over ep of the dp*cp ranks (no "
                               "ranks added; ep divides dp*cp and the experts)",
                    "grid.order": "placement order, innermost first (default x,y,z,cp,dp,pp): the innermost "
                                  "dim's groups are consecutive ranks", "grid.auto": "take the planner's best job "
                                  "for [hardware] (grid, micro-batch, recompute, sequence parallelism, kept "
                                  "inputs, pipeline schedule and virtual stages)",
                    "grid.elastic": "a start on another number of ranks than the grid's (torchrun's elastic "
                                    "restart on the nodes left, or a relaunch) takes a grid for them: the first of "
                                    "grid.fallbacks this run can use, else the planner's best; the global batch kept",
                    "grid.fallbacks": "grids for grid.elastic, tried in order, separated by ';' (e.g. "
                                      "\"dp=2,x=2;dp=4\"); empty: the planner's best row for the ranks present"})
    section, above = None, []
    for line in Path(__file__).read_text(encoding="utf-8").splitlines():
        if match := re.match(r"class (\w+)Section\b", line):
            section, above = match[1].lower(), []
        elif section and line.strip().startswith("#"):
            above.append(line.strip()[1:].strip())
        elif section and (match := _FIELD.match(line)):
            meaning[f"{section}.{match[1]}"] = match[2] or " ".join(above)
            above = []
        elif not line.startswith((" ", "@")) and line:
            section = None
    return meaning


def sections_help(width: int = 100) -> str:
    """The override syntax and every key with its default and meaning (from the section classes
    above), for `fourfold train --help`."""
    lines = ["Any key of the TOML config can be given on the command line as --section.key value, e.g.",
             "  fourfold train my.toml --optimizer.lr 1e-3 --grid.dp 2 --train.steps 500",
             "(lists are comma-separated: --pipeline.stage_layers 3,5). Sections and keys, with their defaults:"]
    meaning = key_help()
    for section in fields(TrainConfig):
        part = section.default_factory()
        lines.append(f"[{section.name}]")
        for f in fields(part):
            key = f"--{section.name}.{f.name} {_shown(getattr(part, f.name))}"
            lines += textwrap.wrap(meaning.get(f"{section.name}.{f.name}", ""), width, initial_indent=f"  {key:<38} ",
                                   subsequent_indent=" " * 41) or [f"  {key}"]
    return "\n".join(lines)


def load_train_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """The config from a TOML file (or the defaults) with `--section.key value` overrides."""
    cfg = TrainConfig()
    found: list[str] = []  # every problem of the file and the overrides, reported together

    def apply(section: str, key: str, value, where: str) -> None:
        try:
            _apply(cfg, section, key, value, where)
        except ConfigError as e:
            found.append(str(e))

    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                found.append(f"{path}: {section} = ... must sit inside a [section]")
                continue
            for key, value in values.items():
                apply(section, key, value, path)
    items = list(overrides)
    if len(items) % 2:
        raise ConfigError(f"overrides come in pairs (--section.key value); {items[-1]!r} has no value")
    for flag, value in zip(items[::2], items[1::2]):
        if not flag.startswith("--") or "." not in flag:
            found.append(f"override {flag!r} must look like --section.key (e.g. --optimizer.lr 1e-3)")
            continue
        section, key = flag[2:].split(".", 1)
        apply(section, key.replace("-", "_"), value, "command line")
    if found:
        raise ConfigError("\n".join(found) if len(found) == 1 else
                          f"{len(found)} problems:\n" + "\n".join(f"  - {line}" for line in found))
    return cfg


def validate(cfg: TrainConfig, world: int, gpu: bool = False) -> None:
    """Every check that needs no process group, for a run on `gpu`s or CPU processes: raises
    ConfigError listing each problem with its fix."""
    hf = cfg.model.hf
    if hf and not Path(hf).expanduser().is_dir():
        raise ConfigError(f"model.hf names {hf}, which is not a directory; give a Hugging Face model directory "
                          f"(config.json and *.safetensors, as save_pretrained writes it)")
    try:
        model = cfg.model_config()
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None
    try:
        found = problems(model, cfg.job(), world=world, gpu=gpu, attention=cfg.data.attention)
    except GridError as e:  # the placement order or a dim size
        raise ConfigError(f"grid: {e}") from None
    if cfg.train.device not in DEVICES:
        found.append(f"train.device {cfg.train.device!r} is none of {', '.join(DEVICES)}; use one of them")
    try:
        cfg.cluster()
    except ValueError as e:
        found.append(f"hardware: {e}")
    if not (math.isfinite(cfg.model.capacity_factor) and cfg.model.capacity_factor >= 0):
        found.append(f"model.capacity_factor={cfg.model.capacity_factor} must be a number >= 0 (0: dropless)")
    if cfg.train.eval_every < 0:
        found.append("train.eval_every must be >= 0 (0: never)")
    if cfg.train.eval_tokens < 0:
        found.append("train.eval_tokens must be >= 0 (0: the whole held-out tail)")
    if hf and not cfg.tokenizer:
        found.append(f"model.hf {hf} has no tokenizer.json, and a tokenizer trained on the corpus would not match its "
                     f"embeddings: give data.tokenizer (the model's tokenizer.json, or a directory holding one)")
    found += _optimizer_problems(cfg.optimizer)
    found += _data_problems(cfg.data, cfg.tokenizer, model.vocab)
    if cfg.log.wandb_project:
        if not extras.installed("wandb"):
            found.append(f"log.wandb_project needs the wandb package, which is not installed: pip install "
                         f"{extras.WANDB} (or leave log.wandb_project empty)")
    if cfg.train.compile and not gpu and not shutil.which(os.environ.get("CXX", "g++")):  # inductor's compiler
        found.append(f"train.compile on CPU needs a C++ compiler, and {os.environ.get('CXX', 'g++')} is not on PATH: "
                     f"install g++ (or name one in CXX), or use --train.compile false")
    if cfg.train.fp8 and not extras.installed("torchao"):
        found.append(f"train.fp8 needs torchao, which is not installed: pip install {extras.TORCHAO} "
                     f"(the fp8 extra), or use --train.fp8 ''")
    if cfg.train.fp8 and gpu and not _gpus_take_fp8():
        found.append("train.fp8: this GPU has no FP8 tensor cores (compute capability below 8.9; H100, H200, L40S and "
                     "B200 have them): use --train.fp8 '' (bf16)")
    if cfg.fault.signal not in ("SIGINT", "SIGTERM"):
        found.append(f"fault.signal {cfg.fault.signal!r} is not a stop signal; use SIGINT or SIGTERM")
    for name, value in (("train.steps", cfg.train.steps), ("log.every", cfg.log.every)):
        if value < 1:
            found.append(f"{name} must be >= 1")
    if cfg.checkpoint.on_failure not in ("stop", "continue"):
        found.append(f"checkpoint.on_failure {cfg.checkpoint.on_failure!r} is neither stop nor continue; use one")
    if cfg.checkpoint.every < 0:
        found.append(f"checkpoint.every must be >= 0 (0: no checkpoints), not {cfg.checkpoint.every}")
    try:
        if parse_fallbacks(cfg.grid.fallbacks) and not cfg.grid.elastic:
            found.append("grid.fallbacks is given but grid.elastic is off, so no restart would use it: set "
                         "--grid.elastic true, or leave grid.fallbacks out")
    except ConfigError as e:
        found.append(str(e))
    if not cfg.log.straggler_margin >= 0:
        found.append(f"log.straggler_margin must be >= 0 (0.25: 25% over the median; 0: the device's default), not "
                     f"{cfg.log.straggler_margin}")
    if found:
        raise ConfigError(describe(found, "this run cannot start:"))


def _gpus_take_fp8() -> bool:
    """Whether every GPU here has FP8 tensor cores (compute capability 8.9 or later)."""
    import torch  # (a GPU run has it; this module is otherwise torch-free)

    return all(torch.cuda.get_device_capability(i) >= (8, 9) for i in range(torch.cuda.device_count()))


def validate_data(cfg: TrainConfig) -> None:
    """The data checks of `validate` alone (`fourfold prepare`, on a machine that may not be the
    training one): raises ConfigError listing each problem with its fix."""
    try:
        model = cfg.model_config()
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None
    found = _data_problems(cfg.data, cfg.tokenizer, model.vocab)
    if found:
        raise ConfigError(describe(found, "the data cannot be prepared:"))


def _optimizer_problems(o: OptimizerSection) -> list[str]:
    found = []
    if not o.lr > 0:
        found.append(f"optimizer.lr={o.lr} must be > 0")
    elif not 0 <= o.min_lr <= o.lr:
        found.append(f"optimizer.min_lr={o.min_lr} is outside [0, optimizer.lr={o.lr}]: the rate would rise as it "
                     f"decays; set --optimizer.min_lr {o.lr / 10:g} (a tenth of lr) or lower")
    if o.warmup < 0:
        found.append(f"optimizer.warmup={o.warmup} must be >= 0 (steps of linear warmup)")
    for name, beta in (("beta1", o.beta1), ("beta2", o.beta2)):
        if not 0 <= beta < 1:
            found.append(f"optimizer.{name}={beta} must be in [0, 1)")
    for name, value in (("weight_decay", o.weight_decay), ("clip", o.clip)):
        if value < 0:
            zero = "none" if name == "weight_decay" else "no clipping"
            found.append(f"optimizer.{name}={value} must be >= 0 (0: {zero})")
    return found


def _data_problems(d: DataSection, tokenizer: str, model_vocab: int) -> list[str]:
    """The data settings, and that the files named exist (`data.checks.check_data_files` reads them)."""
    found = []
    if not tokenizer and d.vocab > model_vocab:  # the tokenizer trained on the corpus has up to data.vocab ids
        found.append(f"data.vocab={d.vocab} is larger than the model's vocabulary of {model_vocab}: the corpus' "
                     f"tokenizer would make ids the model has no embedding for; set data.vocab <= {model_vocab}")
    # (data.tokenizer as resolved: a directory stands for its tokenizer.json)
    for key, path in (("data.text", d.text), ("data.tokens", d.tokens), ("data.tokenizer", d.tokenizer and tokenizer)):
        if path and not Path(path).expanduser().is_file():
            found.append(f"{key} names {path}, which is not a file; give an existing file's path")
    if d.text and d.files:
        found.append("data.text and data.files both name a corpus; give one (data.files takes text files too)")
    if d.workers < 0:
        found.append("data.workers must be >= 0 (0: one per CPU core)")
    if d.attention not in ATTENTIONS:
        found.append(f"data.attention {d.attention!r} is none of {', '.join(ATTENTIONS)}; use one of them")
    if d.packing not in PACKINGS:
        found.append(f"data.packing {d.packing!r} is none of {', '.join(PACKINGS)}; use one of them")
    if d.tokens and not tokenizer:
        found.append("data.tokens needs data.tokenizer; give the tokenizer.json that made the token file")
    return found


def job_settings(job: Job) -> dict[str, object]:
    """The config keys a planner's job sets: one mapping for `TrainConfig.use_job` and for the
    `--section.key value` overrides that hand the ranks (or a user) the same job."""
    out: dict[str, object] = {f"grid.{d}": getattr(job.layout, d) for d in (*DIMS, "ep")}
    out.update({"grid.order": ",".join(job.layout.order), "grid.auto": False, "batch.micro_batch": job.micro_batch,
                "train.recompute": job.recompute, "train.seq_parallel": job.seq_parallel,
                "train.keep_gathered_inputs": job.keep_gathered_inputs, "pipeline.schedule": job.schedule,
                "pipeline.virtual": job.virtual, "pipeline.stage_layers": list(job.stage_layers)})
    if job.fp8:  # (left out when off: an empty value is the default)
        out["train.fp8"] = job.fp8
    return out


def as_overrides(settings: dict[str, object]) -> list[str]:
    """`--section.key value` for each setting, as the command line and TOML spell values (a list
    comma-separated; an empty one, the default, left out)."""
    def spelt(value: object) -> str:
        if isinstance(value, list):
            return ",".join(map(str, value))
        return str(value).lower() if isinstance(value, bool) else str(value)

    return [v for key, value in settings.items() if value != [] for v in (f"--{key}", spelt(value))]
