"""benchmarks/gpu_acceptance.py on CPU: its dry run (every section on a tiny model) passes and
writes a strict-JSON report, rewritten as each section ends, which keeps what finished when the
deadline ends the run."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_acceptance.py"
SECTIONS = ("device", "process_group", "model", "ring_attention", "same_weights", "throughput", "memory", "flash")


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")
    return json.loads(text, parse_constant=refuse)


def test_dry_run_passes_and_reports_every_section(tmp_path):
    out = tmp_path / "acceptance.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--output", str(out)], capture_output=True,
                         text=True, timeout=300)
    report = _strict(out.read_text())
    assert run.returncode == 0 and report["ok"], run.stderr[-4000:]
    assert set(SECTIONS) <= report.keys() and report["running"] is None
    assert {s["what"] for s in report["skipped"]} == {"kernels", "compile"}  # CUDA only


def test_a_failed_import_is_in_the_report(tmp_path):
    """The report is written before torch and fourfold are imported: a dependency missing from the
    image (here safetensors) leaves a report naming it and the fix, and exit status 2."""
    out = tmp_path / "acceptance.json"
    run = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.modules['safetensors'] = None; "
                          f"sys.argv = ['gpu_acceptance.py', '--dry-run', '--output', {str(out)!r}]; "
                          f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    report = _strict(out.read_text())
    assert run.returncode == 2 and report["ok"] is False and "safetensors" in report["imports"]["error"]
    assert "pip install -e ." in report["imports"]["fix"]


def test_the_deadline_ends_the_run_keeping_its_report(tmp_path):
    out = tmp_path / "acceptance.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--output", str(out), "--deadline-s", "0"],
                         capture_output=True, text=True, timeout=300)
    report = _strict(out.read_text())
    assert run.returncode == 3 and report["ok"] is False
    assert report["stopped"].startswith("deadline of 0 s passed during")


@pytest.fixture
def acceptance(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_each_section_is_written_when_it_ends(tmp_path, acceptance):
    path = tmp_path / "report.json"
    report = acceptance.Report(path, deadline_s=600)
    report.section("first", lambda: {"loss": math.nan, "checks": [{"name": "a check", "ok": True}]},
                   torch.device("cpu"))
    assert _strict(path.read_text())["first"]["loss"] is None  # NaN written as null
    report.section("second", lambda: 1 / 0, torch.device("cpu"))
    written = _strict(path.read_text())
    assert written["second"] == {"error": "ZeroDivisionError: division by zero"} and "first" in written
    assert report.finish() is False and _strict(path.read_text())["ok"] is False
