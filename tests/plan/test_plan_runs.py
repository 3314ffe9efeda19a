"""The plan is what runs: a plan row's printed commands give the same prediction (`estimate`) and the
same job (`train --grid.auto` picks it and hands it to the ranks)."""

import json
import shlex

import pytest

from fourfold.cli.main import main
from fourfold.cli.train import _resolved, resolve_auto_grid
from fourfold.config import load_train_config

CASES = [("llama-3.1-8b", 64, "dgx-h100", 8192, 256), ("gpt-20b", 32, "dgx-a100", 2048, 512)]


def _json(argv, capsys):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, gpus, cluster, seq, batch", CASES)
def test_a_plan_row_is_what_estimate_and_train_run(model, gpus, cluster, seq, batch, capsys):
    plan = _json(["plan", "--model", model, "--gpus", str(gpus), "--cluster", cluster, "--seq", str(seq),
                  "--global-batch", str(batch), "--json", "--top", "2"], capsys)
    for row in plan["candidates"]:
        estimate = _json(shlex.split(row["commands"]["estimate"])[1:] + ["--json"], capsys)
        assert estimate["step_seconds"] == row["step_seconds"]
        assert estimate["memory_gib"] == row["memory_gib"]
        assert estimate["commands"] == row["commands"]
    # train --grid.auto with the same model, batch and machine chooses the first row, and hands it to the ranks
    first = shlex.split(plan["candidates"][0]["commands"]["train"])
    given = ["--model.preset", model, "--batch.seq", str(seq), "--batch.global_batch", str(batch),
             "--train.precision", "bf16", "--hardware.cluster", cluster]
    cfg = load_train_config(None, [*given, "--grid.auto", "true"])
    resolve_auto_grid(cfg, gpus)
    ranks = load_train_config(None, _resolved(given, cfg))
    assert ranks.job() == load_train_config(None, first[2:]).job()


def test_the_hardware_section_is_the_planners_machine():
    """[hardware] cluster alone takes that cluster's GPUs (the default gpu, H100, replaced an A100
    cluster's, so grid.auto planned another machine than `plan --cluster dgx-a100`)."""
    from fourfold.config import ConfigError, validate
    from fourfold.spec.hardware import make_cluster

    assert load_train_config(None, ["--hardware.cluster", "dgx-a100"]).cluster() == make_cluster("dgx-a100")
    assert load_train_config(None, []).cluster() == make_cluster()
    with pytest.raises(ConfigError, match="hardware: unknown GPU 'b300'"):
        validate(load_train_config(None, ["--hardware.gpu", "b300"]), 1)


def test_a_gpu_count_of_partial_nodes_is_named(capsys):
    assert main(["plan", "--model", "llama-2-7b", "--gpus", "100", "--top", "1"]) == 0
    assert "100 GPUs are not whole nodes of 8" in capsys.readouterr().out
