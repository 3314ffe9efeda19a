"""`fourfold generate`: sample text from a training checkpoint or a Hugging Face directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fourfold.config import ConfigError


def add_parser(commands) -> None:
    gen = commands.add_parser("generate", help="sample text from a training checkpoint or a Hugging Face directory",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("checkpoint", help="a step-N checkpoint directory, a run's checkpoint directory (latest), or a "
                                        "Hugging Face directory (config.json, safetensors, tokenizer.json)")
    gen.add_argument("--prompt", help="the text to continue (default: In the beginning); with --chat, the user's turn")
    gen.add_argument("--max-new-tokens", type=int, default=48, help="tokens to sample after the prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=0, help="the sampler's random seed")
    gen.add_argument("--chat", action="store_true",
                     help="the prompt is a user's turn, rendered with the model's chat template; prints the reply")
    gen.add_argument("--system", default="", help="with --chat: a system turn before the prompt")
    gen.add_argument("--messages", help="a JSON file of the conversation to answer ([{role, content}, ...] or "
                                        "{\"messages\": [...]}), rendered with the chat template; prints the reply")
    gen.add_argument("--template", default="default", help="which of the model's chat templates (e.g. tool_use)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="end the sample once it holds TEXT (repeatable); it always ends at the model's end-of-turn "
                          "and end-of-document tokens")
    gen.add_argument("--special-tokens", action="store_true", help="show special tokens (the turns' markers)")


def _messages(path: str | None) -> list[dict] | None:
    if path is None:
        return None
    try:
        found = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--messages {path}: {e}; give a JSON file of [{{\"role\", \"content\"}}, ...]") from None
    found = found.get("messages") if isinstance(found, dict) else found
    if not (isinstance(found, list) and found and all(isinstance(m, dict) and "role" in m for m in found)):
        raise ConfigError(f"--messages {path} holds no conversation; give a list of {{\"role\", \"content\"}} "
                          f"objects, or {{\"messages\": [...]}}")
    return found


def run(args: argparse.Namespace) -> int:
    from fourfold.train.generate import generate

    messages = _messages(args.messages)
    if messages and (args.prompt is not None or args.system):
        raise ConfigError("--messages is the whole conversation: give it, or --prompt (and --system) with --chat")
    if (args.system or args.template != "default") and not (args.chat or messages):
        raise ConfigError(f"{'--system' if args.system else '--template'} renders a conversation: add --chat")
    prompt = args.prompt if args.prompt is not None else "In the beginning"
    try:
        print(generate(args.checkpoint, prompt, args.max_new_tokens, args.temperature, args.seed, chat=args.chat,
                       system=args.system, messages=messages, template=args.template, stop_strings=args.stop,
                       special_tokens=args.special_tokens))
    except ValueError as err:  # CheckpointError, JobError, a temperature, prompt or template it cannot take
        raise ConfigError(str(err)) from None
    return 0
