"""`fourfold export`: a training checkpoint as a Hugging Face model directory."""

from __future__ import annotations

import argparse
import shlex
import warnings

from fourfold.config import ConfigError


def add_parser(commands) -> None:
    ex = commands.add_parser("export", help="write a training checkpoint as a Hugging Face model directory")
    ex.add_argument("checkpoint", help="a step-N checkpoint directory, or a run's checkpoint directory (latest)")
    ex.add_argument("output", help="the directory to write config.json, model.safetensors and tokenizer.json to")


def run(args: argparse.Namespace) -> int:
    from fourfold.checkpoint import CheckpointError
    from fourfold.checkpoint.export import export

    try:
        with warnings.catch_warnings():  # DCP's note that it reads in one process: that is the intent here
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            path = export(args.checkpoint, args.output)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    print(f"wrote {args.output} from {path}: load it with --model.hf {shlex.quote(args.output)}, `fourfold eval --hf`, "
          f"or transformers' from_pretrained")
    return 0
