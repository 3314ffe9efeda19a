"""The one rule function (fourfold.spec.rules): every job it accepts on up to 8 ranks builds and trains a
step; every refusal names its fix; the commands check before they start processes."""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fourfold.models.config import ModelConfig, load_config
from fourfold.spec.job import Job, split_layers
from fourfold.spec.layout import Layout, factorisations
from fourfold.spec.rules import JobError, check, problems

MODELS = {
    "tiny-llama": load_config("tiny-llama"),  # hidden 128, 8 heads, 4 kv heads, ffn 352, 2 layers
    "tiny-gpt": load_config("tiny-gpt"),  # tied: the last pipeline stage holds a copy of the embedding
    # awkward sizes: 6 heads, 2 kv heads, ffn 96, an odd vocabulary, 3 layers
    "odd-llama": ModelConfig("llama", hidden=48, layers=3, heads=6, kv_heads=2, ffn=96, vocab=250, max_positions=64,
                             tied=False, eps=1e-5),
}
FIXES = ("choose ", "use ", "set ", "raise ", "give ", "change ", "turn ")


def _jobs(world: int):
    """Every grid of `world` ranks, each with one of two option sets (alternating)."""
    for i, sizes in enumerate(factorisations(world)):
        layout = Layout(**dict(zip(("dp", "pp", "cp", "x", "y", "z"), sizes)))
        if i % 2:
            yield Job(layout, micro_batch=2, global_batch=4 * layout.dp, seq=24, seq_parallel=True,
                      recompute="selective", schedule="gpipe", precision="float64")
        else:
            yield Job(layout, micro_batch=4, global_batch=8 * layout.dp, seq=16, recompute="full", precision="float64")


def _accepted():
    out, refused = [], 0
    for name, model in MODELS.items():
        for world in range(1, 9):
            for job in _jobs(world):
                found = problems(model, job, world=world)
                for p in found:
                    assert p.fix.startswith(FIXES), p  # every refusal says what to change
                refused += bool(found)
                if not found:
                    out.append((name, job))
    return out, refused


def test_every_refusal_names_a_fix_and_most_grids_are_exercised():
    accepted, refused = _accepted()
    assert len(accepted) > 100 and refused > 100


def _train_one_step(cases):
    """A training step of each (model, job) on this world, through the trainer's Model and batch split."""
    import torch

    from fourfold.parallel.data import GradientSync
    from fourfold.parallel.grid import Grid
    from fourfold.parallel.model import Model, local_batch
    from fourfold.parallel.optimizer import AdamW
    from fourfold.parallel.tensor.block import torch_dtype

    losses = []
    for name, job in cases:
        grid = Grid(job.layout)
        model = Model(grid, job, MODELS[name], dtype=torch_dtype(job.precision, grid.device))
        opt = AdamW(GradientSync(model.module, grid), lr=1e-3)
        rows = job.global_batch // job.layout.dp
        ids = np.random.default_rng(0).integers(0, MODELS[name].vocab, (rows, job.seq + 1))
        loss = model.step(local_batch(job, grid, ids), opt.sync, 1.0 / (job.global_batch * job.seq))
        opt.step()
        total = loss.clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
    return losses


def _sample(accepted, per_model: int = 4):
    """Every accepted job when FOURFOLD_ALL_GRIDS=1 (about 200, over ten minutes on 2 cores);
    otherwise a fixed spread: per model, jobs using the most dims at once, each set of dims once."""
    if os.environ.get("FOURFOLD_ALL_GRIDS") == "1":
        return accepted
    out = []
    richest_first = sorted(accepted, key=lambda a: -sum(n > 1 for n in a[1].layout.sizes.values()))
    for name in MODELS:
        seen = set()
        for model, job in richest_first:
            kind = tuple(d for d, n in job.layout.sizes.items() if n > 1)
            if model == name and kind not in seen and len(seen) < per_model:
                seen.add(kind)
                out.append((model, job))
    return out


def test_every_accepted_job_up_to_8_ranks_trains_a_step(ranks):
    for name, job in _sample(_accepted()[0]):
        # one job per world, as in a real run (one Grid per process)
        loss = ranks.run(_train_one_step, job.layout.world_size, [(name, job)])[0][0]
        # each token's loss is held by its x*y tensor ranks (on the last stage): the mean loss
        # of a fresh model, about ln(vocab)
        assert math.isfinite(loss), (name, str(job))
        expected = pytest.approx(math.log(MODELS[name].vocab), rel=0.05)
        assert loss / job.layout.size(("x", "y")) == expected, (name, str(job))


def test_refusals_of_the_old_validation_gaps():
    tiny = MODELS["tiny-llama"]
    # y=3 without sequence parallelism used to pass validation and fail on every rank
    found = problems(tiny, Job(Layout(y=3), micro_batch=2, global_batch=2))
    assert any("y=3 must divide heads=8" in str(p) for p in found)
    assert any("y=3 must divide hidden=128" in str(p) for p in found)
    with pytest.raises(JobError, match="this job cannot run:\n  "):  # several problems, one per line
        check(tiny, Job(Layout(y=3), micro_batch=2, global_batch=2))
    assert problems(tiny, Job(seq=1024))[0].what == "batch.seq=1024 is longer than the model's 512 positions"
    found = problems(tiny, Job(Layout(pp=2), micro_batch=2, global_batch=2))
    assert found and "at least pp=2 micro-batches" in str(found[0]) and "raise batch.global_batch to 4" in str(found[0])
    assert not problems(tiny, Job(Layout(pp=2), micro_batch=2, global_batch=2, schedule="gpipe"))
    found = problems(tiny, Job(Layout(pp=2), micro_batch=1, global_batch=3, schedule="interleaved-1f1b", virtual=2))
    assert "multiple of pp=2" in str(found[0]) and "2 layers cannot fill 4 pipeline stages" in str(found[1])
    assert "virtual=1 does not go with" in str(problems(tiny, Job(Layout(pp=2), global_batch=4,
                                                                   schedule="interleaved-1f1b"))[0])
    assert "unknown" in str(problems(tiny, Job(schedule="zero-bubble"))[0])


def test_split_layers():
    assert [len(r) for r in split_layers(4, 3)] == [1, 2, 1]  # the extra layer on a middle stage
    with pytest.raises(ValueError, match="2 layers cannot fill 3 pipeline stages"):
        split_layers(2, 3)
    assert [len(r) for r in split_layers(4, 3, [2, 1, 1])] == [2, 1, 1]
    with pytest.raises(ValueError, match="sum to the model's 4 layers"):
        split_layers(4, 2, [1, 1])


def test_config_parsing_and_rules_need_no_torch():
    code = ("import sys, fourfold.config, fourfold.spec.rules, fourfold.cli.main; "
            "fourfold.config.validate(fourfold.config.load_train_config(None), 1); "
            "print(any(m.startswith('torch') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


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
    preset = Path(__file__).parents[1] / "src/fourfold/models/presets/tiny-llama.json"
    (tmp_path / "config.json").write_text(preset.read_text())
    code, err = fails("--hf", str(tmp_path), "--tokens", str(tmp_path / "t.npy"), "--seq", "8", "--json")
    assert code == 2 and "give a .npy file of token ids" in err
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int64) * 100)
    code, err = fails("--hf", str(tmp_path), "--tokens", str(tmp_path / "t.npy"), "--seq", "8")
    assert code == 2 and "outside the model's vocabulary [0, 4096)" in err
    code, err = fails("--hf", str(tmp_path), "--tokens", str(tmp_path / "t.npy"), "--seq", "8", "--grid", "y=3")
    assert code == 2 and "choose y from 1, 2, 4" in err


def test_launcher_options_stay_with_the_launcher():
    from fourfold.cli.options import launcher_options_removed

    argv = ["eval", "--hf", "d", "--nproc-per-node", "8", "--json", "--max-restarts=2", "--grid", "x=2"]
    assert launcher_options_removed(argv) == ["eval", "--hf", "d", "--json", "--grid", "x=2"]


@pytest.mark.parametrize("field", ["job_name", "time", "partition", "account", "run_dir", "workdir"])
def test_sbatch_values_with_control_characters_are_refused(field):
    from fourfold.config import ConfigError
    from fourfold.train.slurm import sbatch_script

    where = dict(nodes=1, gpus_per_node=8, cpus_per_task=8, run_dir="/runs/a", workdir="/home/me")
    with pytest.raises(ConfigError, match="control character '\\\\n'"):
        sbatch_script("cfg.toml", [], **dict(where, **{field: "x\nsrun rm -rf /"}))
    with pytest.raises(ConfigError, match="override 1"):
        sbatch_script("cfg.toml", ["--log.run_dir", "a\rb"], **where)


def test_a_missing_model_directory_is_named_as_missing(tmp_path):
    with pytest.raises(ValueError, match="does not exist; give a Hugging Face model directory"):
        load_config(str(tmp_path / "my-llama"))
    with pytest.raises(ValueError, match="'tiny-lama' is not a preset: did you mean tiny-llama\\?"):
        load_config("tiny-lama")
    with pytest.raises(ValueError, match="is neither a config.json nor a preset"):
        load_config("no-such-model")


def test_a_model_config_that_cannot_split_its_heads_is_a_problem_not_a_traceback():
    bad = ModelConfig("llama", hidden=48, layers=2, heads=5, kv_heads=5, ffn=96, vocab=64, max_positions=64,
                      tied=False, eps=1e-5)
    assert "must be divisible by heads=5" in str(problems(bad, Job())[0])


def test_uneven_layer_counts_split_like_llama_3_and_the_planner_counts_the_largest_stage():
    from fourfold.plan.frameworks import MEGATRON
    from fourfold.plan.search import predict
    from fourfold.spec.hardware import make_cluster
    from fourfold.spec.job import default_stage_layers, most_layers_on_a_rank

    assert default_stage_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B's own split
    assert default_stage_layers(32, 3) == [11, 11, 10]
    job = Job(Layout(dp=128, pp=16, y=8), global_batch=2048, seq=8192, recompute="full", precision="bf16")
    assert most_layers_on_a_rank(126, job) == 8
    assert most_layers_on_a_rank(126, Job(Layout(pp=8), virtual=2, schedule="interleaved-1f1b")) == 16
    model = load_config("llama-3.1-405b")
    assert problems(model, job, gpu=True) == []
    assert predict(model, job, make_cluster("dgx-h100"))["fits"]
    with pytest.raises(JobError, match="Megatron-LM builds the same number of layers on every pipeline stage"):
        predict(model, job, make_cluster("dgx-h100"), framework=MEGATRON)  # Megatron cannot split 126 over 16
    # the estimate follows the most loaded stage: 8 layers, as 128 layers on 16 stages would give
    as_128 = MEGATRON.memory(dataclasses.replace(model, layers=128), job, 80)
    assert MEGATRON.memory(model, job, 80).terms == as_128.terms


def test_dynamic_rope_may_run_past_the_trained_positions_and_nothing_else_may():
    from fourfold.spec.blockspec import RopeScaling

    base = ModelConfig("llama", hidden=48, layers=2, heads=6, kv_heads=2, ffn=96, vocab=64, max_positions=64,
                       tied=False, eps=1e-5)
    job = Job(seq=128)
    assert "longer than the model's 64 positions" in str(problems(base, job))
    linear = dataclasses.replace(base, rope_scaling=RopeScaling("linear", 2.0))
    assert "longer than the model's 64 positions" in str(problems(linear, job))
    dynamic = dataclasses.replace(base, rope_scaling=RopeScaling("dynamic", 2.0, original_max_positions=64))
    assert problems(dynamic, job) == []
