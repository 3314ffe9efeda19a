"""The `fourfold` command line: one parser, each command's options and body in its own module."""

from __future__ import annotations

import os
import signal
import sys

from fourfold.cli import demo, export, generate, plan, simulate, train
from fourfold.cli import eval as evaluation
from fourfold.cli.options import Parser, split_overrides
from fourfold.config import ConfigError
from fourfold.spec.layout import GridError
from fourfold.spec.rules import JobError

TAKE_OVERRIDES = ("train", "slurm", "demo", "prepare")


def parser() -> tuple[Parser, dict[str, Parser]]:
    """The top-level parser and each command's."""
    top = Parser(prog="fourfold", description="4D hybrid parallel training and planning")
    commands = top.add_subparsers(dest="command", required=True)  # each a Parser too (argparse's parser_class)
    demo.add_parser(commands)
    evaluation.add_parser(commands)
    train.add_parsers(commands)
    generate.add_parser(commands)
    export.add_parser(commands)
    simulate.add_parser(commands)
    plan.add_commands(commands)
    return top, commands.choices


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:  # the reader of our output closed it (`fourfold plan ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 1


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top, commands = parser()
    try:
        known, overrides = split_overrides(argv)
    except ValueError as err:
        top.error(str(err))
    command = next((a for a in known if a in commands), None)
    if command is not None:  # an unknown flag before argparse reads on: its value must not land in a positional
        commands[command].refuse_unknown_flags(known[known.index(command) + 1:], command in TAKE_OVERRIDES)
    args, unknown = top.parse_known_args(known)
    takes = args.command in TAKE_OVERRIDES
    if unknown or overrides and not takes:
        # a command that takes `--section.key value` overrides checks their keys itself, one by one
        commands[args.command].unknown_options(unknown + ([] if takes else overrides[::2]), overrides=takes)
    if args.command in ("memory", "estimate", "plan", "calibrate"):
        return plan.run(args)
    try:
        if args.command == "train":
            return train.train(args, argv, overrides)
        if args.command == "slurm":
            return train.slurm(args, overrides)
        if args.command == "prepare":
            return train.prepare(args, overrides)
        if args.command == "demo":
            return demo.run(overrides)
        if args.command == "eval":
            return evaluation.run(args, argv)
        return {"generate": generate, "simulate": simulate, "export": export}[args.command].run(args)
    except (GridError, ConfigError, JobError) as err:
        print(f"fourfold: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a training rank notes the signal instead, and stops at a step boundary)
        print("fourfold: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
