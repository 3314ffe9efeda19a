"""`fourfold eval`: mean next-token loss and perplexity of a model (a Hugging Face directory or a
training checkpoint) on a token file or text, on any grid."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from fourfold.cli.options import add_grid_options, launcher_options_removed
from fourfold.config import ATTENTIONS, ConfigError
from fourfold.spec.hardware import DEVICES
from fourfold.spec.job import PRECISIONS, Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import JobError, with_flags
from fourfold.train.launch import inside_torchrun, relaunch_with_torchrun


def add_parser(commands) -> None:
    ev = commands.add_parser("eval", help="mean next-token loss and perplexity of a model on a token file")
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("model", nargs="?", help="a Hugging Face directory or a training checkpoint (as --hf or "
                                                 "--checkpoint, told apart by what the directory holds)")
    source.add_argument("--hf", help="a Hugging Face checkpoint directory (config.json + safetensors)")
    source.add_argument("--checkpoint", help="a training checkpoint (step-N), or a run's checkpoint directory (latest)")
    text = ev.add_mutually_exclusive_group(required=True)
    text.add_argument("--tokens", help="a .npy file of token ids (1-D)")
    text.add_argument("--text", help="text to score: text, JSONL or Parquet files or globs, comma-separated (as "
                                     "data.files), tokenized with the model's tokenizer.json")
    ev.add_argument("--field", default="text", help="with --text: the JSONL field or Parquet column of each "
                                                    "document (default text)")
    ev.add_argument("--cache-dir", default="~/.cache/fourfold", help="with --text: where its token file is kept "
                                                                     "(default ~/.cache/fourfold)")
    ev.add_argument("--seq", type=int, required=True, help="sequence length of each window")
    ev.add_argument("--batch", type=int, default=1, help="windows per data shard per step (default 1)")
    ev.add_argument("--max-tokens", type=int, default=0,
                    help="score only the first windows, up to this many tokens (default 0: the whole file)")
    ev.add_argument("--precision", choices=PRECISIONS, default="float32",
                    help="parameters and activations (default float32; auto: bf16 on GPUs, float32 on CPU)")
    ev.add_argument("--attention", choices=ATTENTIONS, default=None,
                    help="causal, or document: each token attends to its own document only, documents ended by "
                         "the model tokenizer's end-of-document id (default: a training checkpoint's data.attention, "
                         "else causal)")
    ev.add_argument("--capacity-factor", type=float, default=None,
                    help="a mixture's expert capacity, as model.capacity_factor (default: a training checkpoint's, "
                         "else 0: dropless)")
    ev.add_argument("--json", action="store_true", help='print {"loss", "perplexity", "tokens"} as JSON')
    ev.add_argument("--device", choices=DEVICES, default="auto",
                    help="auto (default): CUDA when every rank has a GPU, CPU when there is none; or cpu, cuda")
    add_grid_options(ev, "dp=1")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    layout = resolve(args)
    if not inside_torchrun():
        if args.text:  # tokenized here, once, with the model's own tokenizer: the ranks get the token file
            args.tokens = _eval_tokens(args)
            argv = launcher_options_removed(argv, also=("--text", "--field", "--cache-dir")) + ["--tokens", args.tokens]
        check_before_launch(args, layout)
        return relaunch_with_torchrun(args.nproc_per_node or layout.world_size, launcher_options_removed(argv))
    import json

    import torch.distributed as dist

    from fourfold.parallel.grid import init_process_group

    init_process_group(device=args.device)
    result = score(args, layout)
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"loss {result['loss']:.6f}  perplexity {result['perplexity']:.4f}  over {result['tokens']} tokens")
    dist.destroy_process_group()
    return 0


def resolve(args: argparse.Namespace) -> Layout:
    """The grid of `fourfold eval`, with MODEL resolved into --hf or --checkpoint (a run's checkpoint
    directory: its latest step), as the launcher and every rank resolve it."""
    if args.model:
        from fourfold.checkpoint import CheckpointError
        from fourfold.checkpoint.hf import model_directory

        try:
            path, hf = model_directory(args.model)
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        args.hf, args.checkpoint = (str(path), None) if hf else (None, str(path))
    elif args.checkpoint:
        from fourfold import checkpoint

        args.checkpoint = str(checkpoint.latest(args.checkpoint) or args.checkpoint)
    return Layout.parse(args.grid, args.order)


def score(args: argparse.Namespace, layout: Layout) -> dict:
    """What every rank of `fourfold eval` computes, in the process group that exists (torchrun's,
    or a test's rank pool): the model built and loaded on this rank, then `evaluate`'s
    {"loss", "perplexity", "tokens"} of the token file."""
    import numpy as np

    from fourfold.checkpoint.hf import load_hf
    from fourfold.parallel.grid import Grid
    from fourfold.parallel.model import Model
    from fourfold.parallel.tensor.block import torch_dtype
    from fourfold.train.evaluate import evaluate

    grid = Grid(layout)
    # with pp, this rank's stages, the layers split evenly; scored forward only
    model = Model(grid, _scoring_job(args, layout), _eval_model_config(args),
                  dtype=torch_dtype(args.precision, grid.device), capacity_factor=_capacity_factor(args))
    if args.hf:
        for part in model.parts:
            load_hf(part, args.hf)
    else:  # a training checkpoint, written on any grid
        from fourfold import checkpoint

        checkpoint.load_checkpoint(args.checkpoint, model.module)
    tokens = np.load(args.tokens, mmap_mode="r")
    return evaluate(model, tokens, args.seq, args.batch, args.max_tokens, _end_of_document(args))


def check_before_launch(args: argparse.Namespace, layout: Layout) -> None:
    """Every problem of `fourfold eval`, found before any process starts."""
    import numpy as np

    from fourfold.data.checks import check_token_ids
    from fourfold.spec.rules import check
    from fourfold.train.evaluate import window_count

    if args.max_tokens < 0:
        raise ConfigError("--max-tokens must be >= 0 (0: the whole file)")
    _capacity_factor(args)
    model = _eval_model_config(args)
    job = _scoring_job(args, layout)
    from fourfold.parallel.grid import choose_device

    world = args.nproc_per_node or layout.world_size
    try:
        check(model, job, world=world, gpu=choose_device(args.device, world) == "cuda",
              attention="document" if _end_of_document(args) is not None else "causal")
    except JobError as e:  # the rules name the training config's key: eval's flag is --seq
        raise ConfigError(with_flags(str(e), {"batch.seq": "--seq"})) from None
    check_token_ids(args.tokens, model.vocab, "--tokens")
    try:
        window_count(len(np.load(args.tokens, mmap_mode="r")), args.seq)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _scoring_job(args: argparse.Namespace, layout: Layout) -> Job:
    """The job `fourfold eval` runs: each dp*z shard scores --batch windows at a time, whole
    sequences split over z as in training, one micro-batch through the pipeline stages."""
    return Job(layout, micro_batch=args.batch * layout.z, global_batch=args.batch * layout.z * layout.dp,
               seq=args.seq, precision=args.precision, schedule="gpipe")


def _capacity_factor(args: argparse.Namespace) -> float:
    """--capacity-factor, else the training checkpoint's model.capacity_factor (the run scored its held-out
    windows with it), else 0 (dropless, transformers' arithmetic)."""
    if args.capacity_factor is not None:
        if not (math.isfinite(args.capacity_factor) and args.capacity_factor >= 0):
            raise ConfigError(f"--capacity-factor {args.capacity_factor} must be a number >= 0 (0: dropless)")
        return args.capacity_factor
    if not args.checkpoint:
        return 0.0
    from fourfold import checkpoint

    return checkpoint.read_meta(args.checkpoint).get("config", {}).get("model", {}).get("capacity_factor", 0.0)


def _end_of_document(args: argparse.Namespace) -> int | None:
    """The id that ends each document with --attention document (None: plain causal attention):
    the end-of-document id of the model's tokenizer.json, as training finds it. Without the flag,
    a training checkpoint's data.attention decides."""
    attention = args.attention
    if attention is None:
        attention = "causal"
        if args.checkpoint:
            from fourfold import checkpoint

            attention = checkpoint.read_meta(args.checkpoint).get("config", {}).get("data", {}).get("attention",
                                                                                                    attention)
    if attention != "document":
        return None
    from fourfold.data import corpus

    folder = Path(args.hf or args.checkpoint)
    tokenizer = folder / "tokenizer.json"
    why = "--attention document" if args.attention else "the checkpoint's data.attention = document"
    if not tokenizer.is_file():
        raise ConfigError(f"{why} ends documents at the tokenizer's end-of-document id, and {folder} has no "
                          f"tokenizer.json: put the model's tokenizer.json there, or give --attention causal")
    try:
        return corpus.end_of_document(tokenizer)
    except ValueError as e:
        raise ConfigError(f"{why}: {e}") from None


def _eval_model_config(args: argparse.Namespace):
    from fourfold.models.config import ModelConfig, load_config

    if args.hf:
        if not Path(args.hf, "config.json").is_file():
            raise ConfigError(f"--hf {args.hf} has no config.json; give the directory save_pretrained wrote")
        try:
            return load_config(args.hf)
        except ValueError as e:
            raise ConfigError(f"--hf {args.hf}: {e}") from None
    from fourfold import checkpoint

    try:
        return ModelConfig.from_dict(checkpoint.read_meta(args.checkpoint)["model"])
    except ValueError as e:  # CheckpointError
        raise ConfigError(str(e)) from None


def _eval_tokens(args: argparse.Namespace) -> str:
    """The token file of `--text` (text, JSONL, Parquet files or globs, as data.files takes them),
    tokenized with the model's tokenizer.json as training tokenizes (an end-of-document id after
    each document), and cached."""
    from fourfold.data import corpus

    folder = Path(args.hf or args.checkpoint)
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ConfigError(f"--text needs the model's tokenizer.json, and {folder} has none: tokenize the text with it "
                          f"into a .npy and give --tokens")
    try:
        return str(corpus.prepare(None, 0, args.cache_dir, files=args.text, tokenizer=str(tokenizer),
                                  field=args.field)[1])
    except ValueError as e:
        raise ConfigError(f"--text {args.text}: {e}") from None

