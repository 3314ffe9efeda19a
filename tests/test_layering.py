"""The package's layers: the model families, the job spec, the training config and the planner
import neither torch nor the runtime, the trainer or the command line (dependencies point down;
docs/architecture.md)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch_free

CODE = """
import importlib, pkgutil, sys
import fourfold.config, fourfold.extras, fourfold.models, fourfold.plan, fourfold.spec
for package in (fourfold.models, fourfold.spec, fourfold.plan):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
print(len([m for m in sys.modules if m.startswith("fourfold.")]))
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] == "torch"
                      or m.startswith(("fourfold.parallel", "fourfold.train", "fourfold.checkpoint",
                                       "fourfold.data", "fourfold.tools", "fourfold.cli")))))
"""


def test_torch_free_layers_import_nothing_above_them():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    imported, above = done.stdout.split("\n")[:2]
    assert int(imported) >= 20  # every module of the three packages was imported
    assert above == ""


CALLED = """
import sys
from fourfold.config import key_help, load_train_config, validate
from fourfold.plan.search import predict, search
from fourfold.spec.counts import flops_per_token
from fourfold.spec.hardware import make_cluster
from fourfold.spec.rules import problems
from fourfold.spec.volumes import model_collectives

cfg = load_train_config(None, ["--grid.x", "2", "--data.attention", "document"])
validate(cfg, 2)
assert key_help()["optimizer.decay_norms_and_biases"]
model, job, cluster = cfg.model_config(), cfg.job(), make_cluster("dgx-h100", None, None)
assert problems(model, job) == []
model_collectives(model, job.layout.sizes, 1, job.seq, seq_parallel=True)
flops_per_token(model, job.seq)
predict(model, job.with_layout(x=1, dp=8), cluster)
assert search(model, 8, cluster, job)
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] == "torch"
                      or m.startswith(("fourfold.parallel", "fourfold.train", "fourfold.checkpoint",
                                       "fourfold.data", "fourfold.tools", "fourfold.cli")))))
"""


def test_the_config_spec_and_planner_call_nothing_above_them():
    """Not only imported: the training config validated, the rules, volumes and counts computed and
    a plan searched, in a fresh process, load neither torch nor the runtime, data, trainer or CLI."""
    done = subprocess.run([sys.executable, "-c", CALLED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
