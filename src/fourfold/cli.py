"""The `fourfold` command line."""

from __future__ import annotations

import argparse
import sys

from fourfold.launch import inside_torchrun, relaunch_with_torchrun
from fourfold.layout import DEFAULT_ORDER, GridError, Layout


def _add_grid_options(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--grid", default=default, help=f"grid sizes, dims left out are 1 (default {default})")
    parser.add_argument("--order", default=",".join(DEFAULT_ORDER), help="placement order, innermost first")
    parser.add_argument("--nproc", type=int, default=None, help="local ranks to launch with torchrun (default: the grid's size)")


def _demo(args: argparse.Namespace, argv: list[str]) -> int:
    layout = Layout.parse(args.grid, args.order)  # fails here, before any process starts
    if not inside_torchrun():
        return relaunch_with_torchrun(args.nproc or layout.world_size, argv)
    from fourfold.demo import run_demo

    run_demo(layout)
    return 0


DTYPES = ("float32", "float64", "bfloat16")


def _eval(args: argparse.Namespace, argv: list[str]) -> int:
    layout = Layout.parse(args.grid, args.order)
    if not inside_torchrun():
        return relaunch_with_torchrun(args.nproc or layout.world_size, argv)
    import json

    import numpy as np
    import torch
    import torch.distributed as dist

    from fourfold.evaluate import evaluate
    from fourfold.grid import Grid, init_process_group
    from fourfold.models.config import load_config
    from fourfold.models.hf import load_hf
    from fourfold.models.transformer import Transformer
    from fourfold.tensor.block import TensorOptions

    init_process_group()
    grid = Grid(layout)
    model = Transformer(grid, load_config(args.hf), TensorOptions(dtype=getattr(torch, args.dtype))).to(grid.device)
    load_hf(model, args.hf)
    tokens = np.load(args.tokens, mmap_mode="r")
    result = evaluate(model, grid, tokens, args.seq, args.batch)
    if grid.rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"loss {result['loss']:.6f}  perplexity {result['perplexity']:.4f}  over {result['tokens']} tokens")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fourfold", description="4D hybrid parallel training and planning")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="the main job on an embedded default, on local CPU ranks")
    _add_grid_options(demo, "dp=2,x=2,y=2")
    ev = commands.add_parser("eval", help="mean next-token loss and perplexity of a model on a token file")
    ev.add_argument("--hf", required=True, help="a Hugging Face checkpoint directory (config.json + safetensors)")
    ev.add_argument("--tokens", required=True, help="a .npy file of token ids (1-D)")
    ev.add_argument("--seq", type=int, required=True, help="sequence length of each window")
    ev.add_argument("--batch", type=int, default=1, help="windows per data shard per step")
    ev.add_argument("--dtype", choices=DTYPES, default="float32")
    ev.add_argument("--json", action="store_true", help='print {"loss", "perplexity", "tokens"} as JSON')
    _add_grid_options(ev, "dp=1")
    from fourfold.plan.cli import add_commands, run as run_planner

    add_commands(commands)
    args = parser.parse_args(argv)
    if args.command in ("memory", "estimate", "plan"):
        return run_planner(args)
    try:
        return {"demo": _demo, "eval": _eval}[args.command](args, argv)
    except GridError as err:
        print(f"fourfold: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
