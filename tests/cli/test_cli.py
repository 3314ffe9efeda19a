"""The command line: no abbreviations anywhere, unknown options named with the closest known one."""

import json
from pathlib import Path

import numpy as np
import pytest

from fourfold.cli.main import main, parser


def _action(command_parser, arg):
    # argparse's own lookup of an option string (a list of candidates from Python 3.12 on)
    found = command_parser._parse_optional(arg)
    return (found[0] if isinstance(found, list) else found)[0]


def test_no_command_accepts_an_abbreviation():
    top, commands = parser()
    checked = 0
    for name, command in {"": top, **commands}.items():
        options = [s for a in command._actions for s in a.option_strings if s.startswith("--")]
        for option in options:
            for end in range(3, len(option)):
                prefix = option[:end]
                if sum(o.startswith(prefix) for o in options) == 1 and prefix not in options:
                    assert _action(command, prefix) is None, f"fourfold {name} takes {prefix} for {option}"
                    checked += 1
    assert checked > 500  # every command's options were tried


@pytest.mark.parametrize("argv, expected", [
    (["estimate", "--model", "llama-2-7b", "--gpus", "256"], "--gpus (did you mean"),
    (["eval", "m", "--tokens", "t.npy", "--seq", "8", "--nproc", "8"], "--nproc (did you mean --nproc-per-node?)"),
    (["train", "--eval_every", "0"], "--eval_every (did you mean --train.eval_every?)"),
    (["plan", "--model", "llama-2-7b", "--gpus", "8", "--glob", "3"], "--glob (did you mean --global-batch?)"),
    # the value after an unknown flag is not read as the positional model (issue #41, item 9)
    (["eval", "--hf", "d", "--tokens", "t.npy", "--seq", "64", "--nproc", "8"],
     "--nproc (did you mean --nproc-per-node?)"),
    (["train", "--grid", "dp=2"], "--grid (did you mean --grid.dp?)"),
    # other frameworks' names (the trial's --optimizer.learning_rate was offered min_lr)
    (["train", "--lr_warmup_steps", "10"], "--lr_warmup_steps (did you mean --optimizer.warmup?)"),
    (["train", "--max-grad-norm", "1"], "--max-grad-norm (did you mean --optimizer.clip?)"),
])
def test_unknown_options_are_named_with_a_suggestion(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("key, ours", [("optimizer.learning_rate", "optimizer.lr"), ("batch.seq_length", "batch.seq"),
                                       ("train.max_steps", "train.steps"), ("optimizer.weight-decay", None)])
def test_other_frameworks_key_names_are_offered_ours(key, ours, capsys):
    from fourfold.config import ConfigError, load_train_config

    if ours is None:  # a hyphen for an underscore is the same key
        assert load_train_config(None, [f"--{key}", "0.2"]).optimizer.weight_decay == 0.2
        return
    with pytest.raises(ConfigError, match=f"unknown key {key} \\(did you mean {ours}\\?\\)"):
        load_train_config(None, [f"--{key}", "3"])


def test_only_the_unknown_option_is_named_among_valid_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--model.hf", "m", "--data.files", "c.jsonl", "--nproc-per-nod", "4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("unrecognized arguments: --nproc-per-nod (did you mean --nproc-per-node?)")


def test_config_problems_are_reported_together(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[train]\nstep = 3\neval_evry = 2\n[optim]\nlr = 1.0\n")
    assert main(["train", str(config), "--batch.seqq", "64"]) == 2
    err = capsys.readouterr().err
    for line in ("4 problems", "unknown key train.step (did you mean train.steps?)",
                 "train.eval_evry (did you mean train.eval_every?)", "[optim] (did you mean optimizer?)",
                 "batch.seqq (did you mean batch.seq?)"):
        assert line in err


def test_the_ranks_run_the_job_the_planner_chose():
    """grid.auto hands the ranks the chosen job as overrides: every setting of it (kept gathered
    inputs, and an interleaved schedule, were forgotten once), so that the ranks' config makes the same job."""
    import dataclasses

    from fourfold.cli.train import _resolved
    from fourfold.config import load_train_config
    from fourfold.spec.layout import Layout

    cfg = load_train_config(None, ["--grid.auto", "true"])
    layout = Layout(dp=2, pp=2, x=2, y=2, order=("y", "x", "z", "cp", "dp", "pp"))
    chosen = dataclasses.replace(cfg.job(), layout=layout, micro_batch=2, recompute="selective", seq_parallel=True,
                                 keep_gathered_inputs=True, virtual=2, schedule="interleaved-1f1b")
    cfg.use_job(chosen)
    assert cfg.job() == chosen
    argv = _resolved(["train", "--grid.auto", "true"], cfg)
    ranks = load_train_config(None, argv[1:])
    assert ranks.job() == chosen and not ranks.grid.auto


def test_every_config_key_is_explained_in_the_help():
    from fourfold.config import config_keys, key_help, sections_help

    meaning = key_help()
    assert [k for k in config_keys() if not meaning.get(k)] == []
    assert "--train.steps 100" in sections_help() and "optimizer steps of the whole run" in sections_help()


def test_a_reader_that_stops_reading_is_no_error():
    """`fourfold plan ... | head`: the command stops quietly when its reader closes the pipe."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "fourfold.cli", "plan", "--model", "llama-3.1-8b", "--gpus", "64",
               "--global-batch", "256", "--json"]  # more than a pipe's buffer
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait() == 1 and err == ""  # 1: it did meet the closed pipe


def test_a_grid_dim_beside_grid_auto_is_refused_not_dropped(capsys):
    """Issue #41, item 10: the planner chooses every dim; a dim given beside it would vanish."""
    assert main(["train", "--grid.auto", "true", "--grid.x=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("fourfold: error: --grid.auto true chooses the grid, so --grid.x 2 would be dropped: leave it out "
                   "(give the ranks with --nproc-per-node N), or set --grid.auto false")


def test_small_mistakes_get_their_fix(tmp_path, capsys):
    """Issue #41, item 12: a preset's name in another case, a plot into a missing folder (said before
    the search), a configuration that does not fit (its own exit status, for scripts), "an int"."""
    assert main(["estimate", "--model", "llama-3.1-8B"]) == 2
    assert "'llama-3.1-8B' is not a preset: did you mean llama-3.1-8b?" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--plot", str(tmp_path / "no" / "x.png")]) == 2
    out, err = capsys.readouterr()
    assert not out and f"--plot {tmp_path / 'no' / 'x.png'}: the folder {tmp_path / 'no'} does not exist" in err
    assert main(["estimate", "--model", "llama-3.1-8b", "--dp", "1", "--micro-batch", "64", "--json"]) == 3
    assert not json.loads(capsys.readouterr().out)["fits"]
    assert main(["train", "--train.steps", "x"]) == 2
    assert "train.steps takes an int, not 'x'" in capsys.readouterr().err


def test_grid_auto_on_cpu_says_it_planned_gpus(monkeypatch, capsys):
    """Issue #41, item 12: on a CPU run the planner's choice is for the [hardware] preset's GPUs, said."""
    monkeypatch.setattr("fourfold.cli.train._before_launch", lambda cfg: [])
    monkeypatch.setattr("fourfold.cli.train.relaunch_with_torchrun", lambda *args, **kwargs: 0)
    assert main(["train", "--grid.auto", "true", "--train.device", "cpu", "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "grid.auto: the planner's choice on 2 x h100-80gb: " in out
    assert ("grid.auto: (this run is on CPU; the planner planned h100-80gb GPUs, the [hardware] preset's, and its "
            "memory and speed figures are theirs)") in out


def test_eval_checks_before_it_starts_processes(tmp_path, capsys):
    """Each mistake exits 2 with one message, before torchrun starts anything (the command run in
    this process: nothing reaches the launch)."""
    from fourfold.cli.main import main

    def fails(*args):
        code = main(["eval", *args])
        return code, capsys.readouterr().err

    code, err = fails("--hf", str(tmp_path), "--tokens", "t.npy", "--seq", "8", "--grid", "x=2",
                      "--nproc-per-node", "2")
    assert code == 2 and "has no config.json" in err
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    code, err = fails("--hf", str(tmp_path), "--tokens", "t.npy", "--seq", "8")
    assert code == 2 and "model_type 'bert'" in err
    preset = Path(__file__).parents[2] / "src/fourfold/models/presets/tiny-llama.json"
    (tmp_path / "config.json").write_text(preset.read_text())
    code, err = fails("--hf", str(tmp_path), "--tokens", str(tmp_path / "t.npy"), "--seq", "8", "--json")
    assert code == 2 and "give a .npy file of token ids" in err
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int64) * 100)
    code, err = fails("--hf", str(tmp_path), "--tokens", str(tmp_path / "t.npy"), "--seq", "8")
    assert code == 2 and "outside the model's vocabulary [0, 4096)" in err
    code, err = fails("--hf", str(tmp_path), "--tokens", str(tmp_path / "t.npy"), "--seq", "8", "--grid", "y=3")
    assert code == 2 and "choose y from 1, 2, 4" in err
