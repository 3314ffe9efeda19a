"""The small-model memory check of tests/plan/test_planner_measured.py with its figures printed: the
estimate against torch's MemTracker on 4 gloo ranks, and fourfold.tools.measure's FakeTensorMode peak
of the same setups. Run from the repository root (it reuses the test's cases and measurement):

    OMP_NUM_THREADS=1 python benchmarks/memory_small_cpu.py
"""

import sys
import warnings

sys.path[:0] = ["tests/plan", "tests"]

from test_planner_measured import CASES, CFG, DEVICE_TERMS, MICRO, SEQ, _measured_peak  # noqa: E402

from fourfold.plan.memory import fourfold_memory  # noqa: E402
from fourfold.spec.job import Job  # noqa: E402
from fourfold.spec.layout import Layout  # noqa: E402
from fourfold.testing import RankPool  # noqa: E402
from fourfold.tools.measure import measure_peak  # noqa: E402


def job_of(sizes: dict, seq_parallel: bool, recompute: str) -> Job:
    return Job(Layout(**sizes), micro_batch=MICRO, seq=SEQ, global_batch=MICRO * sizes.get("dp", 1),
               recompute=recompute, seq_parallel=seq_parallel, precision="float32")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    pool = RankPool(max_ranks=4)
    for sizes, sp, rec in CASES:
        measured = max(pool.run(_measured_peak, 4, sizes, sp, rec))
        terms = fourfold_memory(CFG, job_of(sizes, sp, rec), 80).terms
        estimate = sum(v for k, v in terms.items() if k not in DEVICE_TERMS)
        print(f"{sizes} sp={sp} {rec}: MemTracker {measured / 2**20:.2f} MiB, estimate {estimate / 2**20:.2f} MiB "
              f"({100 * (estimate / measured - 1):+.1f}%)")
    pool.close()
    for sizes, sp, rec in CASES:
        print(f"{sizes} fake: {measure_peak(CFG, job_of(sizes, sp, rec)).peak_bytes / 2**20:.2f} MiB")
