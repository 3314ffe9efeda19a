"""The AdamW update on flat ZeRO-1 shards: fourfold's former Python loop of in-place ops per
bucket against torch's fused AdamW kernel over every shard at once (what fourfold.parallel.optimizer runs),
both with global-norm clipping. One process, no collectives: the update's arithmetic only.

Run: .venv/bin/python benchmarks/optimizer_step.py [--mib 256] [--bucket-mib 25] [--repeat 5]
"""

import argparse
import math
import time

import torch
from torch.optim.adamw import adamw

LR, B1, B2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0


def loop_step(masters, ms, vs, grads, step: int, scale: torch.Tensor) -> None:
    """The former fourfold.parallel.optimizer update, bucket by bucket (the denominator in the gradient's storage)."""
    step_size = LR / (1 - B1**step)
    root_correction = math.sqrt(1 - B2**step)
    for master, m, v, g in zip(masters, ms, vs, grads):
        g.mul_(scale)
        m.mul_(B1).add_(g, alpha=1 - B1)
        v.mul_(B2).addcmul_(g, g, value=1 - B2)
        denom = torch.sqrt(v, out=g).div_(root_correction).add_(EPS)
        master.mul_(1 - LR * WD).addcdiv_(m, denom, value=-step_size)


def fused_step(masters, ms, vs, grads, steps, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """fourfold.parallel.optimizer's update: one foreach multiply (clipping), one fused kernel."""
    torch._foreach_mul_(grads, scale)
    adamw(masters, grads, ms, vs, [], steps, fused=True, amsgrad=False, beta1=B1, beta2=B2, lr=LR,
          weight_decay=WD, eps=EPS, maximize=False, found_inf=found_inf)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=256, help="fp32 master weights of this rank's shards")
    parser.add_argument("--bucket-mib", type=float, default=25)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    sizes = [int(args.bucket_mib * 2**20 / 4)] * int(args.mib // args.bucket_mib)
    init = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) for n in sizes]
    scale = torch.tensor(0.5, dtype=torch.float64)  # a clipping factor, as the global norm gives it
    found_inf = torch.zeros(())
    results, ends = {}, {}
    for name in ("loop", "fused"):
        masters = [t.clone() for t in init]
        ms, vs = [torch.zeros_like(t) for t in init], [torch.zeros_like(t) for t in init]
        steps = [torch.zeros(()) for _ in init]
        best = math.inf
        for i in range(1, args.repeat + 2):  # the first is a warm-up
            work = [t.clone() for t in grads]  # (both write into the gradients' storage)
            start = time.perf_counter()
            if name == "loop":
                loop_step(masters, ms, vs, work, i, scale)
            else:
                fused_step(masters, ms, vs, work, steps, scale, found_inf)
            best = min(best, time.perf_counter() - start) if i > 1 else best
        results[name], ends[name] = best, masters
    diff = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(ends["loop"], ends["fused"]))
    print(f"{sum(sizes) * 4 / 2**20:.0f} MiB fp32 master weights in {len(sizes)} shards, "
          f"{torch.get_num_threads()} threads, best of {args.repeat} steps")
    print(f"Python loop per bucket  {results['loop']:8.3f} s/step")
    print(f"fused AdamW, all shards {results['fused']:8.3f} s/step   {results['loop'] / results['fused']:.2f}x")
    print(f"largest difference after {args.repeat + 1} steps: {diff:.1e} of the largest weight (float32 rounding)")


if __name__ == "__main__":
    main()
