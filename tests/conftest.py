"""The suite's fixtures, and FOURFOLD_NO_TORCH: when it is set, torch cannot be imported, so that
`FOURFOLD_NO_TORCH=1 pytest -m torch_free` shows that the torch_free tests need no torch (`make test`
runs them that way). A test module that imports torch is skipped at collection (none of its tests
can be torch-free), and a torch_free test that imports torch fails. This file imports nothing
that imports torch."""

import importlib.abc
import os
import sys

import pytest

from fourfold.testing import RankPool


class _NoTorch(importlib.abc.MetaPathFinder):
    collecting = True

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "torch":
            return None
        if self.collecting and not _importing_a_torch_free_module():
            raise pytest.skip.Exception(f"imports {name} (FOURFOLD_NO_TORCH)", allow_module_level=True)
        raise ModuleNotFoundError(f"FOURFOLD_NO_TORCH is set: a torch_free test (or its module) imported {name}")


def _importing_a_torch_free_module() -> bool:
    """Whether a test module marked torch_free is among those being imported (its import of torch is
    an error, not a reason to skip it)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_globals.get("__file__") or ""
        if path.endswith(".py") and os.path.basename(path).startswith("test_"):
            with open(path, encoding="utf-8") as f:
                if "pytestmark = pytest.mark.torch_free" in f.read():
                    return True
        frame = frame.f_back
    return False


NO_TORCH = _NoTorch() if os.environ.get("FOURFOLD_NO_TORCH") else None
if NO_TORCH:
    sys.meta_path.insert(0, NO_TORCH)


def pytest_collection_finish(session):
    if NO_TORCH:
        NO_TORCH.collecting = False


@pytest.fixture(autouse=True)
def cpu_tests_see_no_gpu(request, monkeypatch):
    """Every test but tests/gpu's compares with a CPU (gloo) reference: it and every process it
    starts (torchrun's ranks, the rank pool's workers) see no GPU, so that `make test` on a GPU box
    runs them as on CPU, and train.device auto takes gloo. Tests that fake a GPU count themselves
    (test_device's `gpus`) keep theirs."""
    if request.node.get_closest_marker("gpu") is None and "gpus" not in request.fixturenames:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    else:
        from fourfold.parallel.grid import FAKE_GPUS

        monkeypatch.delenv(FAKE_GPUS, raising=False)


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(fn, n, *args)` runs a module-level `fn` on n gloo ranks and returns their results."""
    # what most ranks import, once in the fork server: 0.7 s (the trainer) and 2.8 s (transformers'
    # modelling) a worker otherwise, 8 workers at each of the pool's restarts
    pool = RankPool(max_ranks=8, preload=("fourfold.train.trainer", "transformers.models.llama.modeling_llama"))
    yield pool
    pool.close()
