"""A user's first hour (issue 19): data mistakes caught before launch, the SLURM script, a clean stop
on SIGTERM/SIGINT, a changed schedule on resume, `train --help`, and the README's walk-through from
a checkpoint to a Hugging Face directory and a fine-tuning run from it."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from fourfold import checkpoint
from fourfold.cli.main import main
from fourfold.config import TrainConfig
from fourfold.data import corpus

STEPS = 6
EXAMPLE = Path(__file__).parents[2] / "examples" / "llama3-8b-8gpu.toml"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A slice of the bundled corpus, tokenized once (vocabulary 512): the options and the files."""
    folder = tmp_path_factory.mktemp("data")
    text = folder / "genesis.txt"
    text.write_text(corpus.bundled_text()[:100_000])
    tokenizer, tokens = corpus.prepare(str(text), 512, str(folder / "cache"))
    options = ["--data.text", str(text), "--data.vocab", "512", "--data.cache_dir", str(folder / "cache")]
    return dict(options=options, tokenizer=tokenizer, tokens=tokens, folder=folder)


def _options(run_dir, *extra):
    return ["--log.run_dir", str(run_dir), "--log.progress", "false", "--log.every", "1000", "--train.steps",
            str(STEPS),
            "--batch.global_batch", "8", "--batch.micro_batch", "2", "--batch.seq", "32", "--optimizer.warmup", "2",
            "--checkpoint.every", "100", *extra]


def _fourfold(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fourfold.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture
def no_launch(monkeypatch):
    """`fourfold train` must fail before it starts torchrun."""
    def launched(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr("fourfold.cli.train.relaunch_with_torchrun", launched)


def _error(capsys, argv) -> str:
    """The one error line of a command that must fail with status 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("fourfold: error:") == 1, err
    return err


# ----- data against the model, before launch -----------------------------------------------------

def test_token_range_reads_a_file_chunk_by_chunk(tmp_path):
    ids = np.array([7, 3, 9, 0, 4, 12, 5], dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids)
    assert corpus.token_range(tmp_path / "t.npy", chunk=2) == (0, 12)  # the extremes sit in different chunks
    np.save(tmp_path / "f.npy", ids.astype(np.float32))
    with pytest.raises(ValueError, match="not a 1-D array of integer ids"):
        corpus.token_range(tmp_path / "f.npy")


def test_train_checks_tokenizer_and_token_ids_against_the_model_before_launch(data, tmp_path, no_launch, capsys):
    small = tmp_path / "small-llama.json"  # tiny-llama with a 256-token vocabulary
    config = json.loads((Path(corpus.__file__).parents[1] / "models/presets/tiny-llama.json").read_text())
    small.write_text(json.dumps(dict(config, vocab_size=256)))
    user_files = ["--data.tokens", str(data["tokens"]), "--data.tokenizer", str(data["tokenizer"])]
    err = _error(capsys, ["train", "--model.preset", str(small), *user_files])
    assert "has 512 tokens, more than the model's vocabulary of 256; give the model's own tokenizer" in err
    folder = tmp_path / "hub-tokenizer"  # a Hugging Face directory stands for its tokenizer.json
    folder.mkdir()
    shutil.copy(data["tokenizer"], folder / "tokenizer.json")
    err = _error(capsys, ["train", "--model.preset", str(small), "--data.tokens", str(data["tokens"]),
                          "--data.tokenizer", str(folder)])
    assert "has 512 tokens, more than the model's vocabulary of 256; give the model's own tokenizer" in err
    (folder / "tokenizer.json").unlink()
    err = _error(capsys, ["train", "--data.tokens", str(data["tokens"]), "--data.tokenizer", str(folder)])
    assert f"data.tokenizer names {folder / 'tokenizer.json'}, which is not a file" in err
    err = _error(capsys, ["train", "--model.preset", str(small), *data["options"]])
    assert "data.vocab=512 is larger than the model's vocabulary of 256" in err and "set data.vocab <= 256" in err
    np.save(tmp_path / "ids.npy", np.array([1, 2, 5000, 3], dtype=np.uint16))
    err = _error(capsys, ["train", "--data.tokens", str(tmp_path / "ids.npy"), "--data.tokenizer",
                          str(data["tokenizer"])])
    assert ("holds id 5000, outside the model's vocabulary [0, 4096); tokenize the data with the model's "
            "tokenizer") in err
    (tmp_path / "text.npy").write_text("not numpy")
    err = _error(capsys, ["train", "--data.tokens", str(tmp_path / "text.npy"), "--data.tokenizer",
                          str(data["tokenizer"])])
    assert "give a .npy file of token ids" in err


def test_eval_names_its_own_flag(capsys, tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, max_position_embeddings=64)))
    err = _error(capsys, ["eval", "--hf", str(tmp_path / "hf"), "--tokens", str(tmp_path / "t.npy"), "--seq", "80"])
    assert "--seq 80 is longer than" in err and "batch.seq" not in err  # eval's own flag


# ----- fourfold slurm ------------------------------------------------------------------------------

def test_slurm_grid_against_nodes_names_both_fixes(capsys):
    err = _error(capsys, ["slurm", str(EXAMPLE), "--nodes", "4", "--gpus-per-node", "8"])
    assert "has 8 ranks, but --nodes 4 x --gpus-per-node 8 give 32 GPUs" in err
    assert "change the grid so that dp*pp*cp*x*y*z = 32 (e.g. --grid.dp 8)" in err
    assert "or --nodes/--gpus-per-node so that they give 8 GPUs (--nodes 1)" in err
    assert "started" not in err


def _fake_slurm(folder: Path) -> dict:
    """`scontrol` and `srun` stand-ins on PATH: scontrol lists the nodes, srun prints each argument
    on its own line, and the environment the ranks would get."""
    folder.mkdir()
    # a long node list, as a large job's is: a reader that stops at the first line breaks scontrol's pipe
    (folder / "scontrol").write_text('#!/bin/bash\nfor i in $(seq 17 3000); do echo "gpu-node-$i"; done\n')
    (folder / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n'
                                 'echo "OMP=$OMP_NUM_THREADS NCCL_DEBUG=$NCCL_DEBUG PWD=$PWD"\n')
    for tool in ("scontrol", "srun"):
        (folder / tool).chmod(0o755)
    return dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}", SLURM_JOB_ID="123456",
                SLURM_JOB_NODELIST="gpu-node-[17-18]", SLURM_CPUS_PER_TASK="64")


def test_slurm_script_runs_unchanged_on_a_cluster(tmp_path, monkeypatch):
    submit = tmp_path / "submit here"
    submit.mkdir()
    monkeypatch.chdir(submit)
    odd = "out/$(whoami) x"
    assert main(["slurm", str(EXAMPLE), "--nodes", "2", "--gpus-per-node", "8", "--grid.dp", "4", "--output",
                 "job.sbatch",
                 "--log.run_dir", "my runs/8b", "--checkpoint.dir", odd, "--partition", "gpu"]) == 0
    script = (submit / "job.sbatch").read_text()
    run_dir = submit / "my runs" / "8b"
    assert run_dir.is_dir()  # SLURM opens the output files there before the job starts
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=64", "#SBATCH --exclusive", "#SBATCH --signal=TERM@300",
                 f"#SBATCH --chdir='{submit}'", f"#SBATCH --output='{run_dir}/slurm-%j.out'",
                 f"#SBATCH --error='{run_dir}/slurm-%j.err'", "#SBATCH --partition=gpu",
                 "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}", "# export NCCL_SOCKET_IFNAME=ib0",
                 "# export NCCL_IB_HCA=mlx5"]:
        assert line in script.splitlines(), line
    assert subprocess.run(["bash", "-n", "job.sbatch"]).returncode == 0
    ran = subprocess.run(["bash", str(submit / "job.sbatch")], env=_fake_slurm(tmp_path / "bin"), cwd=tmp_path,
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    args = ran.stdout.splitlines()
    assert args[:2] == ["--kill-on-bad-exit=1", "--cpus-per-task=64"]  # srun asks for the CPUs again
    assert "--rdzv-endpoint=gpu-node-17:32956" in args  # 29500 + 123456 % 10000
    assert "--rdzv-id=123456" in args and "--nnodes=2" in args and "--nproc-per-node=8" in args
    assert args[args.index("--log.run_dir") + 1] == str(run_dir)  # absolute, whatever the cwd of sbatch
    assert args[args.index("--checkpoint.dir") + 1] == odd  # a user's value arrives as one literal argument
    # the corpus was tokenized here, before the job: its ranks are handed the files
    tokens = Path(args[args.index("--data.tokens") + 1])
    assert tokens.is_absolute() and tokens.is_file() and Path(args[args.index("--data.tokenizer") + 1]).is_file()
    assert args[-1] == "OMP=8 NCCL_DEBUG=WARN PWD=" + str(tmp_path)  # (the fake srun runs where bash was started)
    assert main(["slurm", str(EXAMPLE), "--nodes", "2", "--grid.dp", "4", "--cpus-per-task", "96",
                 "--output", "job.sbatch"]) == 0
    assert "#SBATCH --cpus-per-task=96" in (submit / "job.sbatch").read_text()
    # grid.elastic: torchrun's elastic form, from the fewest nodes a fallback (or the planner) runs on
    for fallbacks, span in (("dp=4,x=4; dp=2,x=2,y=2", "1:2"), ("", "1:2"), ("dp=4,x=4", "2")):
        assert main(["slurm", str(EXAMPLE), "--nodes", "2", "--grid.dp", "4", "--grid.elastic", "true",
                     "--grid.fallbacks", fallbacks, "--output", "elastic.sbatch"]) == 0
        assert f"--nnodes={span}" in (submit / "elastic.sbatch").read_text().split(), fallbacks


# ----- stopping, resuming ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped(data, tmp_path_factory):
    """Two ranks; rank 1 alone gets SIGTERM at the start of step 2. The ranks agree on it one step
    behind (`StopAgreement`), so both stop after 3 steps."""
    run = tmp_path_factory.mktemp("stopped")
    done = _fourfold("train", "--grid.dp", "2", *data["options"],
                     *_options(run, "--fault.signal_rank", "1", "--fault.signal_step", "2"))
    return run, done


def test_sigterm_saves_a_checkpoint_and_stops_every_rank_quietly(stopped):
    run, done = stopped
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / ".signal-injected").exists()
    assert [p.name for p in checkpoint.complete(run / "checkpoints")] == ["step-00000003"]
    assert checkpoint.read_meta(run / "checkpoints" / "step-00000003")["step"] == 3
    assert done.stdout.count("stopped by") == 1
    assert (f"stopped by SIGTERM after 3 of {STEPS} steps; last checkpoint {run / 'checkpoints' / 'step-00000003'}: "
            f"run the same command again to resume from it") in done.stdout
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert json.loads((run / "summary.json").read_text())["stopped"] == "SIGTERM"


def test_a_signal_stops_one_step_later_whatever_the_records_rhythm(data, tmp_path):
    """The signal comes at step 3 and records are read every 2 steps: every rank stops before
    step 4 (the agreement is one step behind, never waits for a read), SIGTERM saves the 4 steps
    done, and each of them is recorded once."""
    done = _fourfold("train", "--grid.dp", "2", *data["options"],
                     *_options(tmp_path, "--fault.signal_rank", "1", "--fault.signal_step", "3", "--log.every", "2",
                               "--data.packing", "documents"))  # (and windows that start at documents)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((data["folder"] / "cache").glob("windows-*.npy"))  # packed once, by rank 0, into the cache
    assert [p.name for p in checkpoint.complete(tmp_path / "checkpoints")] == ["step-00000004"]
    assert f"stopped by SIGTERM after 4 of {STEPS} steps" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]


def test_resume_with_another_schedule_says_what_changed(data, stopped, tmp_path):
    run, _ = stopped
    shutil.copytree(run / "checkpoints" / "step-00000003", tmp_path / "checkpoints" / "step-00000003")
    done = _fourfold("train", "--grid.dp", "2", *data["options"], *_options(tmp_path, "--train.steps", "8",
                                                                           "--optimizer.lr", "1e-3",
                                                                           "--batch.global_batch", "16"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("train.steps 6 -> 8, optimizer.lr 0.003 -> 0.001") == 1
    assert "the learning-rate schedule differs from the checkpoint's" in done.stdout
    # another global batch: said, and the header's epochs count each step at its own batch
    assert done.stdout.count("batch.global_batch 8 -> 16: from step 3 on each step takes 16 sequences, the data "
                             "order going on from sequence 24, where the checkpoint left it") == 1
    assert "train.steps=8: 24 sequences before step 3, then 16 a step = " in done.stdout
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step-00000008"
    again = _fourfold("train", "--grid.dp", "2", *data["options"], *_options(tmp_path, "--train.steps", "8",
                                                                            "--optimizer.lr", "1e-3",
                                                                            "--batch.global_batch", "16"))
    assert again.returncode == 0 and "nothing to train" in again.stdout
    def no_nan(token):
        raise ValueError(f"{token} is not JSON")
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=no_nan)  # strict JSON
    # the whole run: steps 3-7 of the first segment, none in the second
    assert summary["step"] == 8 and summary["steps"] == 5
    assert [(s["event"], s["step"]) for s in summary["segments"]] == [("resume", 3), ("resume", 8)]


@pytest.mark.parametrize("how", ["ctrl-c", "sigint to the launcher", "sigterm to the launcher"])
def test_a_signal_to_the_command_stops_every_rank_in_one_line(data, tmp_path, how):
    """Ctrl-C: SIGINT to the launching process group, as a terminal sends it, or to the launching
    process alone (`kill -INT`); both reach the launcher only (torchrun has a process group of its
    own), which passes the signal on once; nothing is saved and the command returns 130. SIGTERM to the
    launching process alone (a scheduler's): it is passed on, every rank saves the step it stopped
    after, and the command returns 143. None prints a traceback."""
    cmd = [sys.executable, "-m", "fourfold.cli.main", "train", "--grid.dp", "2", *data["options"],
           *_options(tmp_path, "--train.steps", "100000", "--log.every", "1")]  # a record each step
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = tmp_path / "log.jsonl"
    deadline = time.monotonic() + 180
    while (proc.poll() is None and not (log.exists() and log.read_text().count("\n") >= 2)
           and time.monotonic() < deadline):
        time.sleep(0.2)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT if how == "sigint to the launcher" else signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err and err.strip() == "", err[-3000:]
    assert out.count("stopped by") == 1, out[-3000:]
    saved = checkpoint.complete(tmp_path / "checkpoints")
    if how != "sigterm to the launcher":
        assert proc.returncode == 130
        assert "stopped by SIGINT after" in out and "no checkpoint yet: the same command starts over" in out
        assert not saved
    else:
        assert proc.returncode == 143
        done = json.loads((tmp_path / "summary.json").read_text())["steps"]
        assert [p.name for p in saved] == [f"step-{done:08d}"]
        assert f"stopped by SIGTERM after {done} of 100000 steps; last checkpoint {saved[0]}" in out


def _processes_naming(text: str) -> list[int]:
    """The live processes whose command line holds `text` (Linux's /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_torchrun_and_the_ranks_stop_when_the_launcher_is_killed(data, tmp_path):
    """torchrun runs in a process group of its own; a SIGKILL to the launcher, which passes nothing
    on, still stops it and its ranks (they do not run on, holding GPUs and ports)."""
    cmd = [sys.executable, "-m", "fourfold.cli.main", "train", "--grid.dp", "2", *data["options"],
           *_options(tmp_path, "--train.steps", "100000", "--log.every", "1")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    log, deadline = tmp_path / "log.jsonl", time.monotonic() + 180
    while (proc.poll() is None and not (log.exists() and log.read_text().count("\n") >= 2)
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert len(_processes_naming(str(tmp_path))) >= 4  # the launcher, torchrun and two ranks
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 120
    while _processes_naming(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _processes_naming(str(tmp_path))
    for pid in left:  # (cleaned up, then reported)
        os.kill(pid, signal.SIGKILL)
    assert not left


# ----- help, export and fine-tuning from the exported directory --------------------------------------

def test_train_help_shows_the_override_syntax_and_every_section(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--section.key value" in out and "--optimizer.lr 1e-3" in out
    for section in fields(TrainConfig):
        assert f"\n[{section.name}]\n" in out
    assert "--optimizer.lr 0.003 " in out and "--pipeline.stage_layers '' " in out
    assert "--checkpoint.resume true " in out


def test_export_then_fine_tune_from_the_hugging_face_directory(data, stopped, tmp_path, capsys):
    run, _ = stopped
    hf = tmp_path / "exported"
    assert main(["export", str(run / "checkpoints"), str(hf)]) == 0
    assert f"wrote {hf} from {run / 'checkpoints' / 'step-00000003'}" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf.iterdir()}
    fine = tmp_path / "fine"
    done = _fourfold("train", "--model.hf", hf, "--data.tokens", data["tokens"], "--data.tokenizer",
                     hf / "tokenizer.json",
                     *_options(fine, "--train.steps", "2", "--log.every", "1", "--checkpoint.every", "0"))
    assert done.returncode == 0, done.stderr[-3000:]
    first, from_scratch = (_first_loss(r) for r in (fine, run))
    assert first < from_scratch - 0.1  # the same first batch, scored by the exported (trained) weights
    # a scheduler's log: a line a step and one closing line, the records in log.jsonl (each saying its kind)
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert not any(line.startswith("{") for line in lines), done.stdout
    assert re.fullmatch(rf"done: 2 steps, loss {first:.4f} -> \d+\.\d{{4}}, \d+\.\d s; checkpoint none "
                        rf"\(checkpoint.every = 0\); records in {fine}/ \(log.jsonl, summary.json, loss.png\)",
                        lines[-1]), lines[-1]
    records = [json.loads(line) for line in (fine / "log.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records if r["kind"] != "timing"] == ["event", "step", "step"]
    assert json.loads((fine / "summary.json").read_text())["checkpoint"] is None  # null, not "None"


def _first_loss(run):
    return next(r["loss"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if "loss" in r)


def test_fine_tuning_a_hugging_face_directory_on_jsonl_uses_its_tokenizer(data, stopped, tmp_path, capsys):
    """--model.hf DIR with a JSONL corpus and no data.tokenizer: DIR's tokenizer.json tokenizes the
    corpus (not a BPE trained on it), and the checkpoint carries that tokenizer on to export."""
    run, _ = stopped
    hf = tmp_path / "exported"
    assert main(["export", str(run / "checkpoints"), str(hf)]) == 0
    capsys.readouterr()
    documents = tmp_path / "corpus.jsonl"
    text = corpus.bundled_text()[100_000:160_000]
    documents.write_text("".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n") if p.strip()))
    fine = tmp_path / "fine"
    done = _fourfold("train", "--model.hf", hf, "--data.files", documents, "--data.cache_dir", tmp_path / "cache",
                     *_options(fine, "--train.steps", "2", "--checkpoint.every", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    saved = fine / "checkpoints" / "step-00000002" / "tokenizer.json"
    assert saved.read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert main(["export", str(fine / "checkpoints"), str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()


def test_an_override_without_its_value_names_it(capsys):
    for argv in (["train", "--train.steps", "--train.eval_every", "0"], ["train", "--train.steps"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "--train.steps needs a value: --train.steps VALUE (or --train.steps=VALUE)" in capsys.readouterr().err


def test_prepare_tokenizes_and_packs_into_the_cache_train_reads(tmp_path, capsys, monkeypatch):
    """`fourfold prepare` does before the job what train and slurm would do at launch: they then find
    the token and window files in the cache and tokenize nothing."""
    text = tmp_path / "corpus.txt"
    text.write_text(corpus.bundled_text()[:20_000])
    options = ["--data.text", str(text), "--data.vocab", "300", "--data.cache_dir", str(tmp_path / "cache"),
               "--data.packing", "documents", "--batch.seq", "32"]
    assert main(["prepare", *options, "--grid.cp", "2"]) == 0  # (a GPU grid's rules are not asked on this machine)
    out = capsys.readouterr().out
    assert "packed windows:" in out and "--data.tokens" in out
    from fourfold.config import load_train_config
    from fourfold.data.prepare import packed_windows, tokens_files

    monkeypatch.setattr(corpus, "_tokenize", None)  # found in the cache: nothing is tokenized again
    monkeypatch.setattr(corpus, "pack_documents", None)
    cfg = load_train_config(None, options)
    tokenizer, tokens = tokens_files(cfg.data, cfg.tokenizer)
    assert str(tokens.resolve()) in out and packed_windows(cfg.data, cfg.batch.seq, tokenizer, tokens).is_file()
    assert main(["prepare", "--data.text", str(tmp_path / "none.txt")]) == 2
    assert "data.text names" in capsys.readouterr().err


def test_directories_the_run_cannot_write_are_refused_before_launch(tmp_path, no_launch, capsys):
    """A run directory under a file, or a checkpoint directory that cannot be created, fails in one
    line before torchrun starts (not at the first save, after the steps before it)."""
    (tmp_path / "afile").write_text("not a directory")
    err = _error(capsys, ["train", "--log.run_dir", str(tmp_path / "afile" / "run")])
    assert f"log.run_dir {tmp_path / 'afile' / 'run'} cannot be written" in err and "give a directory" in err
    err = _error(capsys, ["train", "--log.run_dir", str(tmp_path / "run"), "--checkpoint.dir", "/proc/fourfold/ckpt"])
    assert "checkpoint.dir /proc/fourfold/ckpt cannot be written (No such file or directory)" in err
    assert not list((tmp_path / "run").iterdir())  # the check's probe file is gone


def test_a_corpus_smaller_than_one_global_batch_is_refused_before_launch(tmp_path, no_launch, capsys):
    text = tmp_path / "short.txt"
    text.write_text(corpus.bundled_text()[:3000])
    err = _error(capsys, ["train", "--data.text", str(text), "--data.vocab", "300", "--data.cache_dir",
                          str(tmp_path / "cache"), "--log.run_dir", str(tmp_path / "run"), "--batch.seq", "128",
                          "--batch.global_batch", "64"])
    assert "fewer than one global batch of 64; use a larger corpus, shorter sequences or a smaller global batch" in err


def test_a_run_of_non_finite_losses_stops_in_one_line_with_strict_json_records(data, tmp_path):
    """optimizer.max_bad_steps non-finite steps in a row stop every rank: one line naming the fix
    (rank 0's) and one from the launcher, no traceback; log.jsonl stays strict JSON, the skipped
    steps' losses null with why they were skipped."""
    done = _fourfold("train", "--grid.dp", "2", *data["options"],
                     *_options(tmp_path, "--fault.nan_steps", "1,2", "--train.max_bad_steps", "2"))
    assert done.returncode == 1
    assert done.stderr.count("fourfold: error: 2 non-finite steps in a row (last at step 2: loss is nan); lower "
                             "optimizer.lr") == 1, done.stderr[-3000:]
    # the launcher's line: the first rank to exit failed, the other stopped by torchrun or failed too
    assert re.search(r"^fourfold: [12] ranks? failed: .*rank [01] \(exit code 1\).*; each one's own message is above$",
                     done.stderr, re.M), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "exitcode" not in done.stderr, done.stderr[-3000:]

    def no_nan(token):
        raise ValueError(f"{token} is not JSON")
    records = [json.loads(line, parse_constant=no_nan) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert [(r["step"], r["loss"], r["skipped_because"]) for r in skipped] == [(1, None, "loss is nan"),
                                                                              (2, None, "loss is nan")]


def test_a_terminal_gets_a_live_progress_bar(data, tmp_path):
    """Under a real pseudo-terminal (one that reports no size, as `script` and containers make):
    the bar, with its loss, tokens/s and time left, not the JSON lines a pipe gets."""
    import pty

    main_fd, rank_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "fourfold.cli.main", "train", *data["options"],
                             *_options(tmp_path)[:2], "--train.steps", "4", "--batch.global_batch", "4",
                             "--batch.micro_batch", "2", "--batch.seq", "32", "--checkpoint.every", "0"],
                            stdin=subprocess.DEVNULL, stdout=rank_fd, stderr=rank_fd,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    os.close(rank_fd)
    seen = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the terminal closed: every process that held it has exited
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=300) == 0, seen[-3000:]
    text = seen.decode(errors="replace")
    assert "train: 100%" in text and "4/4" in text and "tok/s" in text and "loss " in text, text[-3000:]
    assert '"tokens_per_s"' not in text  # the step records go to log.jsonl, not the terminal


def test_a_hugging_face_directory_without_its_weights_is_refused_before_launch(data, tmp_path, no_launch, capsys):
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(Path(corpus.__file__).parents[1] / "models/presets/tiny-llama.json", hub / "config.json")
    shutil.copy(data["tokenizer"], hub / "tokenizer.json")
    argv = ["train", "--model.hf", str(hub), "--log.run_dir", str(tmp_path / "run")]
    err = _error(capsys, argv)
    assert f"model.hf: {hub} has neither model.safetensors nor model.safetensors.index.json" in err
    (hub / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    err = _error(capsys, argv)
    assert "names model-00001-of-00002.safetensors, which is not there; copy the whole model directory" in err
