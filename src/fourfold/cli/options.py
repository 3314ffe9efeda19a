"""What every command shares: the parser (no abbreviations, a "did you mean" for unknown flags), the
grid options, the `--section.key value` overrides, and the options only the launching process reads."""

from __future__ import annotations

import argparse

from fourfold.config import config_keys, did_you_mean
from fourfold.spec.layout import DEFAULT_ORDER


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching: `--gpus 256` must not silently mean `--gpus-per-node`, and a
    launcher must not hand torchrun an abbreviation it reads as one of its own options."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def _flags(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def unknown_options(self, unknown: list[str], overrides: bool) -> None:
        """Exit naming each unknown option with the closest known one (a config key for the
        commands that take `--section.key value` overrides)."""
        known = self._flags() + ([f"--{k}" for k in config_keys()] if overrides else [])
        named = [f"{arg}{did_you_mean(arg.split('=')[0], known)}" for arg in unknown if arg.startswith("-")]
        self.error(f"unrecognized arguments: {', '.join(named) or ' '.join(unknown)}")

    def refuse_unknown_flags(self, args: list[str], overrides: bool) -> None:
        """Exit naming the `--flags` of `args` (the command's own, overrides taken out) that this
        command does not have, before argparse gives a value that follows one to a positional
        argument (`eval --hf DIR --nproc 8`: "argument model: not allowed with argument --hf")."""
        flags = set(self._flags())
        unknown = [a for a in args if a.startswith("--") and a != "--" and a.split("=")[0] not in flags]
        if unknown:
            self.unknown_options(unknown, overrides)


def layer_counts(text: str) -> tuple[int, ...]:
    """An argparse type: --stage-layers 7,8,...,7 (empty: the default even split)."""
    try:
        return tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not layer counts: give whole numbers separated by commas, "
                                         f"e.g. 7,8,8,7") from None


def add_grid_options(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--grid", default=default, help=f"grid sizes, dims left out are 1 (default {default})")
    parser.add_argument("--order", default=",".join(DEFAULT_ORDER), help="placement order, innermost first")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="local ranks to launch with torchrun (default: the grid's size)")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the command's own arguments, the `--section.key value` config overrides); ValueError for
    an override without its value."""
    def override(arg: str) -> bool:
        return arg.startswith("--") and "." in arg.split("=")[0]

    known, overrides, i = [], [], 0
    while i < len(argv):
        if override(argv[i]):
            flag, eq, value = argv[i].partition("=")
            if eq:
                overrides += [flag, value]
                i += 1
            elif i + 1 == len(argv) or override(argv[i + 1]):
                raise ValueError(f"{flag} needs a value: {flag} VALUE (or {flag}=VALUE)")
            else:
                overrides += argv[i : i + 2]
                i += 2
        else:
            known.append(argv[i])
            i += 1
    return known, overrides


def launcher_options_removed(argv: list[str], also: tuple[str, ...] = ()) -> list[str]:
    """`argv` for the ranks: without the options (and their values) that only the launching
    process reads (torchrun would also take `--nproc...` for an abbreviation of its own options),
    and without the options `also` names."""
    dropped = ("--nproc-per-node", "--max-restarts", *also)
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in dropped:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in dropped)):
            out.append(arg)
    return out
