"""Where a training run's numbers go. Rank 0 hands each record (a training step's, or a held-out
score's) to `Metrics.write`, which appends it to RUN/log.jsonl and writes each of its numbers as
one scalar to TensorBoard (RUN/tensorboard) and to Weights & Biases, when they are on.

Each line of log.jsonl says what it is in its "kind": "step", "eval", "timing" or "event" (`kind`).
A training record's field F is the scalar "train/F" at its "step"; a held-out record's field
eval_F is "eval/F" at the index of the last step it follows (eval_after_step - 1; loss.png plots
both against the steps trained, the step record's step + 1 and eval_after_step); a timing record's
field F (the ranks' split of the steps before `timing_after_step`, `train.timing`) "train/timing/F"
there too. A field holding a dict is a scalar per number in it
(a mixture's "experts/layer0/max"). A skipped step's `skipped` is 1, and a None (no MFU on CPU, a
skipped step's non-finite loss: log.jsonl is strict JSON), a text (`skipped_because`) or a list
(the slowest ranks) is no scalar.

Each start of the trainer, the first or a resume, writes an event record first ({"event": "start"
or "resume", "step": N, "from": the checkpoint, "grid", ...}; in TensorBoard a text at step N under
"run/events"). log.jsonl is only appended to, never rewritten: the records of steps >= N written
before a resume at step N belong to an attempt that was lost (its work after the checkpoint), and
the resume's record marks them so (its "replays": the first and last of them); `trajectory` reads
the run as it counts, each step's record from the attempt that went on. Appending keeps what the
lost attempt logged (a loss spike that made someone stop it) and never puts a large log at risk.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path


def kind(record: dict) -> str:
    """What a record is, which log.jsonl says in its "kind" field: "step", "eval", "timing" or "event"."""
    if "event" in record:
        return "event"
    return "eval" if "eval_after_step" in record else "timing" if "timing_after_step" in record else "step"


def scalars(record: dict) -> tuple[int, dict[str, float]]:
    """(step, {tag: value}) of a log.jsonl record; a field holding a dict is a tag per number in it
    ("train/experts/layer0/max"), a list (the slowest ranks) none."""
    if "eval_after_step" in record:
        step, prefix = record["eval_after_step"] - 1, "eval/"
        values = {k.removeprefix("eval_"): v for k, v in record.items() if k != "eval_after_step"}
    elif "timing_after_step" in record:  # the ranks' split of the steps before it: at the last of them
        step, prefix = record["timing_after_step"] - 1, "train/timing/"
        values = {k: v for k, v in record.items() if k != "timing_after_step"}
    else:
        step, prefix = record["step"], "train/"
        values = {k: v for k, v in record.items() if k != "step"}
    return step, _numbers(values, prefix)


def _numbers(values: dict, prefix: str) -> dict[str, float]:
    out = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)):  # (bool too: a skipped step's 1)
            out[prefix + k] = float(v)
    return out


class Metrics:
    """Rank 0's writers: log.jsonl always; TensorBoard event files with `tensorboard`; a W&B run in
    `wandb_project` when one is named (the trainer checked before launch that wandb is installed)."""

    def __init__(self, run_dir: Path, *, start: int, tensorboard: bool, wandb_project: str = "",
                 config: dict | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "log.jsonl", "a")
        self.tensorboard = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A run resumed at `start` logs the steps after its checkpoint again: TensorBoard hides the
            # earlier events of those steps, as loss.png keeps the last entry of each step.
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start)
        if wandb_project:
            import wandb

            # One W&B run per run directory: a resumed or restarted run continues it.
            id_file = run_dir / "wandb-id"
            if not id_file.exists():
                id_file.write_text(uuid.uuid4().hex[:12])
            self.wandb = wandb.init(project=wandb_project, name=run_dir.name, dir=str(run_dir), config=config,
                                    id=id_file.read_text(), resume="allow")
            # Each kind of scalar against a step of its own, logged with it: W&B's own step only
            # grows, and would drop the steps a resumed run logs again.
            for kind in ("train", "eval"):
                self.wandb.define_metric(f"{kind}/step")
                self.wandb.define_metric(f"{kind}/*", step_metric=f"{kind}/step")

    def event(self, record: dict, text: str) -> None:
        """A record of the run's own (a start, a resume), and `text` saying it in TensorBoard."""
        self.jsonl.write(json.dumps({"kind": kind(record), **record}) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            self.tensorboard.add_text("run/events", text, record["step"])
            self.tensorboard.flush()

    def write(self, record: dict) -> None:
        # strict JSON (no NaN, no Infinity: a parser may refuse them): a non-finite number is null
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.jsonl.write(json.dumps({"kind": kind(record), **record}, allow_nan=False) + "\n")
        self.jsonl.flush()
        step, values = scalars(record)
        if self.tensorboard is not None:
            for tag, value in values.items():
                self.tensorboard.add_scalar(tag, value, step)
            self.tensorboard.flush()  # in step with log.jsonl should the process be killed
        if self.wandb is not None:
            prefix = "eval" if "eval_after_step" in record else "train"
            self.wandb.log({**values, f"{prefix}/step": step})

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def records(run_dir: Path) -> list[dict]:
    """The records of RUN/log.jsonl (none if there is none); a line cut short by a killed process is left out."""
    path = run_dir / "log.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def trajectory(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict], list[dict]]:
    """The run as it counts, from log.jsonl: ({step: its record}, {eval_after_step: the held-out
    record}, the start and resume events in order). A resume at step N drops the records of steps
    >= N before it (an attempt whose work was lost); a start (at step 0, or from another run's
    checkpoint) drops what came before it in the file too (an earlier run in this directory)."""
    steps, held_out, events = {}, {}, []
    for record in records(run_dir):
        if "event" in record:
            cut = record["step"] if record["event"] == "resume" else -1
            steps = {s: r for s, r in steps.items() if s < cut}
            held_out = {s: r for s, r in held_out.items() if s <= cut}
            events = (events if record["event"] == "resume" else []) + [record]
        elif "eval_after_step" in record:
            held_out[record["eval_after_step"]] = record
        elif "step" in record:
            steps[record["step"]] = record
    return dict(sorted(steps.items())), dict(sorted(held_out.items())), events
