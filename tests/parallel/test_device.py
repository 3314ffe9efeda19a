"""train.device: which device and backend the ranks of a node take, decided on CPU with the GPU
count faked (torch.cuda.is_available / device_count), and refused with its fix when the GPUs are
too few for the ranks. And the install (`make`) that keeps a torch the Python already has."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fourfold.config import ConfigError, load_train_config, validate
from fourfold.parallel import grid
from fourfold.spec.layout import GridError


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): torch sees n CUDA GPUs."""
    def see(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return see


def test_cpu_tests_see_no_gpu_even_where_there_are(monkeypatch):
    """tests/conftest.py hides the GPUs from every CPU-reference test, in its process and in the
    ones it starts; FOURFOLD_FAKE_GPUS stands for a GPU box (docs/architecture.md, Tests)."""
    monkeypatch.setenv(grid.FAKE_GPUS, "8")
    assert grid.choose_device("auto", 8) == "cpu"
    started = subprocess.run([sys.executable, "-c", "from fourfold.parallel.grid import choose_device; "
                              "print(choose_device('auto', 8))"], capture_output=True, text=True, check=True)
    assert started.stdout.strip() == "cpu"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # what a test without the conftest's guard would see
    assert grid.choose_device("auto", 8) == "cuda"


def test_auto_takes_cuda_only_when_every_rank_has_a_gpu(gpus):
    gpus(0)
    assert grid.choose_device("auto", 8) == "cpu"
    gpus(8)
    assert grid.choose_device("auto", 8) == "cuda"
    assert grid.choose_device("cpu", 8) == "cpu"  # a CPU run stays one whatever the machine has


def test_more_ranks_than_gpus_is_refused_with_the_fix(gpus):
    gpus(1)
    for choice in ("auto", "cuda"):
        with pytest.raises(GridError, match=r"8 ranks per node but 1 visible GPU: .*use --train.device cpu"):
            grid.choose_device(choice, 8)
    gpus(0)
    with pytest.raises(GridError, match="sees no GPU; use --train.device cpu"):
        grid.choose_device("cuda", 1)


def test_an_unknown_device_is_refused_before_launch():
    cfg = load_train_config(None, ["--train.device", "gpu"])
    with pytest.raises(ConfigError, match="train.device 'gpu' is none of auto, cpu, cuda"):
        validate(cfg, cfg.layout().world_size)


@pytest.fixture
def started(monkeypatch):
    """The process groups init_process_group would create, as (backend, device_id), and the
    devices it selects; under a torchrun environment of rank 3 of 8 on one node."""
    calls = {"groups": [], "selected": []}
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls["groups"].append((backend, kw.get("device_id"))))
    monkeypatch.setattr(torch.cuda, "set_device", calls["selected"].append)
    for name, value in dict(RANK="3", LOCAL_RANK="3", WORLD_SIZE="8", LOCAL_WORLD_SIZE="8").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return calls


def test_the_rank_takes_the_chosen_backend(gpus, started):
    gpus(8)
    grid.init_process_group(device="cpu")
    grid.init_process_group(device="auto")
    assert started["groups"] == [("gloo", None), ("nccl", torch.device("cuda", 3))]
    assert started["selected"] == [torch.device("cuda", 3)]
    gpus(1)  # (checked before launch; a rank started anyway fails before touching a device)
    with pytest.raises(GridError, match="8 ranks per node but 1 visible GPU"):
        grid.init_process_group()
    assert len(started["groups"]) == 2


@pytest.mark.parametrize("python, kept", [(sys.executable, True), (f"{sys.executable} -S", False)],
                         ids=["with-torch", "without-torch"])
def test_make_keeps_the_pythons_own_torch(tmp_path, python, kept):
    """The commands `make` would run to create a venv from `python` (-S: one that imports no torch)."""
    venv = tmp_path / "venv"
    commands = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"PYTHON={python}", f"{venv}/.installed"],
                              cwd=Path(__file__).parents[2], capture_output=True, text=True, check=True).stdout
    assert ("--system-site-packages" in commands) == kept
    assert ('pip install --quiet "torch==' in commands) != kept  # installed only when there is none
    assert f"-c {venv}/torch.txt -e" in commands  # pip held to the torch there is, whichever


@pytest.mark.parametrize("argv", [["train", "--grid.dp", "2"], ["train", "--grid.x", "2", "--train.device", "cuda"]])
def test_the_command_refuses_before_launch(gpus, monkeypatch, capsys, argv):
    """More ranks than GPUs: `fourfold train` says so, with the fix, and starts no process."""
    from fourfold.cli.main import main

    gpus(1)
    monkeypatch.setattr("fourfold.cli.train.relaunch_with_torchrun", lambda *a, **k: pytest.fail("launched"))
    assert main(argv) == 2
    assert "2 ranks per node but 1 visible GPU: NCCL needs a GPU per rank; use --train.device cpu" in \
        capsys.readouterr().err


def test_tensor_overlap_orders_kernel_launches_unless_the_user_chose():
    """With tensor-parallel overlap on GPUs, one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, as
    Megatron-LM sets): a collective launched before a GEMM starts before it. A user's own value stays."""
    environ = {}
    grid.order_kernel_launches(environ)
    assert environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    environ = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    grid.order_kernel_launches(environ)
    assert environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
