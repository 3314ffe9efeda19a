"""Ring attention's CUDA kernels (`context.attend_block`, `attend_block_backward`) in bf16, forward
and backward, on each kind of block the ring computes, against float32 references; one process,
one GPU (under torchrun each rank uses its own). The bounds are bf16's own (kernel_checks.py).

Run: python -m pytest tests/gpu/test_kernels.py -m gpu
"""

import os

import pytest
import torch

from fourfold.parallel.context import attend_block

from .kernel_checks import BLOCKS, SHAPES, Shape, check_block, random_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: these tests run torch's CUDA flash-attention kernels")]


def _device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS)
def test_block_matches_float32_within_bf16_error(block: str, shape: Shape):
    checks = check_block(block, shape, _device())
    failed = [f"{c['name']}: error {c['max_error']:.3g} > bound {c['bound']:.3g}" for c in checks if not c["ok"]]
    assert not failed, "\n".join(failed)


def test_float32_is_refused_on_cuda():
    """CUDA's flash kernel takes bf16 or fp16 only: the contract says so before the kernel does."""
    q, k, v, _ = random_inputs(SHAPES[0], _device())
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        attend_block(q.float(), k.float(), v.float(), True, 1.0)
