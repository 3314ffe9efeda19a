"""Peak host memory (RSS) of the largest rank for a checkpoint save and a cross-grid load.

A Llama of 63M parameters (hidden 768, 8 layers, vocab 4096) trains 2 steps on x2 y2 z2 and saves;
a fresh world of dp2 y2 z2 loads it (model and optimizer state) and takes a step. Each phase is
also run on a tiny model of the same shape family, whose peak is the process overhead (torch,
gloo, the step itself): the difference is what the model's size adds; and the 63M model's step on
dp2 y2 z2 without a load shows what the load itself adds. Run from the repository root:

    .venv/bin/python benchmarks/checkpoint_memory.py
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

BIG = dict(hidden=768, layers=8, heads=12, kv_heads=12, ffn=2048, vocab=4096)
TINY = dict(hidden=64, layers=8, heads=4, kv_heads=4, ffn=128, vocab=4096)
SAVE_GRID, LOAD_GRID = "x=2,y=2,z=2", "dp=2,y=2,z=2"


def _rank(sizes: dict, grid_text: str, phase: str, root: str) -> None:
    from fourfold import checkpoint
    from fourfold.models.config import ModelConfig
    from fourfold.parallel.data import GradientSync
    from fourfold.parallel.grid import Grid, init_process_group
    from fourfold.parallel.optimizer import AdamW
    from fourfold.parallel.transformer import Transformer

    init_process_group()
    grid = Grid.parse(grid_text)
    cfg = ModelConfig("llama", max_positions=256, tied=False, eps=1e-5, **sizes)
    model = Transformer(grid, cfg)
    opt = AdamW(GradientSync(model, grid), lr=1e-3)
    if phase == "load":
        checkpoint.load_checkpoint(checkpoint.latest(root), model, opt)
    ids = torch.randint(0, cfg.vocab, (2 // grid.size("z"), 129), generator=torch.Generator().manual_seed(0))
    for _ in range(2 if phase == "save" else 1):  # "load" and "step": one step
        model(ids[:, :-1], ids[:, 1:]).sum().backward()
        opt.step()
    if phase == "save":
        checkpoint.save(root, 2, model, opt, {}, keep=1)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10])  # MiB
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if grid.rank == 0:
        print(json.dumps({"peak_mib": peak.item()}))
    dist.destroy_process_group()


def _run(sizes: dict, grid_text: str, phase: str, root: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", __file__,
           json.dumps(sizes), grid_text, phase, root]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    from fourfold.models.config import ModelConfig

    state = ModelConfig("llama", max_positions=256, tied=False, eps=1e-5, **BIG).parameter_count() * 16 / 2**20
    print(f"model: {ModelConfig('llama', max_positions=256, tied=False, eps=1e-5, **BIG).parameter_count() / 1e6:.0f}M "
          f"parameters; fp32 training state (weights, gradients, Adam m, v) {state:.0f} MiB, "
          f"{state / 8:.0f} MiB a rank")
    # the same step on the load grid without loading: what the load itself adds
    with tempfile.TemporaryDirectory() as root:
        fresh = _run(BIG, LOAD_GRID, "step", root)
    print(f"step on {LOAD_GRID} without a load: largest rank's peak RSS {fresh:.0f} MiB")
    for phase, grid_text in (("save", SAVE_GRID), ("load", LOAD_GRID)):
        peaks = {}
        for name, sizes in (("tiny", TINY), ("63M", BIG)):
            with tempfile.TemporaryDirectory() as root:
                if phase == "load":
                    _run(sizes, SAVE_GRID, "save", root)
                peaks[name] = _run(sizes, grid_text, phase, root)
        added = peaks["63M"] - peaks["tiny"]
        print(f"{phase} on {grid_text}: largest rank's peak RSS {peaks['63M']:.0f} MiB, tiny model {peaks['tiny']:.0f} "
              f"MiB: the model adds {added:.0f} MiB ({added / state:.2f} of the whole state)")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _rank(json.loads(sys.argv[1]), *sys.argv[2:])
    else:
        main()
