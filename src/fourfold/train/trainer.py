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
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold import checkpoint
from fourfold.config import TrainConfig, validate
from fourfold.data import corpus
from fourfold.data.prepare import packed_windows, tokens_files
from fourfold.parallel import comm
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model, local_batch
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.block import torch_dtype
from fourfold.parallel.tensor.params import Replicas
from fourfold.spec.counts import flops_per_token
from fourfold.train import elastic, expert_load, faults, timing
from fourfold.train.evaluate import evaluate
from fourfold.train.launch import StopRequest
from fourfold.train.report import Reporter, header, loss_curve, peak_memory_gib, run_summary, start_event
from fourfold.train.resume import agreed_source, generation_settings
from fourfold.train.schedule import learning_rate, schedule_changes
from fourfold.train.stop import StopAgreement, stop_message


class TrainingError(RuntimeError):
    """The run cannot go on (for example, too many non-finite losses in a row)."""


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
        world, gpu = dist.get_world_size(), dist.get_backend() == "nccl"
        # grid.elastic: on other ranks than the grid's, another grid (every rank chooses alike)
        cfg, regridded = elastic.regrid(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), gpu)
        validate(cfg, world, gpu=gpu)
        self.cfg = cfg
        self.grid = grid = Grid(cfg.layout())
        # tokenize (and pack) once; the others find it cached
        files = tokens_files(cfg.data, cfg.tokenizer) if grid.rank == 0 else None
        if files:
            packed_windows(cfg.data, cfg.batch.seq, *files)
        dist.barrier()
        tokenizer_path, tokens_path = files or tokens_files(cfg.data, cfg.tokenizer)
        self.loader = corpus.TokenLoader(tokens_path, cfg.batch.seq, cfg.batch.global_batch, seed=cfg.data.seed,
                                         packing=cfg.data.packing,
                                         windows=packed_windows(cfg.data, cfg.batch.seq, tokenizer_path, tokens_path))
        # data.attention = document: the boundaries are the tokenizer's end-of-document ids
        self.end_of_document = corpus.end_of_document(tokenizer_path) if cfg.data.attention == "document" else None
        self.model_cfg = model_cfg = cfg.model_config()  # (tokenizer and token ids were checked before launch)
        self.job = cfg.job()
        self.model = Model(grid, self.job, model_cfg, dtype=torch_dtype(cfg.train.precision, grid.device),
                           overlap=cfg.train.overlap, seed=cfg.model.seed, std=cfg.model.init_std,
                           capacity_factor=cfg.model.capacity_factor, train_padding_row=cfg.model.train_padding_row,
                           compile=cfg.train.compile)
        self.sync = GradientSync(self.model.module, grid, shard=cfg.optimizer.zero1)
        o = cfg.optimizer
        self.opt = AdamW(self.sync, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                         decay_vectors=o.decay_norms_and_biases, clip_norm=o.clip or None,
                         overlap_gather=o.overlap_param_gather)
        # Ranks holding the same parameters share their loads and saves: the dp*cp ranks, and for an
        # expert's weights under expert parallelism its replicas
        self.replicas = Replicas.of_grid(grid)
        self.start, self.position, saved_config = self._load()
        self.reporter = Reporter(cfg.log, steps=cfg.train.steps, start=self.start,
                                 tokens_per_step=cfg.batch.global_batch * cfg.batch.seq,
                                 flops_per_token=flops_per_token(model_cfg, cfg.batch.seq),
                                 world=grid.layout.world_size, config=cfg.to_dict(),
                                 peak_tflops=cfg.cluster().gpu.bf16_tflops if grid.device.type == "cuda" else None)
        if self.reporter.rank0:  # (reads log.jsonl: one rank does)
            event = start_event(cfg, self.source, self.skipped, self.start, saved_config)
            self.reporter.start(event, header(cfg, model_cfg, self.loader, tokens_path, event, grid.device,
                                              self.position))
        if regridded:
            self.reporter.message(regridded)
        changed = schedule_changes(saved_config, cfg.to_dict())
        if changed:
            self.reporter.message(f"the learning-rate schedule differs from the checkpoint's ({', '.join(changed)}): "
                                  f"from step {self.start} on the rate follows the new one")
        batch_before = saved_config.get("batch", {}).get("global_batch")
        if batch_before not in (None, cfg.batch.global_batch):
            self.reporter.message(f"batch.global_batch {batch_before} -> {cfg.batch.global_batch}: from step "
                                  f"{self.start} on each step takes {cfg.batch.global_batch} sequences, the data order "
                                  f"going on from sequence {self.position:,}, where the checkpoint left it")
        if self.start >= cfg.train.steps:
            self.reporter.message(f"the checkpoint is at step {self.start} of train.steps={cfg.train.steps}: nothing "
                                  f"to train; raise --train.steps, or start over with another --log.run_dir")
        self.saver = checkpoint.AsyncSaver() if cfg.checkpoint.async_save else None
        generation, self.pad_token_id = generation_settings(cfg.model.hf)
        self.copied = corpus.tokenizer_files(tokenizer_path) | generation
        self.loss_group = grid.loss_group()  # (made here: every rank makes its groups in one order)
        self.scale = 1.0 / (cfg.batch.global_batch * cfg.batch.seq)
        self.bad = torch.zeros((), dtype=torch.int64, device=grid.device)  # non-finite steps in a row
        self.window: list[dict] = []  # the steps not read yet, their numbers on the device
        self.places = timing.places(grid)  # (rank 0: each rank's host, local rank and coordinates)
        # CPU ranks sharing cores: the scheduler, not a rank, makes one slower; no straggler is named
        # (unless a log.straggler_margin is asked for)
        self.name_stragglers = bool(cfg.log.straggler_margin) or not timing.cores_shared(grid.device)
        if not self.name_stragglers:
            self.reporter.message(timing.SHARED_CORES)
        # (rank 0: each rank's pipeline stage, which its compute is compared within)
        self.stages = [grid.layout.coords(r)["pp"] for r in range(grid.layout.world_size)] if grid.rank == 0 else None

    def _load(self) -> tuple[int, int, dict]:
        """(the first step, the first sequence of its batch in the data order, the saved config):
        the agreed checkpoint's, or Hugging Face weights, or none."""
        cfg = self.cfg
        self.source, self.skipped = agreed_source(cfg, comm.host_group())
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
        grid.clock.step_began()
        self.opt.lr = learning_rate(cfg.optimizer, cfg.train.steps, step)
        ids = self.loader.batch_at(self.position, grid.coords["dp"], grid.size("dp"))
        self.position += cfg.batch.global_batch
        batch = local_batch(self.job, grid, ids, self.end_of_document)
        loss = self.model.step(batch, self.sync, math.nan if step in cfg.fault.nan_steps else self.scale)
        loss = comm.all_reduce(loss.double().reshape(1), self.loss_group)[0]
        # A non-finite loss, or a finite loss whose gradients overflowed, skips the update.
        updated = self.opt.step(loss_finite=torch.isfinite(loss))
        self.model.balance_experts(cfg.optimizer.balance_bias_speed, updated)
        self.bad = torch.where(updated, 0, self.bad + 1)
        grid.clock.step_ended()
        self.window.append(dict(step=step, began=began, lr=self.opt.lr, loss=loss, norm=self.opt.norm,
                                updated=updated, bad=self.bad, peak_memory_gib=peak_memory_gib(grid),
                                experts=self.model.expert_load()))

    def read_window(self) -> None:
        """Records of the window's steps, read in one host sync. Each step's seconds are the
        window's mean: without a sync per step the host cannot time one step of the GPU's. The
        non-finite count is checked here too, before any checkpoint could save after it."""
        if not self.window:
            return
        steps = len(self.window)
        splits = timing.gather(self.grid.clock.read(), self.grid)  # (rank 0's; None on the others)
        loads = self._expert_loads()  # (rank 0's, with experts)
        numbers = torch.stack([torch.stack([w["loss"], w["norm"], w["updated"].double(), w["bad"].double()])
                               for w in self.window])
        # the read's one transfer: this rank's numbers, and on rank 0 the expert loads and every rank's split
        flat = torch.cat([t.flatten() for t in (numbers, loads, splits) if t is not None]).tolist()
        numbers, rest = [flat[i: i + 4] for i in range(0, 4 * steps, 4)], flat[4 * steps:]
        per_step = loads[0].numel() if loads is not None else 0
        loads_read = [rest[i * per_step: (i + 1) * per_step] for i in range(steps)] if loads is not None else None
        if splits is not None:
            self._report_timing(timing.splits_of(rest[steps * per_step:]))
        seconds = (time.perf_counter() - self.window[0]["began"]) / len(self.window)
        for i, (w, (loss, norm, updated, in_a_row)) in enumerate(zip(self.window, numbers)):
            step, finite = w["step"], math.isfinite(loss) and math.isfinite(norm)
            # (JSON has no NaN: a non-finite loss or norm is recorded as null, with why the step was skipped)
            record = dict(step=step, loss=loss if math.isfinite(loss) else None, lr=w["lr"],
                          grad_norm=norm if finite else None, seconds=seconds, skipped=not updated,
                          peak_memory_gib=w["peak_memory_gib"])
            if loads_read is not None:
                load, experts = loads_read[i], self.model_cfg.experts + 2
                record["experts"] = expert_load.step_figures(
                    [load[j: j + experts] for j in range(0, len(load), experts)], self.model_cfg.top_k)
            if not updated:
                why = f"loss is {loss}" if not math.isfinite(loss) else "the gradient norm is not finite"
                record["skipped_because"] = why
            self.reporter.step(record)
            if not updated:
                self.reporter.message(f"step {step}: {why}; update skipped ({int(in_a_row)} in a row)")
                if in_a_row >= self.cfg.train.max_bad_steps:
                    raise TrainingError(f"{int(in_a_row)} non-finite steps in a row (last at step {step}: {why}); "
                                        f"lower optimizer.lr, check the data, or resume from an earlier checkpoint")
        self.window.clear()

    def _expert_loads(self) -> torch.Tensor | None:
        """[steps, layers, experts + 2] on rank 0: the window's routing counts of every rank summed
        over the grid (an x, y group's ranks route the same tokens: counted once); None on the
        other ranks and without experts."""
        if self.window[0]["experts"] is None:
            return None
        grid = self.grid
        summed = comm.reduce_to_first(torch.stack([w["experts"] for w in self.window]), grid.world_group())
        return summed / (grid.size("x") * grid.size("y")) if summed is not None else None

    def _report_timing(self, splits: list[dict[str, float]]) -> None:
        """Rank 0: every rank's split of the window's steps recorded, the stragglers named."""
        margin = self.cfg.log.straggler_margin or timing.DEFAULT_MARGIN[self.grid.device.type]
        self.reporter.timing(timing.timing_record(self.window[-1]["step"] + 1, len(self.window), splits,
                                                  self.places, self.stages, margin), self.name_stragglers)

    def evaluate(self, done: int) -> None:
        """The held-out loss after `done` steps, through the pipeline stages when there are."""
        self.sync.flush()  # (a pipeline's tied copy reads its table outside a forward)
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

    def save_or_go_on(self, done: int) -> bool:
        """A checkpoint after `done` steps, said; a save that could not be written stops the run, or
        with checkpoint.on_failure = continue is said and training goes on. Whether it was written."""
        try:
            self.reporter.message(f"checkpoint {self.save(done)}")
            return True
        except checkpoint.CheckpointError as err:  # (a background save's: the one before, found now)
            self._save_failed(err, f"training goes on, saving again after step {done + self.cfg.checkpoint.every}")
            return False

    def _save_failed(self, err: checkpoint.CheckpointError, then: str) -> None:
        if self.cfg.checkpoint.on_failure != "continue":
            raise TrainingError(str(err)) from None
        self.reporter.message(f"{err}; checkpoint.on_failure = continue: {then}")

    def _last_save_written(self) -> None:
        """The background save in flight ends (or fails, as a synchronous one would) before the
        process group goes away."""
        try:
            self.saver.wait()
        except checkpoint.CheckpointError as err:
            self._save_failed(err, "the run ends, its last checkpoint the one before")

    def run(self, stop: StopRequest) -> dict:
        """Steps until train.steps or an agreed stop signal, evaluating, recording and saving on
        their schedules; returns the run's summary."""
        cfg = self.cfg
        stopped, done, saved_at = None, self.start, self.start
        agreement = StopAgreement(stop)
        try:
            for step in range(self.start, cfg.train.steps):
                faults.maybe_kill(cfg.fault, cfg.log.run_dir, step)
                faults.maybe_signal(cfg.fault, cfg.log.run_dir, step)
                stopped = agreement.poll()
                if stopped:
                    break
                self.step(step)
                done = step + 1
                evaluating = cfg.train.eval_every and done % cfg.train.eval_every == 0
                saving = cfg.checkpoint.every > 0 and (done % cfg.checkpoint.every == 0 or done == cfg.train.steps)
                if evaluating or saving or done % cfg.log.every == 0:
                    self.read_window()
                if evaluating:
                    self.evaluate(done)
                if saving and self.save_or_go_on(done):
                    saved_at = done
            self.read_window()  # the steps before a stop
            agreement.finish()
            if stopped == signal.SIGTERM and saved_at != done and cfg.checkpoint.every > 0:
                self.save_or_go_on(done)
        except BaseException:  # (maybe on this rank alone: nothing collective here)
            if self.saver:
                self.saver.wait_here()
            checkpoint.wait_for_pruning()
            raise
        try:
            if self.saver:
                self._last_save_written()
        finally:
            checkpoint.wait_for_pruning()  # no old checkpoint left half deleted at exit
        if stopped:
            self.reporter.message(stop_message(cfg, stopped, done))
        self.reporter.close()
        latest = checkpoint.latest(cfg.checkpoint_dir)
        summary = dict(step=done, checkpoint=str(latest) if latest else None, stopped=stopped.name if stopped else None)
        if self.grid.rank == 0:
            summary.update(run_summary(Path(cfg.log.run_dir), cfg.batch.global_batch * cfg.batch.seq))
            summary["loss_curve"] = str(loss_curve(Path(cfg.log.run_dir)))
            (Path(cfg.log.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
        dist.barrier()
        return summary
