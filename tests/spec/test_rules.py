"""The one rule function (fourfold.spec.rules): every refusal names its fix (that every job it accepts
on up to 8 ranks builds and trains a step: tests/parallel/test_accepted_jobs.py); the commands check
before they start processes."""

import dataclasses
import subprocess
import sys

import pytest

from fourfold.models.config import ModelConfig, load_config
from fourfold.spec.job import Job, split_layers
from fourfold.spec.layout import Layout
from fourfold.spec.rules import JobError, check, problems
from jobs import MODELS, accepted_jobs

pytestmark = pytest.mark.torch_free

def test_every_refusal_names_a_fix_and_most_grids_are_exercised():
    accepted, refused = accepted_jobs()
    assert len(accepted) > 100 and refused > 100


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
