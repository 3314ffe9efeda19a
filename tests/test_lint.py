"""The code keeps the style pyproject.toml's [tool.ruff] sets (line length, unused names, import order)."""

import subprocess
import sys
from pathlib import Path


def test_ruff_finds_nothing():
    root = Path(__file__).parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks"], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_torch_floor_in_the_package_the_makefile_and_the_readme():
    """The oldest torch the code runs on (DeviceMesh._unflatten: 2.10) is the one pip, `make` and the
    README admit."""
    import tomllib

    root = Path(__file__).parents[1]
    torch_spec = next(d for d in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
                      if d.startswith("torch"))
    assert torch_spec == "torch>=2.10"
    assert "< (2, 10) else" in (root / "Makefile").read_text()
    assert "any >= 2.10" in (root / "README.md").read_text()
    import torch.distributed.device_mesh as device_mesh
    assert hasattr(device_mesh.DeviceMesh, "_unflatten") and hasattr(device_mesh.DeviceMesh, "_flatten")
