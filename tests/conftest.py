import pytest

from fourfold.parallel.grid import FAKE_GPUS
from fourfold.testing import RankPool


@pytest.fixture(autouse=True)
def cpu_tests_see_no_gpu(request, monkeypatch):
    """Every test but tests/gpu's compares with a CPU (gloo) reference: it and every process it
    starts (torchrun's ranks, the rank pool's workers) see no GPU, so that `make test` on a GPU box
    runs them as on CPU, and train.device auto takes gloo. Tests that fake a GPU count themselves
    (test_device's `gpus`) keep theirs."""
    if request.node.get_closest_marker("gpu") is None and "gpus" not in request.fixturenames:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    else:
        monkeypatch.delenv(FAKE_GPUS, raising=False)


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(fn, n, *args)` runs a module-level `fn` on n gloo ranks and returns their results."""
    pool = RankPool(max_ranks=8)
    yield pool
    pool.close()
