"""`fourfold generate`: sample text from a training checkpoint or a Hugging Face directory."""

from __future__ import annotations

import argparse

from fourfold.config import ConfigError


def add_parser(commands) -> None:
    gen = commands.add_parser("generate", help="sample text from a training checkpoint or a Hugging Face directory",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("checkpoint", help="a step-N checkpoint directory, a run's checkpoint directory (latest), or a "
                                        "Hugging Face directory (config.json, safetensors, tokenizer.json)")
    gen.add_argument("--prompt", default="In the beginning", help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=48, help="tokens to sample after the prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=0, help="the sampler's random seed")


def run(args: argparse.Namespace) -> int:
    from fourfold.train.generate import generate

    try:
        print(generate(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.seed))
    except ValueError as err:  # CheckpointError, JobError, a temperature or prompt it cannot take
        raise ConfigError(str(err)) from None
    return 0
