"""`fourfold train`: one rank's training loop (torchrun starts every rank).

Per step: replica d reads its part of the global batch, splits each micro-batch over z and the
sequence over cp; the micro-batches run through the model (accumulating) or through the pipeline
schedule; gradients are reduced in buckets during the last backward; AdamW (ZeRO-1) updates. A
non-finite loss skips the update; checkpoints are written every N steps and at the end. SIGINT or
SIGTERM stops every rank after the same step (SIGTERM, which clusters send before a time limit,
saves a checkpoint first; SIGINT, a Ctrl-C, does not: its step is lost, the last checkpoint is named).

A step makes no host sync: its loss, gradient norm and whether it was skipped stay on the device,
and are read for the records every log.every steps (and before an evaluation, a checkpoint or the
end) in one transfer; the batch is copied from pinned memory without waiting; a signal is agreed
on host to host, one step behind (`StopAgreement`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold import checkpoint
from fourfold.data import corpus
from fourfold.models.config import ModelConfig
from fourfold.parallel import comm
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model, local_batch
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.block import torch_dtype
from fourfold.parallel.tensor.params import Replicas
from fourfold.spec.counts import flops_per_token
from fourfold.spec.layout import DIMS
from fourfold.spec.trainconfig import ConfigError, TrainConfig, validate
from fourfold.train import metrics
from fourfold.train.evaluate import evaluate
from fourfold.train.launch import StopRequest


class TrainingError(RuntimeError):
    """The run cannot go on (for example, too many non-finite losses in a row)."""


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr at the last step."""
    o, steps = cfg.optimizer, cfg.train.steps
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    progress = (step - o.warmup) / max(1, steps - o.warmup)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


SCHEDULE_KEYS = ("train.steps", "optimizer.lr", "optimizer.min_lr", "optimizer.warmup")


def schedule_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """The keys of the learning-rate schedule that differ from `saved` (the config a checkpoint was
    written with), as "key old -> new"."""
    now, out = cfg.to_dict(), []
    for key in SCHEDULE_KEYS:
        section, name = key.split(".")
        before, after = saved.get(section, {}).get(name), now[section][name]
        if before is not None and before != after:
            out.append(f"{key} {before} -> {after}")
    return out


def packed_windows(cfg: TrainConfig, tokenizer_path: Path, tokens_path: Path) -> Path | None:
    """With data.packing = "documents", the file of the windows (made by the first call, in the
    cache, and found there by the others); else None."""
    if cfg.data.packing != "documents":
        return None
    return corpus.document_windows(tokens_path, cfg.batch.seq, corpus.end_of_document(tokenizer_path),
                                   cfg.data.cache_dir)


def checkpoint_source(cfg: TrainConfig) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the checkpoint this run starts from, the damaged newer ones of its own passed over with what
    is wrong in each): its own newest intact one (checkpoint.resume), else checkpoint.load (a
    step-N directory, or a run's checkpoint directory: its latest), else none. The run's own wins,
    so that running the same command again, or a torchrun restart, continues instead of going back
    to checkpoint.load. Every file is checked there with its size (`checkpoint.damage`); raises
    ConfigError, naming what is missing and the fix, where nothing intact is left to start from:
    a checkpoint.load that is damaged or does not exist, or a run whose checkpoints all are."""
    c = cfg.checkpoint
    if c.resume:
        own, skipped = checkpoint.newest_intact(cfg.checkpoint_dir)
        if own is not None:
            return own, skipped
        if skipped:
            raise ConfigError(f"every checkpoint in {cfg.checkpoint_dir} is damaged ({_damages(skipped)}): move them "
                              f"aside (out of step-*) to start anew, or give another --log.run_dir")
    if not c.load:
        return None, []
    load = Path(c.load)
    if not load.exists():
        raise ConfigError(f"checkpoint.load {load} does not exist; give a step-N directory or a run's checkpoint "
                          f"directory written by `fourfold train`")
    step = load
    if not (load / checkpoint.META).is_file() and not checkpoint.STEP.fullmatch(load.name):  # a run's directory
        steps = checkpoint.step_dirs(load)
        if not steps:
            raise ConfigError(f"checkpoint.load {load} is not a fourfold checkpoint (no {checkpoint.META}, no step-N "
                              f"directories); give a step-N directory or a run's checkpoint directory written by "
                              f"`fourfold train`")
        step = steps[-1]
    what = checkpoint.damage(step)
    if what:
        intact = checkpoint.newest_intact(step.parent)[0]
        other = f", or --checkpoint.load {intact}, the newest intact one" if intact else ""
        raise ConfigError(f"checkpoint.load: the checkpoint {step} is damaged ({what}): copy it again{other}")
    return step, []


def _damages(skipped: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{path.name}: {what}" for path, what in skipped)


# The model settings that shape its tensors: a checkpoint of other values cannot be loaded. (The
# others, RoPE's theta and scaling, the positions of a RoPE model, eps, the sliding window, may
# change between runs: a long-context extension does.)
SHAPES = ("family", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tied", "head_dim", "qkv_bias",
          "out_bias", "mlp_bias", "experts", "shared_ffn")


def check_checkpoint(cfg: TrainConfig) -> list[str]:
    """The checkpoint the run would start from, before any process starts: every file there with its
    size (`checkpoint_source`), and of the configured model's shapes (raises ConfigError naming the
    fix). Returns the other settings that differ from the checkpoint's, as "key there -> here", for
    the user to see."""
    source, _ = checkpoint_source(cfg)  # (the ranks say which damaged ones they pass over)
    if source is None:
        return []
    own = source.parent == Path(cfg.checkpoint_dir)
    saved = ModelConfig.from_dict(checkpoint.read_meta(source)["model"])
    model = cfg.model_config()
    shapes = SHAPES + (("max_positions",) if model.family_spec().learned_positions else ())
    differ = {f.name: f"{f.name} {getattr(saved, f.name)} there, {getattr(model, f.name)} here"
              for f in dataclasses.fields(model) if getattr(saved, f.name) != getattr(model, f.name)}
    refused = [text for name, text in differ.items() if name in shapes]
    if refused:
        fix = ("give another --log.run_dir, or --checkpoint.resume false, to start anew" if own else
               "give a checkpoint of this model, or the model it was trained with")
        raise ConfigError(f"the checkpoint {source} holds another model ({'; '.join(refused)}): {fix}")
    return [text for name, text in differ.items() if name not in shapes]


def tokenizer_files(tokenizer_path: str | Path) -> dict[str, Path]:
    """The files each checkpoint keeps a copy of (name there -> path): the tokenizer, and the
    tokenizer_config.json beside it if there is one (its EOS, class, chat template: without it an
    end token only that file names is lost to `fourfold export` and a later fine-tune)."""
    tokenizer_path = Path(tokenizer_path)
    config = tokenizer_path.with_name("tokenizer_config.json")
    return {"tokenizer.json": tokenizer_path, **({"tokenizer_config.json": config} if config.is_file() else {})}


def generation_settings(cfg: TrainConfig) -> tuple[dict[str, Path], int | None]:
    """What model.hf says about generating, kept with each checkpoint for `fourfold export`: its
    generation_config.json (to copy in; name -> path) and its config.json's pad_token_id."""
    if not cfg.model.hf:
        return {}, None
    folder = Path(cfg.model.hf).expanduser()
    generation = folder / "generation_config.json"
    pad = json.loads((folder / "config.json").read_text()).get("pad_token_id")
    return ({"generation_config.json": generation} if generation.is_file() else {}), pad


def tokens_files(cfg: TrainConfig) -> tuple[Path, Path]:
    """(tokenizer.json, tokens.npy): the user's, or the corpus prepared (and cached) now."""
    d = cfg.data
    if d.tokens:
        if not cfg.tokenizer:
            raise ValueError("data.tokens needs data.tokenizer (the tokenizer.json that made it)")
        return Path(cfg.tokenizer), Path(d.tokens)
    try:
        return corpus.prepare(d.text or None, d.vocab, os.path.expanduser(d.cache_dir), files=d.files,
                              tokenizer=cfg.tokenizer, field=d.field, skip_bad=d.skip_bad_records, workers=d.workers)
    except ValueError as e:  # a corpus file the checks before launch could not see into
        raise ConfigError(f"data: {e}") from None


def peak_memory_gib(grid: Grid) -> float:
    if grid.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


class Reporter:
    """Rank 0's progress bar and records (`metrics.Metrics`: log.jsonl, TensorBoard, W&B)."""

    def __init__(self, cfg: TrainConfig, start: int, flops_per_token: float, world: int, device: torch.device):
        self.cfg, self.rank0 = cfg, dist.get_rank() == 0
        self.flops_per_token, self.world = flops_per_token, world
        self.peak = cfg.cluster().gpu.bf16_tflops if device.type == "cuda" else None
        self.bar = None
        tensorboard = cfg.log.tensorboard and metrics.installed("tensorboard")
        if self.rank0:
            self.metrics = metrics.Metrics(Path(cfg.log.run_dir), start=start, tensorboard=tensorboard,
                                           wandb_project=cfg.log.wandb_project, config=cfg.to_dict())
            if cfg.log.progress and sys.stderr.isatty():  # redirected (a scheduler's log): the JSON lines instead
                from tqdm import tqdm

                self.bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
        if cfg.log.tensorboard and not tensorboard:
            self.message(f"no TensorBoard event files: the tensorboard package is not installed (pip install "
                         f"{metrics.TENSORBOARD}, or --log.tensorboard false to silence this)")

    def start(self, event: dict, header: list[str]) -> None:
        """Rank 0: the start's record (log.jsonl, TensorBoard) and its header lines."""
        self.metrics.event(event, header[-1])
        for line in header:
            self.message(line)

    def step(self, record: dict) -> None:
        if not self.rank0:
            return
        tokens = self.cfg.batch.global_batch * self.cfg.batch.seq
        record["tokens_per_s"] = tokens / record["seconds"]
        record["tflops_per_gpu"] = self.flops_per_token * tokens / record["seconds"] / self.world / 1e12
        record["mfu"] = record["tflops_per_gpu"] / self.peak if self.peak else None
        self.metrics.write(record)
        if self.bar is not None:
            mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a (CPU)"
            self.bar.set_postfix_str(f"loss {record['loss']:.3f} | {record['tokens_per_s']:.0f} tok/s | "
                                     f"{record['tflops_per_gpu']:.3f} TFLOP/s/rank | MFU {mfu} | "
                                     f"mem {record['peak_memory_gib']:.2f} GiB")
            self.bar.update(1)
        elif record["step"] % self.cfg.log.every == 0:
            print(json.dumps(record), flush=True)

    def evaluation(self, step: int, result: dict) -> None:
        """The held-out loss after `step` steps: a record and a line under the bar."""
        if self.rank0:
            self.metrics.write({"eval_after_step": step, "eval_loss": result["loss"],
                                "eval_perplexity": result["perplexity"], "eval_tokens": result["tokens"]})
        self.message(f"step {step}: held-out loss {result['loss']:.4f} (perplexity {result['perplexity']:.1f}, "
                     f"{result['tokens']} tokens)")

    def message(self, text: str) -> None:
        if self.rank0:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.rank0:
            if self.bar is not None:
                self.bar.close()
            self.metrics.close()


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None  # (JSON has no NaN)


def run_summary(run_dir: Path, tokens_per_step: int) -> dict:
    """summary.json's numbers over the whole run, every segment of it (`metrics.trajectory`): the
    first and last loss, the steps and tokens it trained, the seconds its steps took, the last
    held-out loss, and where each segment started from."""
    steps, held_out, events = metrics.trajectory(run_dir)
    records = list(steps.values())
    return dict(first_loss=_finite(records[0]["loss"]) if records else None,
                last_loss=_finite(records[-1]["loss"]) if records else None,
                eval_loss=list(held_out.values())[-1]["eval_loss"] if held_out else None,
                steps=len(records), tokens=len(records) * tokens_per_step,
                seconds=sum(r["seconds"] for r in records),
                segments=[{k: e.get(k) for k in ("event", "step", "from", "grid")} for e in events])


def loss_curve(run_dir: Path) -> Path:
    """Plot the run's losses (`metrics.trajectory`: after a resume, the attempt that went on) to loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, evals, _ = metrics.trajectory(run_dir)
    losses = {s: r["loss"] for s, r in records.items() if _finite(r["loss"]) is not None}
    # a held-out score after `eval_after_step` steps: plotted at the last one's index
    held_out = {after - 1: r["eval_loss"] for after, r in evals.items()}
    steps = sorted(losses)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [losses[s] for s in steps], label="training")
    if held_out:
        ax.plot(sorted(held_out), [held_out[s] for s in sorted(held_out)], "o-", label="held-out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class StopAgreement:
    """The strongest signal any rank got (SIGTERM > SIGINT, by number), agreed on so that every
    rank stops after the same step whichever ranks the signal reached. Host to host and one step
    behind: each step starts the all-reduce of the flags as they are then, and reads the one the
    previous step started, long finished, so no step waits for it, nor for the GPU."""

    def __init__(self, stop: StopRequest):
        self.stop, self.group, self._pending = stop, comm.host_group(), None

    def poll(self) -> signal.Signals | None:
        agreed = self.finish()
        flag = torch.tensor([self.stop.received])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return signal.Signals(agreed) if agreed else None

    def finish(self) -> int:
        """The agreed flag of the all-reduce in flight (0 if none); nothing is in flight after."""
        if self._pending is None:
            return 0
        (work, flag), self._pending = self._pending, None
        work.wait()
        return int(flag.item())


def _stop_message(cfg: TrainConfig, stopped: signal.Signals, done: int) -> str:
    """The one line about a run stopped by a signal: the last checkpoint and how to resume."""
    said = f"stopped by {stopped.name} after {done} of {cfg.train.steps} steps"
    if stopped == signal.SIGINT:
        said += " (SIGINT does not save; SIGTERM does)"
    last = checkpoint.latest(cfg.checkpoint_dir)
    if last is None:
        return f"{said}; no checkpoint yet: the same command starts over"
    how = (f"resume with --checkpoint.load {last}" if cfg.checkpoint.load or not cfg.checkpoint.resume
           else "run the same command again to resume from it")
    return f"{said}; last checkpoint {last}: {how}"


def _maybe_signal(cfg: TrainConfig, step: int) -> None:
    """Fault injection for the stop test: this rank sends itself a signal once, at the configured step."""
    marker = Path(cfg.log.run_dir) / ".signal-injected"
    if cfg.fault.signal_step == step and cfg.fault.signal_rank == dist.get_rank() and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.Signals[cfg.fault.signal])


def _maybe_kill(cfg: TrainConfig, step: int) -> None:
    """Fault injection for the recovery test: this rank dies once, at the configured step."""
    marker = Path(cfg.log.run_dir) / ".fault-injected"
    if cfg.fault.kill_step == step and cfg.fault.kill_rank == dist.get_rank() and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def _agreed_source(cfg: TrainConfig, group) -> tuple[Path | None, list[tuple[Path, str]]]:
    """`checkpoint_source` as rank 0 finds it (the rule the check before launch applied), on every
    rank, its contents then verified by all of them together (`checkpoint.contents_damage`): every
    rank loads the same step, and none reads a checkpoint before it is verified. A checkpoint of
    the run's own whose contents differ from its manifest is passed over like one missing a file
    (the next older intact one is taken); checkpoint.load's is refused, naming the files."""
    source, skipped = _on_rank_0(lambda: checkpoint_source(cfg), group)
    while source is not None and (what := checkpoint.contents_damage(source, group)):
        if not (cfg.checkpoint.resume and source.parent == cfg.checkpoint_dir):  # checkpoint.load's: no other to take
            raise ConfigError(f"checkpoint.load: the checkpoint {source} is damaged ({what}): copy it again")
        skipped.append((source, what))
        source, older = _on_rank_0(lambda: checkpoint.newest_intact(cfg.checkpoint_dir, older_than=source), group)
        skipped += older
    if source is None and skipped:
        raise ConfigError(f"every checkpoint in {cfg.checkpoint_dir} is damaged ({_damages(skipped)}): move them "
                          f"aside (out of step-*) to start anew, or give another --log.run_dir")
    return source, skipped


def _on_rank_0(find, group):
    """What `find()` returns on rank 0, on every rank of `group` (a ConfigError it raises: raised on every rank)."""
    found = [None]
    if dist.get_rank() == 0:
        try:
            found = [find()]
        except ConfigError as e:  # (a file changed since the check before launch)
            found = [e]
    dist.broadcast_object_list(found, src=0, group=group)
    if isinstance(found[0], ConfigError):
        raise found[0]
    return found[0]


def _grid_text(sizes: dict) -> str:
    return ",".join(f"{d}={sizes.get(d, 1)}" for d in (*DIMS, "ep") if sizes.get(d, 1) > 1) or "dp=1"


def _start_event(cfg: TrainConfig, source: Path | None, skipped: list[tuple[Path, str]], start: int,
                 saved_config: dict) -> dict:
    """log.jsonl's record of this start: "resume" from a checkpoint of the run's own, else "start"
    (from scratch, model.hf's weights, or checkpoint.load's checkpoint), with where from and on what grid."""
    resume = source is not None and source.parent == cfg.checkpoint_dir
    event = {"event": "resume" if resume else "start", "step": start, "from": str(source) if source else None,
             "model": cfg.model.hf or cfg.model.preset, "grid": _grid_text(cfg.to_dict()["grid"]),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if saved_config.get("grid") and _grid_text(saved_config["grid"]) != event["grid"]:
        event["grid_before"] = _grid_text(saved_config["grid"])
    if skipped:
        event["skipped"] = {str(path): what for path, what in skipped}
    logged = [s for s in metrics.trajectory(Path(cfg.log.run_dir))[0] if s >= start] if resume else []
    if logged:
        event["replays"] = [start, max(logged)]  # steps logged before, lost with the attempt that logged them
    return event


def _header(cfg: TrainConfig, model_cfg: ModelConfig, loader: corpus.TokenLoader, tokens_path: Path, event: dict,
            device: torch.device) -> list[str]:
    """Rank 0's lines at the start: what runs, where on, on what data, from where."""
    source = cfg.model.hf or f"preset {cfg.model.preset}"
    windows = loader.train_sequences
    epochs = cfg.train.steps * cfg.batch.global_batch / windows
    lines = [f"model: {model_cfg.family}, {model_cfg.layers} layers, hidden {model_cfg.hidden}, "
             f"{model_cfg.parameter_count() / 1e6:,.1f}M parameters ({source})",
             f"grid: {event['grid']} ({dist.get_world_size()} rank{'s' * (dist.get_world_size() > 1)}), "
             f"precision {str(torch_dtype(cfg.train.precision, device)).removeprefix('torch.')}",
             f"data: {len(loader.tokens):,} tokens ({tokens_path}), {windows:,} training windows of {cfg.batch.seq}: "
             f"train.steps={cfg.train.steps} x {cfg.batch.global_batch} sequences = {epochs:.3g} epochs"]
    if event["from"] is None:
        lines.append("start: step 0" + (f", {cfg.model.hf}'s weights" if cfg.model.hf else ", random weights"))
        return lines
    said = f"start: {'resumed' if event['event'] == 'resume' else 'loaded'} {event['from']} at step {event['step']}"
    if "grid_before" in event:
        said += f", written on grid {event['grid_before']}: resharded onto {event['grid']}"
    if "skipped" in event:
        said += (f"; the newest intact checkpoint, passing over {len(event['skipped'])} damaged: "
                 + "; ".join(f"{Path(p).name} ({what})" for p, what in event["skipped"].items()))
    return lines + [said]


def train(cfg: TrainConfig, stop: StopRequest | None = None) -> dict:
    """Run (or resume) the configured training on every rank of the default process group
    (torchrun's, joined by `fourfold train`); returns a summary. SIGINT and SIGTERM are noted by
    `stop` (`fourfold train` starts noting them when the rank starts; else from here until the end)."""
    if stop is not None:
        return _train(cfg, stop)
    stop = StopRequest()
    try:
        return _train(cfg, stop)
    finally:
        stop.restore()


def _train(cfg: TrainConfig, stop: StopRequest) -> dict:
    return Trainer(cfg).run(stop)


class Trainer:
    """One rank's run in parts: `__init__` sets it up (data, model, optimizer, the checkpoint or
    Hugging Face weights it starts from, records), `step` trains one step, `evaluate` scores the
    held-out tail, `save` writes a checkpoint, and `run` is the loop that calls them."""

    def __init__(self, cfg: TrainConfig):
        validate(cfg, dist.get_world_size(), gpu=dist.get_backend() == "nccl")
        self.cfg = cfg
        self.grid = grid = Grid(cfg.layout())
        files = tokens_files(cfg) if grid.rank == 0 else None  # tokenize (and pack) once; the others find it cached
        if files:
            packed_windows(cfg, *files)
        dist.barrier()
        tokenizer_path, tokens_path = files or tokens_files(cfg)
        self.loader = corpus.TokenLoader(tokens_path, cfg.batch.seq, cfg.batch.global_batch, seed=cfg.data.seed,
                                         packing=cfg.data.packing,
                                         windows=packed_windows(cfg, tokenizer_path, tokens_path))
        # data.attention = document: the boundaries are the tokenizer's end-of-document ids
        self.end_of_document = corpus.end_of_document(tokenizer_path) if cfg.data.attention == "document" else None
        self.model_cfg = model_cfg = cfg.model_config()  # (tokenizer and token ids were checked before launch)
        self.job = cfg.job()
        self.model = Model(grid, self.job, model_cfg, dtype=torch_dtype(cfg.train.precision, grid.device),
                           overlap=cfg.train.overlap, seed=cfg.model.seed, std=cfg.model.init_std,
                           capacity_factor=cfg.model.capacity_factor,
                           compile=cfg.train.compile)
        self.sync = GradientSync(self.model.module, grid, shard=cfg.optimizer.zero1)
        o = cfg.optimizer
        self.opt = AdamW(self.sync, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                         clip_norm=o.clip or None)
        # Ranks holding the same parameters share their loads and saves: the dp*cp ranks, and for an
        # expert's weights under expert parallelism its replicas
        self.replicas = Replicas.of_grid(grid)
        self.start, self.position, saved_config = self._load()
        self.reporter = Reporter(cfg, self.start, flops_per_token(model_cfg, cfg.batch.seq),
                                 grid.layout.world_size, grid.device)
        if self.reporter.rank0:  # (reads log.jsonl: one rank does)
            event = _start_event(cfg, self.source, self.skipped, self.start, saved_config)
            self.reporter.start(event, _header(cfg, model_cfg, self.loader, tokens_path, event, grid.device))
        changed = schedule_changes(saved_config, cfg)
        if changed:
            self.reporter.message(f"the learning-rate schedule differs from the checkpoint's ({', '.join(changed)}): "
                                  f"from step {self.start} on the rate follows the new one")
        if self.start >= cfg.train.steps:
            self.reporter.message(f"the checkpoint is at step {self.start} of train.steps={cfg.train.steps}: nothing "
                                  f"to train; raise --train.steps, or start over with another --log.run_dir")
        self.saver = checkpoint.AsyncSaver() if cfg.checkpoint.async_save else None
        generation, self.pad_token_id = generation_settings(cfg)
        self.copied = tokenizer_files(tokenizer_path) | generation
        self.everything = grid.group(("dp", "pp", "cp", "z"))  # the ranks holding different tokens' losses
        self.scale = 1.0 / (cfg.batch.global_batch * cfg.batch.seq)
        self.bad = torch.zeros((), dtype=torch.int64, device=grid.device)  # non-finite steps in a row
        self.window: list[dict] = []  # the steps not read yet, their numbers on the device

    def _load(self) -> tuple[int, int, dict]:
        """(the first step, the first sequence of its batch in the data order, the saved config):
        the agreed checkpoint's, or Hugging Face weights, or none."""
        cfg = self.cfg
        self.source, self.skipped = _agreed_source(cfg, comm.host_group())
        if self.source is None:
            if cfg.model.hf:
                from fourfold.checkpoint.hf import load_hf

                for part in self.model.parts:
                    load_hf(part, cfg.model.hf, replicas=self.replicas)
            return 0, 0, {}
        meta = checkpoint.load_checkpoint(self.source, self.model.module, self.opt, replicas=self.replicas)
        # where the data order stood: a resume with another global batch goes on from there
        position = meta.get("data_position", meta["step"] * cfg.batch.global_batch)
        return meta["step"], position, meta.get("config", {})

    def step(self, step: int) -> None:
        """Forward and backward of this rank's micro-batches, the optimizer's update (skipped on a
        non-finite loss or norm), and the step's record, kept on the device until `read_window`."""
        cfg, grid = self.cfg, self.grid
        began = time.perf_counter()
        self.opt.lr = learning_rate(cfg, step)
        ids = self.loader.batch_at(self.position, grid.coords["dp"], grid.size("dp"))
        self.position += cfg.batch.global_batch
        batch = local_batch(self.job, grid, ids, self.end_of_document)
        loss = self.model.step(batch, self.sync, math.nan if step in cfg.fault.nan_steps else self.scale)
        loss = comm.all_reduce(loss.double().reshape(1), self.everything)[0]
        # A non-finite loss, or a finite loss whose gradients overflowed, skips the update.
        updated = self.opt.step(loss_finite=torch.isfinite(loss))
        self.bad = torch.where(updated, 0, self.bad + 1)
        self.window.append(dict(step=step, began=began, lr=self.opt.lr, loss=loss, norm=self.opt.norm,
                                updated=updated, bad=self.bad, peak_memory_gib=peak_memory_gib(grid)))

    def read_window(self) -> None:
        """Records of the window's steps, read in one host sync. Each step's seconds are the
        window's mean: without a sync per step the host cannot time one step of the GPU's. The
        non-finite count is checked here too, before any checkpoint could save after it."""
        if not self.window:
            return
        numbers = torch.stack([torch.stack([w["loss"], w["norm"], w["updated"].double(), w["bad"].double()])
                               for w in self.window]).tolist()
        seconds = (time.perf_counter() - self.window[0]["began"]) / len(self.window)
        for w, (loss, norm, updated, in_a_row) in zip(self.window, numbers):
            step = w["step"]
            if not updated:
                why = f"loss is {loss}" if not math.isfinite(loss) else "the gradient norm is not finite"
                self.reporter.message(f"step {step}: {why}; update skipped ({int(in_a_row)} in a row)")
                if in_a_row >= self.cfg.train.max_bad_steps:
                    raise TrainingError(f"{int(in_a_row)} non-finite steps in a row (last at step {step}: {why}); "
                                        f"lower optimizer.lr, check the data, or resume from an earlier checkpoint")
            self.reporter.step(dict(step=step, loss=loss, lr=w["lr"], grad_norm=norm if math.isfinite(loss) else None,
                                    seconds=seconds, skipped=not updated, peak_memory_gib=w["peak_memory_gib"]))
        self.window.clear()

    def evaluate(self, done: int) -> None:
        """The held-out loss after `done` steps, through the pipeline stages when there are."""
        held_out = evaluate(self.model, self.loader.held_out(), self.cfg.batch.seq,
                            max(1, self.cfg.batch.micro_batch // self.grid.size("z")), self.cfg.train.eval_tokens,
                            self.end_of_document)
        self.reporter.evaluation(done, held_out)

    def save(self, done: int) -> str:
        cfg = self.cfg
        meta = dict(data_position=self.position, config=cfg.to_dict(), model=dataclasses.asdict(self.model_cfg),
                    pad_token_id=self.pad_token_id)
        path = (self.saver.save if self.saver else checkpoint.save)(cfg.checkpoint_dir, done, self.model.module,
                                                                    self.opt, meta, cfg.checkpoint.keep,
                                                                    files=self.copied, replicas=self.replicas)
        return f"{path} (being written in the background)" if self.saver else str(path)

    def run(self, stop: StopRequest) -> dict:
        """Steps until train.steps or an agreed stop signal, evaluating, recording and saving on
        their schedules; returns the run's summary."""
        cfg = self.cfg
        stopped, done, saved_at = None, self.start, self.start
        agreement = StopAgreement(stop)
        try:
            for step in range(self.start, cfg.train.steps):
                _maybe_kill(cfg, step)
                _maybe_signal(cfg, step)
                stopped = agreement.poll()
                if stopped:
                    break
                self.step(step)
                done = step + 1
                evaluating = cfg.train.eval_every and done % cfg.train.eval_every == 0
                saving = done % cfg.checkpoint.every == 0 or done == cfg.train.steps
                if evaluating or saving or done % cfg.log.every == 0:
                    self.read_window()
                if evaluating:
                    self.evaluate(done)
                if saving:
                    self.reporter.message(f"checkpoint {self.save(done)}")
                    saved_at = done
            self.read_window()  # the steps before a stop
            agreement.finish()
            if stopped == signal.SIGTERM and saved_at != done:
                self.save(done)
        finally:
            if self.saver:  # a save in flight ends (or fails) before the process group goes away
                self.saver.wait()
            checkpoint.wait_for_pruning()  # no old checkpoint left half deleted at exit
        if stopped:
            self.reporter.message(_stop_message(cfg, stopped, done))
        self.reporter.close()
        summary = dict(step=done, checkpoint=str(checkpoint.latest(cfg.checkpoint_dir)),
                       stopped=stopped.name if stopped else None)
        if self.grid.rank == 0:
            summary.update(run_summary(Path(cfg.log.run_dir), cfg.batch.global_batch * cfg.batch.seq))
            summary["loss_curve"] = str(loss_curve(Path(cfg.log.run_dir)))
            (Path(cfg.log.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
        dist.barrier()
        return summary
