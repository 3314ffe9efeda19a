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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fourfold", description="4D hybrid parallel training and planning")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="the main job on an embedded default, on local CPU ranks")
    _add_grid_options(demo, "dp=2,x=2,y=2")
    args = parser.parse_args(argv)
    try:
        return {"demo": _demo}[args.command](args, argv)
    except GridError as err:
        print(f"fourfold: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
