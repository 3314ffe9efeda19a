"""The code keeps the style pyproject.toml's [tool.ruff] sets (line length, unused names, import order)."""

import subprocess
import sys
from pathlib import Path


def test_ruff_finds_nothing():
    root = Path(__file__).parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks"], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
