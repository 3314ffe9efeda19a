"""`fourfold train`: exact resume, loading onto another grid, a killed rank recovered by torchrun,
non-finite losses, its records in log.jsonl, TensorBoard and W&B, configuration errors, generation
and the sbatch script."""

import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fourfold import checkpoint, config, extras
from fourfold.config import ConfigError, load_train_config, validate
from fourfold.data import corpus
from fourfold.train.slurm import sbatch_script
from runs import prepared_corpus, train_run, whole_checkpoint

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small slice of the bundled corpus and its tokenizer, prepared once."""
    return prepared_corpus(tmp_path_factory.mktemp("data"), 300_000, 1024)


def _options(run_dir, data, *extra):
    return [*data, "--log.run_dir", str(run_dir), "--log.progress", "false", "--log.every", "1000",
            "--train.steps", str(STEPS), "--batch.global_batch", "8", "--batch.micro_batch", "2", "--batch.seq", "32",
            "--optimizer.warmup", "2", "--checkpoint.every", "3", "--checkpoint.keep", "2", *extra]


def _losses(run_dir):
    """The last logged loss of each step (a restarted run logs the replayed steps again)."""
    out = {}
    for line in (Path(run_dir) / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "event" not in record:  # (held-out records carry eval_after_step)
            out[record["step"]] = record
    return {s: r["loss"] for s, r in sorted(out.items())}, out


def _held_out(run_dir):
    """{steps done: held-out loss} of a run with train.eval_every."""
    records = [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]
    return {r["eval_after_step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def _tensorboard(run_dir):
    """{tag: [(step, value), ...]} of the TensorBoard event files of a run, as TensorBoard shows them
    (a step logged again after a restart shows once)."""
    events = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _as_float32(scalars):
    """{tag: {step: value}} as TensorBoard stores it: float32 values in step order."""
    return {tag: [(s, float(np.float32(v))) for s, v in sorted(by_step.items())] for tag, by_step in scalars.items()}


def _scalars_of_log(run_dir):
    """{tag: {step: value}} that the TensorBoard and W&B scalars must equal: each number of
    log.jsonl's last record of each step (a training field F as "train/F" at its step, a held-out
    field eval_F as "eval/F" at eval_after_step - 1, a timing record's F as "train/timing/F" at
    timing_after_step - 1, the numbers of a dict field each a tag under it), None (no MFU on CPU),
    texts and lists (the slowest ranks) left out."""
    out = {}

    def put(tag, value, step):
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{tag}/{k}", v, step)
        elif value is not None and not isinstance(value, (str, list)):
            out.setdefault(tag, {})[step] = float(value)

    for line in (Path(run_dir) / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "event" in record:  # a start or resume: TensorBoard's text, no scalar
            continue
        if "eval_after_step" in record:
            step = record.pop("eval_after_step") - 1
            tags = {f"eval/{k.removeprefix('eval_')}": v for k, v in record.items()}
        elif "timing_after_step" in record:
            step = record.pop("timing_after_step") - 1
            tags = {f"train/timing/{k}": v for k, v in record.items()}
        else:
            step = record.pop("step")
            tags = {f"train/{k}": v for k, v in record.items()}
        for tag, value in tags.items():
            put(tag, value, step)
    return out


def _train_with_fake_wandb(options):
    """train_run with a stand-in for the `wandb` module that keeps the calls the trainer makes. Its
    signatures are wandb 0.31.0's (`wandb.init`'s keywords, `Run.define_metric`, `Run.log(data, step)`,
    `Run.finish()`), so a call real wandb would refuse fails here too."""
    calls = []

    class Run:
        def define_metric(self, name, step_metric=None, step_sync=None, hidden=None, summary=None, goal=None,
                          overwrite=None):
            calls.append(["define_metric", name, step_metric])

        def log(self, data, step=None, commit=None):
            calls.append(["log", dict(data), step])

        def finish(self, exit_code=None, quiet=None):
            calls.append(["finish"])

    def init(*, project=None, name=None, dir=None, config=None, id=None, resume=None):
        calls.append(["init", dict(project=project, name=name, dir=dir, id=id, resume=resume)])
        return Run()

    fake = types.ModuleType("wandb")
    fake.init, fake.__spec__ = init, importlib.machinery.ModuleSpec("wandb", None)
    sys.modules["wandb"] = fake
    try:
        train_run(options)
    finally:
        del sys.modules["wandb"]  # (the rank's process runs later tests)
    return calls


@pytest.fixture(scope="module")
def reference(ranks, data, tmp_path_factory):
    """An uninterrupted run on dp2 x2 (sequence parallel over y is off: y=1), scoring the held-out
    tail every 3 steps (which changes no training number: the resumed runs below do not score),
    logging to a stand-in W&B whose calls are kept in wandb-calls.json."""
    run = tmp_path_factory.mktemp("reference")
    calls = ranks.run(_train_with_fake_wandb, 4, _options(run, data, "--grid.dp", "2", "--grid.x", "2",
                                                          "--train.eval_every", "3", "--log.wandb_project", "ff"))
    assert calls[1:] == [[], [], []]  # rank 0 only
    (run / "wandb-calls.json").write_text(json.dumps(calls[0]))
    return run


def test_run_learns_and_writes_everything(reference):
    losses, records = _losses(reference)
    assert list(losses) == list(range(STEPS))
    assert losses[STEPS - 1] < losses[0] - 0.5  # the loss drops visibly even in six steps
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in records.values())
    kept = checkpoint.complete(reference / "checkpoints")
    assert [p.name for p in kept] == ["step-00000003", "step-00000006"]
    assert (reference / "loss.png").stat().st_size > 1000
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["last_loss"] == losses[STEPS - 1]
    held_out = _held_out(reference)
    assert list(held_out) == [3, 6] and held_out[6] < held_out[3] and summary["eval_loss"] == held_out[6]
    # loss.png against the steps trained: the held-out scores after 3 and 6 steps at 3 and 6, not 2 and 5
    from fourfold.train.report import loss_points

    trained, scored = loss_points(reference)
    assert trained == {s + 1: loss for s, loss in losses.items()} and scored == held_out


def test_tensorboard_and_wandb_get_every_number_of_the_log(reference):
    """Each number of log.jsonl is one TensorBoard scalar (float32, as TensorBoard stores it) and one
    W&B value, at its step."""
    expected = _scalars_of_log(reference)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/seconds", "train/tokens_per_s",
            "train/tflops_per_gpu", "train/peak_memory_gib", "train/skipped", "eval/loss",
            "train/timing/median/compute", "train/timing/median/dp", "train/timing/slowest_rank"} <= set(expected)
    assert "train/mfu" not in expected and expected["eval/loss"].keys() == {2, 5}
    assert _tensorboard(reference) == _as_float32(expected)
    calls = json.loads((reference / "wandb-calls.json").read_text())
    wandb_id = (reference / "wandb-id").read_text()
    assert calls[0] == ["init", dict(project="ff", name=reference.name, dir=str(reference), id=wandb_id,
                                     resume="allow")]
    assert calls[-1] == ["finish"]
    # each kind of scalar against its own step (W&B's would drop the steps a resumed run logs again)
    assert calls[1:5] == [["define_metric", "train/step", None], ["define_metric", "train/*", "train/step"],
                          ["define_metric", "eval/step", None], ["define_metric", "eval/*", "eval/step"]]
    logged = {}
    for _, values, step in calls[5:-1]:
        assert step is None
        kind = "eval" if "eval/step" in values else "train"
        at = values.pop(f"{kind}/step")
        for tag, value in values.items():
            logged.setdefault(tag, {})[at] = value
    assert logged == expected


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_is_bitwise_equal(ranks, data, reference, tmp_path):
    """Continue from the step-3 checkpoint: steps 3..5 give exactly the uninterrupted losses, and
    the step-6 checkpoint, written in the background (checkpoint.async_save), is the reference's."""
    shutil.copytree(reference / "checkpoints" / "step-00000003", tmp_path / "checkpoints" / "step-00000003")
    ranks.run(train_run, 4, _options(tmp_path, data, "--grid.dp", "2", "--grid.x", "2",
                                     "--checkpoint.async_save", "true"))
    expected, _ = _losses(reference)
    got, _ = _losses(tmp_path)
    assert list(got) == [3, 4, 5]
    assert all(got[s] == expected[s] for s in got), (got, expected)
    mine, theirs = (whole_checkpoint(run / "checkpoints" / "step-00000006") for run in (tmp_path, reference))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_resume_with_another_global_batch_goes_on_where_the_data_stood(ranks, data, reference, tmp_path):
    """The step-3 checkpoint of a global batch of 8 has read 24 sequences: resumed with 16 per step,
    steps 3..5 read sequences 24..71 (not from 3 x 16 = 48 on, skipping 24 of them)."""
    shutil.copytree(reference / "checkpoints" / "step-00000003", tmp_path / "checkpoints" / "step-00000003")
    ranks.run(train_run, 4, _options(tmp_path, data, "--grid.dp", "2", "--grid.x", "2", "--batch.global_batch", "16"))
    meta = checkpoint.read_meta(tmp_path / "checkpoints" / "step-00000006")
    assert meta["data_position"] == 24 + 3 * 16


@pytest.mark.parametrize("grid", [["--grid.pp", "2", "--grid.y", "2", "--train.seq_parallel", "true"],
                                  ["--grid.cp", "2", "--grid.z", "2"]], ids=["pp2y2-sp", "cp2z2"])
def test_load_onto_another_grid(ranks, data, reference, tmp_path, grid):
    """A checkpoint of dp2 x2 continues on a different grid with the same losses (float32); on
    cp2 z2 the held-out loss (sequences cut into cp chunks) equals the reference's too."""
    start_at = reference / "checkpoints" / "step-00000003"
    scoring = ["--train.eval_every", "3"] if "--grid.cp" in grid else []
    ranks.run(train_run, 4, _options(tmp_path, data, *grid, *scoring, "--checkpoint.load", str(start_at)))
    expected, _ = _losses(reference)
    got, _ = _losses(tmp_path)
    assert list(got) == [3, 4, 5]
    assert got == pytest.approx({s: expected[s] for s in got}, rel=2e-5)
    start = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["from"] == str(start_at) and start["grid_before"] == "dp=2,x=2"
    if scoring:
        assert _held_out(tmp_path) == pytest.approx({6: _held_out(reference)[6]}, rel=1e-4)


def test_killed_rank_is_restarted_and_resumes(data, reference, tmp_path):
    """torchrun restarts the job after rank 1 dies at step 4; it resumes from step 3 and the
    losses of every step equal the uninterrupted run's. log.jsonl marks the restart and the step it
    replays (logged by the first attempt, each step read at once: log.every 1), summary.json
    covers both segments, TensorBoard shows the resume as a text."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fourfold.cli.main", "train", "--nproc-per-node", "4", "--max-restarts", "1",
           *_options(tmp_path, data, "--grid.dp", "2", "--grid.x", "2", "--fault.kill_rank", "1",
                     "--fault.kill_step", "4", "--log.every", "1")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / ".fault-injected").exists()  # the rank really died once
    # one line a rank, no traceback: torchrun's for the one that died, the others' own (each a
    # collective whose peer was gone; before: 140 lines of gloo tracebacks)
    lines = done.stderr.splitlines()
    assert "fourfold: local rank 1 failed (signal SIGKILL)" in lines and "Traceback" not in done.stderr
    assert all(re.fullmatch(r"fourfold: rank [023] stopped: another rank is gone \(torchrun's line names it\)", line)
               for line in lines if line != "fourfold: local rank 1 failed (signal SIGKILL)"), lines
    expected, _ = _losses(reference)
    got, _ = _losses(tmp_path)
    assert got == expected
    assert f"start: resumed {tmp_path / 'checkpoints' / 'step-00000003'} at step 3" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    records = [r for r in records if "timing_after_step" not in r]  # (the ranks' timing: test_timing.py)
    events = [r for r in records if "event" in r]
    assert [(e["event"], e["step"], e["from"]) for e in events] == [
        ("start", 0, None), ("resume", 3, str(tmp_path / "checkpoints" / "step-00000003"))]
    assert events[1]["replays"] == [3, 3] and records.index(events[1]) == 5  # after steps 0-3 of the first attempt
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_loss"] == expected[0] and summary["last_loss"] == expected[STEPS - 1]
    assert summary["steps"] == STEPS and [s["event"] for s in summary["segments"]] == ["start", "resume"]
    tensorboard = EventAccumulator(str(tmp_path / "tensorboard"))
    tensorboard.Reload()
    assert [e.step for e in tensorboard.Tensors("run/events/text_summary")] == [0, 3]
    # TensorBoard hides the first attempt's step 3, logged again after the restart: each step once, its last entry
    assert _tensorboard(tmp_path) == _as_float32(_scalars_of_log(tmp_path))


def test_non_finite_loss_skips_the_step(ranks, data, tmp_path):
    """The skip is decided on the device; the records, read every log.every (4) steps and at each
    checkpoint (3), say which step it was."""
    ranks.run(train_run, 2, _options(tmp_path, data, "--grid.dp", "2", "--fault.nan_steps", "2", "--log.every", "4"))
    _, records = _losses(tmp_path)
    assert list(records) == list(range(STEPS))
    assert records[2]["skipped"] and records[2]["grad_norm"] is None and records[2]["loss"] is None
    assert records[2]["skipped_because"] == "loss is nan"
    assert not any(records[s]["skipped"] for s in records if s != 2)
    # (a run of them that stops the run: tests/cli/test_first_hour.py, through the command)


def test_checkpoints_can_be_turned_off(ranks, data, tmp_path):
    """checkpoint.every 0: the run trains every step and writes no checkpoint, not even at the end."""
    summary = ranks.run(train_run, 1, _options(tmp_path, data, "--checkpoint.every", "0"))[0]
    assert summary["step"] == STEPS and checkpoint.latest(tmp_path / "checkpoints") is None
    assert not (tmp_path / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"checkpoint.every must be >= 0 \(0: no checkpoints\), not -1"):
        validate(load_train_config(None, ["--checkpoint.every", "-1"]), 1)


@pytest.fixture
def small_disk(tmp_path):
    """A real size-limited filesystem: a 30 MiB tmpfs (mounting needs root, as CI runs), room for one
    checkpoint of the test model (22 MiB) and not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_fails_the_save_in_one_line_and_loses_nothing(ranks, data, reference, small_disk, tmp_path):
    """The step-6 save finds the disk full: one line naming the directory, no traceback, its partial
    files removed, step 3 intact and resuming bitwise; with checkpoint.on_failure = continue the run
    trains on and says so."""
    grid = ["--grid.dp", "2", "--grid.x", "2", "--checkpoint.dir", str(small_disk)]
    command = [sys.executable, "-m", "fourfold.cli.main", "train", *_options(tmp_path / "run", data, *grid)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1
    said = f"fourfold: error: checkpoint step-00000006 could not be written in {small_disk}: the disk is full ("
    assert done.stderr.count(said) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-00000003"]  # no partial directory left
    shutil.copytree(small_disk, tmp_path / "roomy")  # where there is room: the last checkpoint resumes bitwise
    roomy = str(tmp_path / "roomy")
    ranks.run(train_run, 4, _options(tmp_path / "resumed", data, *grid[:4], "--checkpoint.dir", roomy))
    assert _losses(tmp_path / "resumed")[0] == {s: _losses(reference)[0][s] for s in (3, 4, 5)}
    goes_on = ranks.run(train_run, 4, _options(tmp_path / "goes-on", data, *grid,
                                               "--checkpoint.on_failure", "continue"))
    assert goes_on[0]["step"] == STEPS and sorted(p.name for p in small_disk.iterdir()) == ["step-00000003"]
    # a background save fails alike: found when it is waited for (here at the run's end), one line,
    # no partial directory left
    background = [*_options(tmp_path / "background", data, *grid), "--checkpoint.async_save", "true"]
    with pytest.raises(AssertionError, match=said.removeprefix("fourfold: error: ").replace("(", r"\(")):
        ranks.run(train_run, 4, background)
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-00000003"]
    goes_on = ranks.run(train_run, 4, [*background, "--checkpoint.on_failure", "continue"])
    assert goes_on[0]["step"] == STEPS and sorted(p.name for p in small_disk.iterdir()) == ["step-00000003"]


def test_failed_save_keeps_the_last_good_checkpoint(ranks, data, reference, tmp_path):
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / ".step-00000009.partial").mkdir()  # a crash during a save left this
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step-00000006"
    with pytest.raises(AssertionError, match="disk full"):
        ranks.run(_save_fails, 2, str(tmp_path / "checkpoints"))
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step-00000006"
    assert checkpoint.read_meta(tmp_path / "checkpoints" / "step-00000006")["step"] == 6


def _save_fails(root):
    import torch

    from fourfold.models.config import load_config
    from fourfold.parallel.grid import Grid
    from fourfold.parallel.transformer import Transformer
    from fourfold.spec.layout import Layout

    model = Transformer(Grid(Layout(dp=2)), load_config("tiny-llama"))

    def full_disk(*args, **kwargs):
        raise OSError("disk full")

    real, checkpoint.dcp.save = checkpoint.dcp.save, full_disk
    try:
        checkpoint.save(root, 9, model, None, {}, keep=1)
    finally:
        checkpoint.dcp.save = real
    return torch.zeros(1)


def test_generate_from_checkpoint(reference):
    from fourfold.train.generate import generate

    greedy = generate(reference / "checkpoints", "In the beginning", max_new_tokens=8)
    assert greedy.startswith("In the beginning") and len(greedy) > len("In the beginning")
    assert generate(reference / "checkpoints", "In the beginning", max_new_tokens=8) == greedy
    sampled = [generate(reference / "checkpoints", "And God said", 8, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    with pytest.raises(ValueError, match=r"--max-new-tokens 600 after the prompt's \d tokens passes the model's 512 "
                                         r"positions; give --max-new-tokens 50\d or less, or a shorter prompt"):
        generate(reference / "checkpoints", "In the beginning", 600)


def test_config_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown key optimizer.learning_rate .*; \\[optimizer\\] takes"):
        load_train_config(None, ["--optimizer.learning_rate", "1"])
    with pytest.raises(ConfigError, match="optimizer.lr takes a float"):
        load_train_config(None, ["--optimizer.lr", "fast"])
    with pytest.raises(ConfigError, match="unknown section"):
        bad = tmp_path / "bad.toml"
        bad.write_text("[optimiser]\nlr = 1.0\n")
        load_train_config(str(bad))
    cfg = load_train_config(None, ["--grid.dp", "2", "--grid.x", "2"])
    with pytest.raises(ConfigError, match="needs 4 processes, but 8 are asked for"):
        validate(cfg, 8)
    cases = [
        (["--grid.dp", "3"], 3, "batch.global_batch=16 must be a multiple of dp\\*micro_batch"),
        (["--grid.z", "4", "--batch.micro_batch", "2", "--grid.dp", "1"], 4, "must be divisible by z=4"),
        (["--grid.cp", "3"], 3, "cut into 2\\*cp=6"),
        (["--grid.pp", "3"], 3, "2 layers cannot fill 3 pipeline stages"),
        (["--grid.pp", "2", "--batch.global_batch", "2"], 2, "at least pp=2 micro-batches"),
        (["--model.preset", "no-such-model"], 1, "model:"),
        (["--train.recompute", "some"], 1, "recompute 'some' is unknown; use one of"),
        (["--data.text", "no/such/corpus.txt"], 1, "data.text names no/such/corpus.txt, which is not a file"),
        (["--data.tokens", __file__], 1, "data.tokens needs data.tokenizer"),
        # a lower lr under the default min_lr would make the cosine "decay" climb
        (["--optimizer.lr", "1e-4"], 1, "optimizer.min_lr=0.0003 is outside \\[0, optimizer.lr=0.0001\\]: the rate "
                                        "would rise as it decays; set --optimizer.min_lr 1e-05"),
        (["--optimizer.lr", "-1"], 1, "optimizer.lr=-1.0 must be > 0"),
        (["--optimizer.beta1", "1.5", "--optimizer.warmup", "-2"], 1,
         "(?s)warmup=-2 must be >= 0.*beta1=1.5 must be in"),
        (["--optimizer.weight_decay", "-0.1"], 1, "optimizer.weight_decay=-0.1 must be >= 0"),
        (["--train.fp8", "e4m3"], 1, "fp8 'e4m3' is not a recipe; use tensorwise or rowwise"),
    ]
    hf = tmp_path / "hf"  # a Hugging Face directory without its tokenizer.json
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, max_position_embeddings=256)))
    cases += [
        (["--model.hf", "no/such/dir"], 1, "model.hf names no/such/dir, which is not a directory"),
        (["--model.hf", str(hf)], 1, "has no tokenizer.json, and a tokenizer trained on the corpus would not match"),
    ]
    for overrides, world, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(load_train_config(None, overrides), world)
    fp8 = load_train_config(None, ["--train.fp8", "rowwise"])
    validate(fp8, 1)  # (emulated on CPU)
    monkeypatch.setattr(extras, "installed", lambda package: package != "torchao")
    with pytest.raises(ConfigError, match="train.fp8 needs torchao, which is not installed: pip install torchao=="):
        validate(fp8, 1)
    monkeypatch.undo()
    monkeypatch.setattr(config, "_gpus_take_fp8", lambda: False)
    with pytest.raises(ConfigError, match="this GPU has no FP8 tensor cores .*use --train.fp8 '' \\(bf16\\)"):
        validate(fp8, 1, gpu=True)
    compiled = load_train_config(None, ["--train.compile", "true"])
    monkeypatch.setenv("CXX", sys.executable)  # (any program found on PATH passes the check)
    validate(compiled, 1)
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match="train.compile on CPU needs a C\\+\\+ compiler, and no-such-compiler"):
        validate(compiled, 1)


def test_cli_rejects_a_bad_config_before_starting_processes():
    done = subprocess.run([sys.executable, "-m", "fourfold.cli.main", "train", "--grid.dp", "3", "--nproc-per-node",
                           "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "must be a multiple of dp*micro_batch" in done.stderr


def test_sbatch_script_quotes_every_user_value(tmp_path):
    config = str(tmp_path / "my runs; rm -rf $HOME" / "cfg.toml")
    text = sbatch_script(config, ["--log.run_dir", "out dir/$(whoami)"], nodes=4, gpus_per_node=8, cpus_per_task=64,
                         run_dir="/runs/a b", workdir="/home/me/$HOME", job_name="a b", partition="gpu")
    assert "'" + config + "'" in text and "'out dir/$(whoami)'" in text and "--chdir='/home/me/$HOME'" in text
    assert "#SBATCH --nodes=4" in text and "--nproc-per-node=8" in text and '"--rdzv-endpoint=$HEAD:$PORT"' in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_eval_a_checkpoint_on_another_grid(ranks, reference, data, tmp_path):
    """`fourfold eval --checkpoint` on x2 (the pool's ranks) and `fourfold eval RUN --text` (the
    command through torchrun) give the loss the same checkpoint gives on one rank."""
    import numpy as np
    import torch.distributed as dist

    from fourfold.models.config import ModelConfig
    from fourfold.parallel.grid import Grid
    from fourfold.parallel.model import Model
    from fourfold.spec.job import Job
    from fourfold.spec.layout import Layout
    from fourfold.testing import eval_command
    from fourfold.train.evaluate import evaluate
    from fourfold.train.generate import _single_process_group

    _, tokens_path = corpus.prepare(data[1], 1024, data[5])
    tokens = np.load(tokens_path)[:2000]
    np.save(tmp_path / "val.npy", tokens)
    on_x2 = ["--checkpoint", str(reference / "checkpoints"), "--tokens", str(tmp_path / "val.npy"), "--seq", "32",
             "--batch", "4", "--grid", "x=2"]
    parallel = ranks.run(eval_command, 2, on_x2)[0]
    # the text itself, tokenized by eval with the checkpoint's tokenizer (the command end to end,
    # through torchrun): the same first windows
    done = subprocess.run([sys.executable, "-m", "fourfold.cli.main", "eval", str(reference / "checkpoints"), "--text",
                           data[1], "--cache-dir", str(tmp_path / "cache"), "--max-tokens", str(62 * 32), "--seq", "32",
                           "--batch", "4", "--json"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    from_text = json.loads(done.stdout.strip().splitlines()[-1])
    path = checkpoint.latest(reference / "checkpoints")
    _single_process_group()
    model = Model(Grid(Layout()), Job(micro_batch=4, global_batch=4, seq=32),
                  ModelConfig.from_dict(checkpoint.read_meta(path)["model"]), dtype=torch.float32)
    checkpoint.load_checkpoint(path, model.module)
    serial = evaluate(model, tokens, 32, 4)
    capped = evaluate(model, tokens, 32, 4, max_tokens=10 * 32 + 5)  # 10 whole windows
    head = evaluate(model, tokens[: 10 * 32 + 1], 32, 4)
    dist.destroy_process_group()
    assert parallel["tokens"] == serial["tokens"] and parallel["loss"] == pytest.approx(serial["loss"], rel=1e-5)
    assert from_text["tokens"] == serial["tokens"] == 62 * 32 and from_text["loss"] == pytest.approx(serial["loss"],
                                                                                                      rel=1e-5)
    assert capped == head and capped["tokens"] == 320 and capped["loss"] != serial["loss"]


def test_eval_windows_are_read_a_batch_at_a_time():
    import numpy as np

    from fourfold.train.evaluate import window_count, windows

    tokens = np.arange(50, dtype=np.uint16)
    whole = windows(tokens, 8, range(window_count(len(tokens), 8)))
    assert whole.shape == (6, 9) and whole[:, 0].tolist() == [0, 8, 16, 24, 32, 40] and whole[-1, -1] == 48
    np.testing.assert_array_equal(windows(tokens, 8, range(1, 6, 2)), whole[1:6:2])
    assert windows(tokens, 8, range(6, 6)).shape == (0, 9)
    with pytest.raises(ValueError, match=r"holds no window of --seq 8 \+ 1; use a smaller --seq"):
        window_count(8, 8)


def test_auto_grid_takes_a_planner_candidate_this_run_can_use():
    from fourfold.cli.train import resolve_auto_grid

    cfg = load_train_config(None, ["--grid.auto", "true", "--batch.seq", "128"])
    chosen = resolve_auto_grid(cfg, 8)
    assert not cfg.grid.auto and cfg.layout().world_size == 8
    assert cfg.layout() == chosen.layout and cfg.job() == chosen  # the planner's job, as it is
    validate(cfg, 8)  # the chosen grid passes every check


def test_the_run_starts_from_its_own_latest_checkpoint_then_from_checkpoint_load(tmp_path):
    """Running the same command again (or a torchrun restart) continues from the run's own latest
    checkpoint, not from checkpoint.load again; checkpoint.load may name a run's checkpoint
    directory; a checkpoint of another model is refused before launch, naming the fix."""
    import dataclasses as dc

    from fourfold.train.resume import check_checkpoint, checkpoint_source

    def fake_checkpoint(root, step, **model_changes):
        path = root / f"step-{step:08d}"
        path.mkdir(parents=True)
        model = dc.replace(load_train_config(None).model_config(), **model_changes)
        (path / checkpoint.META).write_text(json.dumps({"step": step, "model": dc.asdict(model)}))
        (path / ".metadata").touch()  # (a checkpoint without a manifest, as before manifests: its DCP metadata)
        return path

    start = fake_checkpoint(tmp_path / "pretrained" / "checkpoints", 4)
    options = ["--log.run_dir", str(tmp_path / "run"), "--checkpoint.load",
               str(tmp_path / "pretrained" / "checkpoints")]
    cfg = load_train_config(None, options)
    assert checkpoint_source(cfg) == (start, [])  # the run has none of its own yet; a run's directory: its latest
    check_checkpoint(cfg)
    own = fake_checkpoint(tmp_path / "run" / "checkpoints", 6, rope_theta=5e5, max_positions=128)
    assert checkpoint_source(cfg) == (own, [])
    # settings that shape no tensor may change (a long-context extension): reported, not refused
    assert check_checkpoint(cfg) == ["max_positions 128 there, 512 here", "rope_theta 500000.0 there, 10000.0 here"]
    assert checkpoint_source(load_train_config(None, [*options, "--checkpoint.resume", "false"])) == (start, [])
    fake_checkpoint(tmp_path / "run" / "checkpoints", 8, hidden=96)  # (the default model has 128)
    with pytest.raises(ConfigError, match=r"holds another model \(hidden 96 there, 128 here\): give another "
                                          r"--log.run_dir, or --checkpoint.resume false, to start anew"):
        check_checkpoint(cfg)
    missing = load_train_config(None, ["--log.run_dir", str(tmp_path / "new"), "--checkpoint.load",
                                       str(tmp_path / "x")])
    with pytest.raises(ConfigError, match="checkpoint.load .*x does not exist; give a step-N directory"):
        check_checkpoint(missing)
    (tmp_path / "x").mkdir()
    with pytest.raises(ConfigError, match=r"checkpoint.load .*x is not a fourfold checkpoint \(no meta.json, no "
                                          r"step-N"):
        check_checkpoint(missing)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


DAMAGES = {  # how the latest checkpoint is damaged, and what the check before launch finds
    "missing shard": (lambda step: (step / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "missing metadata": (lambda step: (step / ".metadata").unlink(), ".metadata is missing"),
    "truncated shard": (lambda step: _truncate(step / "__0_0.distcp"),
                        r"__0_0.distcp has \d+ bytes, not the \d+ written"),
}


def _damaged_copy(reference, tmp_path, how):
    """The reference run's checkpoints with the latest one damaged `how`: (latest, the intact step 3)."""
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    damaged, intact = tmp_path / "checkpoints" / "step-00000006", tmp_path / "checkpoints" / "step-00000003"
    DAMAGES[how][0](damaged)
    return damaged, intact


@pytest.mark.parametrize("how", list(DAMAGES))
def test_a_damaged_checkpoint_load_is_refused_before_any_rank_starts(data, reference, tmp_path, how, monkeypatch,
                                                                      capsys):
    """The latest checkpoint damaged three ways: `checkpoint.load` of it is refused before any rank
    starts, naming what is missing and the intact one."""
    from fourfold.cli.main import main

    damaged, intact = _damaged_copy(reference, tmp_path, how)

    def launched(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr("fourfold.cli.train.relaunch_with_torchrun", launched)
    options = _options(tmp_path / "elsewhere", data, "--grid.dp", "2", "--grid.x", "2")
    for named in (damaged, tmp_path / "checkpoints"):  # the step-N directory, or the run's directory (its latest)
        assert main(["train", *options, "--checkpoint.load", str(named)]) == 2
        err = capsys.readouterr().err
        found = DAMAGES[how][1]
        assert re.search(f"fourfold: error: checkpoint.load: the checkpoint {damaged} is damaged \\({found}\\): "
                         f"copy it again, or --checkpoint.load {intact}, the newest intact one", err), err


def test_a_resume_passes_over_a_damaged_latest_checkpoint(data, reference, tmp_path):
    """The run's own resume continues from the intact step-3 instead of a latest checkpoint missing a
    shard, says so in one line, and trains the uninterrupted run's losses. (Each kind of damage is
    found by `checkpoint.damage`, and a changed byte by the ranks: tests/checkpoint/test_checkpoint_verify.py.)"""
    damaged, intact = _damaged_copy(reference, tmp_path, "missing shard")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "fourfold.cli.main", "train", "--nproc-per-node", "4",
                           *_options(tmp_path, data, "--grid.dp", "2", "--grid.x", "2")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if "step-00000006 (" in line]
    assert len(said) == 1 and re.fullmatch(f"start: resumed {intact} at step 3; the newest intact checkpoint, passing "
                                           f"over 1 damaged: step-00000006 \\({DAMAGES['missing shard'][1]}\\)",
                                           said[0]), done.stdout
    assert "Traceback" not in done.stderr
    expected, _ = _losses(reference)
    got, _ = _losses(tmp_path)
    assert got == {s: expected[s] for s in (3, 4, 5)}
    assert checkpoint.damage(damaged) == ""  # written again by the resumed run


def test_the_header_names_the_data_the_run_trains_on():
    """With no data flag the run trains on the bundled corpus: the header says so by name, not by a cache path."""
    from fourfold.config import load_train_config

    assert load_train_config(None, []).data_source().startswith("the bundled King James Bible (no --data.text")
    named = load_train_config(None, ["--data.files", "web/*.jsonl,code.parquet", "--data.tokens", "t.npy"])
    assert named.data_source() == "web/*.jsonl,code.parquet"  # (the launcher hands the ranks its token file)
