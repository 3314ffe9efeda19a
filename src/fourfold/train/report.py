"""What a run tells its user: rank 0's progress bar and records (`metrics.Metrics`: log.jsonl,
TensorBoard, W&B), the lines at its start, and at its end summary.json and loss.png."""

from __future__ import annotations

import json
import math
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold import extras
from fourfold.config import LogSection, TrainConfig
from fourfold.data import corpus
from fourfold.models.config import ModelConfig
from fourfold.models.registry import family_of_hf
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import torch_dtype
from fourfold.spec.layout import grid_text
from fourfold.train import metrics
from fourfold.train.timing import straggler_lines, worst_ranks


def peak_memory_gib(grid: Grid) -> float:
    if grid.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


class Reporter:
    """Rank 0's progress bar and records (`metrics.Metrics`: log.jsonl, TensorBoard, W&B)."""

    def __init__(self, log: LogSection, *, steps: int, start: int, tokens_per_step: int, flops_per_token: float,
                 world: int, peak_tflops: float | None, config: dict):
        """`peak_tflops`: the GPU's, that MFU is measured against (None on CPU); `config`: the run's,
        as the records keep it."""
        self.log, self.rank0, self.steps = log, dist.get_rank() == 0, steps
        self.tokens_per_step, self.flops_per_token, self.world = tokens_per_step, flops_per_token, world
        self.peak = peak_tflops
        self.bar = None
        tensorboard = log.tensorboard and extras.installed("tensorboard")
        if self.rank0:
            self.metrics = metrics.Metrics(Path(log.run_dir), start=start, tensorboard=tensorboard,
                                           wandb_project=log.wandb_project, config=config)
            if log.progress and sys.stderr.isatty():  # redirected (a scheduler's log): the JSON lines instead
                from tqdm import tqdm

                # The terminal's size, each dim 0 falling back to 80 x 24: a pseudo-terminal that reports
                # no size (`script`, a container's) would otherwise make tqdm draw nothing at all.
                size = shutil.get_terminal_size()
                self.bar = tqdm(total=steps, initial=start, desc="train", unit="step", ncols=size.columns,
                                nrows=size.lines)
        if log.tensorboard and not tensorboard:
            self.message(f"no TensorBoard event files: the tensorboard package is not installed (pip install "
                         f"{extras.TENSORBOARD}, or --log.tensorboard false to silence this)")

    def start(self, event: dict, header: list[str]) -> None:
        """Rank 0: the start's record (log.jsonl, TensorBoard) and its header lines."""
        self.metrics.event(event, header[-1])
        for line in header:
            self.message(line)

    def step(self, record: dict) -> None:
        if not self.rank0:
            return
        tokens = self.tokens_per_step
        record["tokens_per_s"] = tokens / record["seconds"]
        record["tflops_per_gpu"] = self.flops_per_token * tokens / record["seconds"] / self.world / 1e12
        record["mfu"] = record["tflops_per_gpu"] / self.peak if self.peak else None
        self.metrics.write(record)
        mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a (CPU)"
        loss = f"{record['loss']:.3f}" if record["loss"] is not None else "n/a (skipped)"
        figures = (f"loss {loss} | {record['tokens_per_s']:.0f} tok/s | {record['tflops_per_gpu']:.3f} TFLOP/s/rank | "
                   f"MFU {mfu} | mem {record['peak_memory_gib']:.2f} GiB")
        if self.bar is not None:
            self.bar.set_postfix_str(figures)
            self.bar.update(1)
        elif record["step"] % self.log.every == 0:  # a scheduler's log: a line (the records: log.jsonl)
            print(f"step {record['step'] + 1}/{self.steps}: {figures} | {record['seconds']:.3f} s", flush=True)

    def timing(self, record: dict, name_stragglers: bool = True) -> None:
        """Rank 0: the ranks' split of the steps (`timing.timing_record`), and a line per straggler."""
        self.metrics.write(record)
        for line in straggler_lines(record) if name_stragglers else ():
            self.message(line)

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
    held-out loss, where each segment started from, and the slowest ranks (`timing.worst_ranks`)."""
    steps, held_out, events = metrics.trajectory(run_dir)
    records = list(steps.values())
    everything = metrics.records(run_dir)
    starts = [i for i, r in enumerate(everything) if r.get("event") == "start"]  # (this run's, not an earlier one's)
    timings = [r for r in everything[starts[-1] if starts else 0:] if "timing_after_step" in r]
    return dict(first_loss=_finite(records[0]["loss"]) if records else None,
                last_loss=_finite(records[-1]["loss"]) if records else None,
                eval_loss=list(held_out.values())[-1]["eval_loss"] if held_out else None,
                steps=len(records), tokens=len(records) * tokens_per_step,
                seconds=sum(r["seconds"] for r in records),
                segments=[{k: e.get(k) for k in ("event", "step", "from", "grid")} for e in events],
                slowest_ranks=worst_ranks(timings))


def closing_line(summary: dict, run_dir: str, every: int) -> str:
    """A finished run in one line (the whole of it: summary.json; every step: log.jsonl); `every`: its
    checkpoint.every."""
    loss = (f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
            if summary.get("first_loss") is not None and summary.get("last_loss") is not None else "no finite loss")
    held_out = f", held-out {summary['eval_loss']:.4f}" if summary.get("eval_loss") is not None else ""
    saved = summary["checkpoint"] or ("none (checkpoint.every = 0)" if every == 0 else "none written (see above)")
    return (f"done: {summary['steps']} steps, {loss}{held_out}, {summary['seconds']:.1f} s; checkpoint {saved}; "
            f"records in {run_dir}/ (log.jsonl, summary.json, loss.png)")


def loss_points(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """loss.png's points, against the steps trained: ({steps: training loss}, {steps: held-out loss}); the
    step record s (0-based) comes after s + 1 steps, a held-out score after `eval_after_step` of them
    (--train.eval_every 20: at 20, 40, ...)."""
    records, evals, _ = metrics.trajectory(run_dir)
    losses = {s + 1: r["loss"] for s, r in records.items() if _finite(r["loss"]) is not None}
    return losses, {after: r["eval_loss"] for after, r in evals.items()}


def loss_curve(run_dir: Path) -> Path:
    """Plot the run's losses (`metrics.trajectory`: after a resume, the attempt that went on) to loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, held_out = loss_points(run_dir)
    steps = sorted(losses)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [losses[s] for s in steps], label="training")
    if held_out:
        ax.plot(sorted(held_out), [held_out[s] for s in sorted(held_out)], "o-", label="held-out")
        ax.legend()
    ax.set_xlabel("steps trained")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def start_event(cfg: TrainConfig, source: Path | None, skipped: list[tuple[Path, str]], start: int,
                 saved_config: dict) -> dict:
    """log.jsonl's record of this start: "resume" from a checkpoint of the run's own, else "start"
    (from scratch, model.hf's weights, or checkpoint.load's checkpoint), with where from and on what grid."""
    resume = source is not None and source.parent == cfg.checkpoint_dir
    event = {"event": "resume" if resume else "start", "step": start, "from": str(source) if source else None,
             "model": cfg.model.hf or cfg.model.preset, "grid": grid_text(cfg.to_dict()["grid"]),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if saved_config.get("grid") and grid_text(saved_config["grid"]) != event["grid"]:
        event["grid_before"] = grid_text(saved_config["grid"])
    if skipped:
        event["skipped"] = {str(path): what for path, what in skipped}
    logged = [s for s in metrics.trajectory(Path(cfg.log.run_dir))[0] if s >= start] if resume else []
    if logged:
        event["replays"] = [start, max(logged)]  # steps logged before, lost with the attempt that logged them
    return event


def header(cfg: TrainConfig, model_cfg: ModelConfig, loader: corpus.TokenLoader, tokens_path: Path, event: dict,
            device: torch.device, position: int = 0) -> list[str]:
    """Rank 0's lines at the start: what runs, where on, on what data, from where. `position`: the
    sequences of the data order trained before the first step (a resume's)."""
    source = cfg.model.hf or f"preset {cfg.model.preset}"
    windows, steps, batch, start = loader.train_sequences, cfg.train.steps, cfg.batch.global_batch, event["step"]
    sequences = position + max(0, steps - start) * batch  # a resume with another global batch: each at its own
    epochs = sequences / windows
    schedule = (f"train.steps={steps} x {batch} sequences" if position == start * batch else
                f"train.steps={steps}: {position:,} sequences before step {start}, then {batch} a step")
    named = f"{cfg.data_source()}, " if cfg.data.text or cfg.data.files else ""  # (the launcher said the bundled one)
    lines = [f"model: {model_cfg.family}, {model_cfg.layers} layers, hidden {model_cfg.hidden}, "
             f"{model_cfg.parameter_count() / 1e6:,.1f}M parameters ({source})",
             f"grid: {event['grid']} ({dist.get_world_size()} rank{'s' * (dist.get_world_size() > 1)}), "
             f"precision {str(torch_dtype(cfg.train.precision, device)).removeprefix('torch.')}",
             f"data: {named}{len(loader.tokens):,} tokens ({tokens_path}), {windows:,} training windows "
             f"of {cfg.batch.seq}: "
             f"{schedule} = {epochs:.3g} epochs"]
    if cfg.model.hf:  # what the family says of this config.json (DeepSeek-V3's multi-token prediction layers)
        hf = json.loads((Path(cfg.model.hf).expanduser() / "config.json").read_text())
        lines += [f"note: {note}" for note in family_of_hf(hf).notes(hf)]
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
