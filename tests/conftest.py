import pytest

from fourfold.testing import RankPool


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(fn, n, *args)` runs a module-level `fn` on n gloo ranks and returns their results."""
    pool = RankPool(max_ranks=8)
    yield pool
    pool.close()
