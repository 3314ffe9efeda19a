"""The package's layers: the model families, the job spec and the planner import neither torch nor
the runtime, the trainer or the command line (dependencies point down; docs/architecture.md)."""

import subprocess
import sys

CODE = """
import importlib, pkgutil, sys
import fourfold.models, fourfold.plan, fourfold.spec
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
