"""The training configuration: a TOML file, `--section.key value` overrides, and every check that
can be made before a process group exists (so a bad config fails in seconds, naming the fix)."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from fourfold.blockspec import RECOMPUTE
from fourfold.layout import DIMS, Layout
from fourfold.models.config import ModelConfig, load_config
from fourfold.pipeline import SCHEDULES, check_schedule, split_layers


@dataclass
class ModelSection:
    preset: str = "tiny-llama"  # a preset name or a config.json path
    hf: str = ""  # a Hugging Face checkpoint directory to start from (overrides preset)
    seed: int = 0
    init_std: float = 0.02


@dataclass
class GridSection:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    x: int = 1
    y: int = 1
    z: int = 1
    order: str = ""  # innermost first, e.g. "x,y,z,cp,dp,pp" (the default)
    auto: bool = False  # take the planner's best grid for `hardware` and the world size


@dataclass
class BatchSection:
    global_batch: int = 16  # sequences per optimizer step
    micro_batch: int = 2  # sequences per forward/backward on one data-parallel replica
    seq: int = 128


@dataclass
class PipelineSection:
    schedule: str = "1f1b"
    virtual: int = 1  # virtual stages per rank (interleaved-1f1b)
    stage_layers: list[int] = field(default_factory=list)  # uneven split; empty = even


@dataclass
class OptimizerSection:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0
    zero1: bool = True


@dataclass
class TrainSection:
    steps: int = 100
    precision: str = "auto"  # auto: bf16 parameters/activations on GPU, float32 on CPU; or "bf16", "float32"
    recompute: str = "none"
    seq_parallel: bool = False
    overlap: bool = True
    max_bad_steps: int = 3  # non-finite losses in a row before the run stops
    eval_every: int = 0  # score the held-out tail every N steps (0: never; needs pp = 1)


@dataclass
class DataSection:
    text: str = ""  # a UTF-8 text file; empty = the bundled King James Bible
    tokens: str = ""  # an already tokenized .npy file (then `tokenizer` names its tokenizer.json)
    tokenizer: str = ""
    vocab: int = 4096
    cache_dir: str = "~/.cache/fourfold"
    seed: int = 0


@dataclass
class CheckpointSection:
    dir: str = ""  # default: RUN/checkpoints
    every: int = 50
    keep: int = 2
    resume: bool = True  # continue from the latest complete checkpoint in `dir`
    load: str = ""  # start from this checkpoint (any grid), ignoring `resume`


@dataclass
class LogSection:
    run_dir: str = "runs/default"
    every: int = 1
    progress: bool = True


@dataclass
class HardwareSection:
    gpu: str = "h100-80gb"  # the preset MFU is measured against on GPUs
    cluster: str = ""  # for grid.auto: a cluster preset (else gpu with gpus_per_node)
    gpus_per_node: int = 8


@dataclass
class FaultSection:  # fault injection, to test recovery
    kill_rank: int = -1  # this rank kills itself once, at kill_step
    kill_step: int = -1
    nan_steps: list[int] = field(default_factory=list)  # these steps' losses are made NaN


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
    def model_config(self) -> ModelConfig:
        return load_config(self.model.hf or self.model.preset)

    def layout(self) -> Layout:
        g = self.grid
        sizes = {d: getattr(g, d) for d in DIMS}
        return Layout(**sizes, order=tuple(g.order.split(","))) if g.order else Layout(**sizes)

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each data-parallel replica."""
        return self.batch.global_batch // (self.grid.dp * self.batch.micro_batch)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.log.run_dir) / "checkpoints")


class ConfigError(ValueError):
    """A training configuration that cannot run; the message names the fix."""


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
        raise ConfigError(f"{where} takes a {type(like).__name__}, not {text!r}") from None


def _apply(cfg: TrainConfig, section: str, key: str, value, where: str) -> None:
    sections = {f.name for f in fields(TrainConfig)}
    if section not in sections:
        raise ConfigError(f"{where}: unknown section [{section}]; sections are {', '.join(sorted(sections))}")
    part = getattr(cfg, section)
    keys = {f.name for f in fields(part)}
    if key not in keys:
        raise ConfigError(f"{where}: unknown key {section}.{key}; [{section}] takes {', '.join(sorted(keys))}")
    current = getattr(part, key)
    if isinstance(value, str) and not isinstance(current, str):
        value = _coerce(value, current, f"{section}.{key}")
    elif isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(current):
        raise ConfigError(f"{where}: {section}.{key} takes a {type(current).__name__}, got {value!r}")
    setattr(part, key, value)


def load_train_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """The config from a TOML file (or the defaults) with `--section.key value` overrides."""
    cfg = TrainConfig()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: {section} = ... must sit inside a [section]")
            for key, value in values.items():
                _apply(cfg, section, key, value, path)
    items = list(overrides)
    if len(items) % 2:
        raise ConfigError(f"overrides come in pairs (--section.key value); {items[-1]!r} has no value")
    for flag, value in zip(items[::2], items[1::2]):
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"override {flag!r} must look like --section.key (e.g. --optimizer.lr 1e-3)")
        section, key = flag[2:].split(".", 1)
        _apply(cfg, section, key.replace("-", "_"), value, "command line")
    return cfg


def validate(cfg: TrainConfig, world: int) -> None:
    """Every check that needs no process group: raises ConfigError naming the fix."""
    try:
        model = cfg.model_config()
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None
    layout = cfg.layout()
    if layout.world_size != world:
        raise ConfigError(f"the grid {layout} needs {layout.world_size} processes, but {world} were started; "
                          f"set --nproc-per-node (times nodes) to {layout.world_size} or change the grid")
    b, g = cfg.batch, cfg.grid
    if b.global_batch % (g.dp * b.micro_batch):
        raise ConfigError(f"batch.global_batch ({b.global_batch}) must be a multiple of grid.dp * batch.micro_batch "
                          f"({g.dp} * {b.micro_batch})")
    if b.micro_batch % g.z:
        raise ConfigError(f"batch.micro_batch ({b.micro_batch}) must be divisible by grid.z ({g.z}): z splits the batch")
    if b.seq % (2 * g.cp if g.cp > 1 else 1) or b.seq > model.max_positions:
        raise ConfigError(f"batch.seq ({b.seq}) must be divisible by 2*cp ({2 * g.cp}) and at most the model's "
                          f"{model.max_positions} positions")
    if cfg.train.seq_parallel and (b.seq // g.cp) % g.y:
        raise ConfigError(f"sequence parallelism splits each rank's {b.seq // g.cp} tokens over y={g.y}: choose a "
                          f"sequence length divisible by cp*y")
    if cfg.train.recompute not in RECOMPUTE:
        raise ConfigError(f"train.recompute must be one of {', '.join(RECOMPUTE)}")
    if cfg.train.precision not in ("auto", "bf16", "float32"):
        raise ConfigError("train.precision must be auto, bf16 or float32")
    if cfg.train.eval_every and g.pp > 1:
        raise ConfigError("train.eval_every scores a whole model per rank: use grid.pp = 1, or score the checkpoints "
                          "with `fourfold eval --checkpoint` on a grid without pp")
    if cfg.train.eval_every < 0:
        raise ConfigError("train.eval_every must be >= 0 (0: never)")
    if model.tied and g.pp > 1:
        raise ConfigError("tied embeddings cannot be split across pipeline stages yet: use grid.pp = 1 or an untied model")
    if g.pp > 1:
        try:
            check_schedule(cfg.pipeline.schedule, g.pp, cfg.pipeline.virtual, cfg.microbatches)
            split_layers(model.layers, g.pp * cfg.pipeline.virtual, cfg.pipeline.stage_layers or None)
        except ValueError as e:
            raise ConfigError(f"pipeline: {e}") from None
    elif cfg.pipeline.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule must be one of {', '.join(SCHEDULES)}")
    for name, value in (("steps", cfg.train.steps), ("checkpoint.every", cfg.checkpoint.every)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1")


def resolve_auto_grid(cfg: TrainConfig, world: int) -> dict:
    """With grid.auto: set the grid, micro-batch and recompute to the planner's best candidate for
    `hardware` on `world` GPUs that this runtime can run; returns that candidate."""
    from fourfold.plan.hardware import make_cluster
    from fourfold.plan.memory import Setup
    from fourfold.plan.search import search

    h = cfg.hardware
    cluster = make_cluster(h.cluster or None, h.gpu, h.gpus_per_node)
    base = Setup(seq=cfg.batch.seq, global_batch=cfg.batch.global_batch, seq_parallel=cfg.train.seq_parallel)
    for candidate in search(cfg.model_config(), world, cluster, base):
        trial = dataclasses.replace(cfg, grid=dataclasses.replace(cfg.grid, auto=False, order=candidate["order"]),
                                    batch=dataclasses.replace(cfg.batch, micro_batch=candidate["micro_batch"]),
                                    train=dataclasses.replace(cfg.train, recompute=candidate["recompute"]))
        for d in DIMS:
            setattr(trial.grid, d, candidate[d])
        try:
            validate(trial, world)
        except ConfigError:
            continue
        cfg.grid, cfg.batch, cfg.train = trial.grid, trial.batch, trial.train
        return candidate
    raise ConfigError(f"the planner found no configuration of {world} ranks that fits and that this run can use; "
                      f"set the grid by hand")
