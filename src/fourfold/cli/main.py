"""The `fourfold` command line."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
import warnings
from pathlib import Path

from fourfold.train.launch import StopRequest, inside_torchrun, relaunch_with_torchrun
from fourfold.spec.job import PRECISIONS, RECOMPUTE
from fourfold.spec.layout import DEFAULT_ORDER, GridError, Layout
from fourfold.spec.rules import JobError, with_flags
from fourfold.spec.trainconfig import ConfigError, sections_help


def _add_grid_options(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--grid", default=default, help=f"grid sizes, dims left out are 1 (default {default})")
    parser.add_argument("--order", default=",".join(DEFAULT_ORDER), help="placement order, innermost first")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="local ranks to launch with torchrun (default: the grid's size)")


def _demo(args: argparse.Namespace, overrides: list[str]) -> int:
    from fourfold.cli.demo import DEMO_CONFIG, print_plan, show_samples
    from fourfold.spec.trainconfig import load_train_config

    # Every demo run trains from scratch in its own directory (a user's --log.run_dir still wins).
    overrides = ["--log.run_dir", time.strftime("runs/demo-%Y%m%d-%H%M%S"), *overrides]
    cfg = load_train_config(DEMO_CONFIG, overrides)
    print(f"fourfold demo: training {cfg.model.preset} on the bundled King James Bible, config {DEMO_CONFIG}")
    run = argparse.Namespace(config=DEMO_CONFIG, nproc_per_node=None, max_restarts=0)
    code = _train(run, ["train", DEMO_CONFIG, *overrides], overrides)
    if code:
        return code
    show_samples(str(cfg.checkpoint_dir))
    print_plan()
    return 0


def _eval_job(args: argparse.Namespace, layout: Layout) -> None:
    """Every problem of `fourfold eval`, found before any process starts."""
    import numpy as np

    from fourfold.train.evaluate import window_count
    from fourfold.spec.job import Job
    from fourfold.spec.rules import check
    from fourfold.spec.trainconfig import check_token_ids

    if args.max_tokens < 0:
        raise ConfigError("--max-tokens must be >= 0 (0: the whole file)")
    if layout.pp > 1:
        raise ConfigError(f"fourfold eval runs the whole model on each rank, without pipeline stages: leave pp out "
                          f"of --grid {args.grid} (dp, cp, x, y and z all work)")
    model = _eval_model_config(args)
    # each dp*z shard scores `batch` windows at a time, whole sequences split over z as in training
    job = Job(layout, micro_batch=args.batch * layout.z, global_batch=args.batch * layout.z * layout.dp,
              seq=args.seq, precision=args.precision)
    import torch

    try:
        check(model, job, world=args.nproc_per_node, gpu=torch.cuda.is_available())
    except JobError as e:  # the rules name the training config's key: eval's flag is --seq
        raise ConfigError(with_flags(str(e), {"batch.seq": "--seq"})) from None
    check_token_ids(args.tokens, model.vocab, "--tokens")
    try:
        window_count(len(np.load(args.tokens, mmap_mode="r")), args.seq)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
        return ModelConfig.from_dict(checkpoint.read_meta(checkpoint.latest(args.checkpoint) or args.checkpoint)["model"])
    except ValueError as e:  # CheckpointError
        raise ConfigError(str(e)) from None


def _eval(args: argparse.Namespace, argv: list[str]) -> int:
    if args.model:
        from fourfold.checkpoint import CheckpointError
        from fourfold.checkpoint.hf import model_directory

        try:
            path, hf = model_directory(args.model)
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        args.hf, args.checkpoint = (str(path), None) if hf else (None, str(path))
    layout = Layout.parse(args.grid, args.order)
    if not inside_torchrun():
        if args.text:  # tokenized here, once, with the model's own tokenizer: the ranks get the token file
            args.tokens = _eval_tokens(args)
            argv = _launcher_options_removed(argv, also=("--text", "--field", "--cache-dir")) + ["--tokens", args.tokens]
        _eval_job(args, layout)
        return relaunch_with_torchrun(args.nproc_per_node or layout.world_size, _launcher_options_removed(argv))
    model_cfg = _eval_model_config(args)
    import json

    import numpy as np
    import torch.distributed as dist

    from fourfold.train.evaluate import evaluate
    from fourfold.parallel.grid import Grid, init_process_group
    from fourfold.checkpoint.hf import load_hf
    from fourfold.parallel.transformer import Transformer
    from fourfold.parallel.tensor.block import TensorOptions, torch_dtype

    init_process_group()
    grid = Grid(layout)
    model = Transformer(grid, model_cfg, TensorOptions(dtype=torch_dtype(args.precision, grid.device))).to(grid.device)
    if args.hf:
        load_hf(model, args.hf)
    else:  # a training checkpoint, written on any grid
        from fourfold import checkpoint

        checkpoint.load_checkpoint(checkpoint.latest(args.checkpoint) or args.checkpoint, model)
    tokens = np.load(args.tokens, mmap_mode="r")
    result = evaluate(model, grid, tokens, args.seq, args.batch, args.max_tokens)
    if grid.rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"loss {result['loss']:.6f}  perplexity {result['perplexity']:.4f}  over {result['tokens']} tokens")
    dist.destroy_process_group()
    return 0


def _launcher_options_removed(argv: list[str], also: tuple[str, ...] = ()) -> list[str]:
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


def _eval_tokens(args: argparse.Namespace) -> str:
    """The token file of `--text` (text, JSONL, Parquet files or globs, as data.files takes them),
    tokenized with the model's tokenizer.json as training tokenizes (an end-of-document id after
    each document), and cached."""
    from fourfold import checkpoint
    from fourfold.data import corpus

    folder = Path(args.hf) if args.hf else checkpoint.latest(args.checkpoint) or Path(args.checkpoint)
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ConfigError(f"--text needs the model's tokenizer.json, and {folder} has none: tokenize the text with it "
                          f"into a .npy and give --tokens")
    try:
        return str(corpus.prepare(None, 0, args.cache_dir, files=args.text, tokenizer=str(tokenizer),
                                  field=args.field)[1])
    except ValueError as e:
        raise ConfigError(f"--text {args.text}: {e}") from None


def _train(args: argparse.Namespace, argv: list[str], overrides: list[str]) -> int:
    from fourfold.spec.trainconfig import load_train_config, resolve_auto_grid, validate

    cfg = load_train_config(args.config, overrides)
    if not inside_torchrun():  # check everything and prepare the data before any process starts
        world = args.nproc_per_node or cfg.layout().world_size
        if cfg.grid.auto:
            chosen = resolve_auto_grid(cfg, world)
            print(f"grid.auto: the planner's choice for {cfg.hardware.gpu}: {chosen}")
            argv = _resolved(argv, cfg)
        import torch

        validate(cfg, world, gpu=torch.cuda.is_available())
        argv = argv + _before_launch(cfg)
        return relaunch_with_torchrun(world, _launcher_options_removed(argv), max_restarts=args.max_restarts)
    stop = StopRequest()  # before torch is imported: a signal from now on stops the run at a step boundary
    import torch.distributed as dist

    from fourfold.parallel.grid import init_process_group
    from fourfold.train.trainer import train

    init_process_group()
    try:
        summary = train(cfg, stop)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0 and not summary["stopped"]:  # a stopped run has said so in one line
        print(json.dumps(summary))
    return 0


def _resolved(argv: list[str], cfg) -> list[str]:
    """`argv` with the job the planner chose, for the ranks to read."""
    values = {f"grid.{d}": getattr(cfg.grid, d) for d in ("dp", "pp", "cp", "x", "y", "z", "order")}
    values.update({"grid.auto": "false", "batch.micro_batch": cfg.batch.micro_batch, "train.recompute": cfg.train.recompute,
                   "train.seq_parallel": cfg.train.seq_parallel})
    out = list(argv)
    for key, value in values.items():
        out += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _export(args: argparse.Namespace) -> int:
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


def _simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from fourfold.spec.job import Job
    from fourfold.models.config import load_config
    from fourfold.tools.simulate import report, simulate

    cfg = load_config(args.model)
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    job = Job(Layout.parse(args.grid, args.order), global_batch=args.global_batch, micro_batch=args.micro_batch,
              seq=args.seq, recompute=args.recompute, seq_parallel=args.seq_parallel, precision=args.precision,
              virtual=args.virtual, schedule="interleaved-1f1b" if args.virtual > 1 else "1f1b",
              keep_gathered_inputs=args.keep_gathered_inputs,
              stage_layers=tuple(int(n) for n in args.stage_layers.split(",") if n.strip()))
    try:
        sim = simulate(cfg, job, rank=args.rank, steps=args.steps)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(json.dumps(sim.as_json(), indent=1) if args.json else report(sim))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from fourfold.train.generate import generate

    try:
        print(generate(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.seed))
    except ValueError as err:  # CheckpointError, JobError, a temperature or prompt it cannot take
        raise ConfigError(str(err)) from None
    return 0


def _before_launch(cfg) -> list[str]:
    """The checks that read files (the data's, the checkpoint the run starts from), then the data
    prepared here, before any rank starts: tokenized (and, for data.packing = documents, packed).
    Returns the overrides that hand the ranks the files. No rank then reads the corpus, and rank
    0 does not prepare it while every other rank waits at the start-up barrier (whose timeout a
    large corpus would pass)."""
    from fourfold.spec.trainconfig import check_data_files
    from fourfold.train.trainer import check_checkpoint

    check_data_files(cfg)
    changed = check_checkpoint(cfg)
    if changed:
        print(f"the model's settings differ from its checkpoint's ({'; '.join(changed)}): training goes on with "
              f"this config's", file=sys.stderr)  # (slurm prints its script on stdout)
    return _prepared_data(cfg)[0]


def _prepared_data(cfg) -> tuple[list[str], Path | None]:
    """The corpus tokenized (and, for data.packing = documents, packed) into the cache, where the
    job's rank 0 finds it: the overrides that hand the ranks its files, and the windows file."""
    from fourfold.train.trainer import packed_windows, tokens_files

    tokenizer, tokens = tokens_files(cfg)
    windows = packed_windows(cfg, tokenizer, tokens)
    return ["--data.tokenizer", str(Path(tokenizer).resolve()), "--data.tokens", str(Path(tokens).resolve())], windows


def _prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    """Tokenize (and pack) a config's corpus here, as its own job (a large corpus takes hours on
    many cores: `data.workers`), so that `train` and `slurm` find it in data.cache_dir."""
    from fourfold.spec.trainconfig import check_data_files, load_train_config, validate_data

    cfg = load_train_config(args.config, overrides)
    validate_data(cfg)
    check_data_files(cfg)
    files, windows = _prepared_data(cfg)
    print(f"prepared in {cfg.data.cache_dir}, where `fourfold train` and `fourfold slurm` with this config find it"
          f"{f' (packed windows: {windows})' if windows else ''}; or give them {shlex.join(files)}")
    return 0


def _slurm(args: argparse.Namespace, overrides: list[str]) -> int:
    from fourfold.train.slurm import sbatch_script
    from fourfold.spec.trainconfig import load_train_config, resolve_auto_grid, validate

    cfg = load_train_config(args.config, overrides)  # fail now, not in the queue
    world = args.nodes * args.gpus_per_node
    if cfg.grid.auto:
        chosen = resolve_auto_grid(cfg, world)
        print(f"grid.auto: the planner's choice for {cfg.hardware.gpu}: {chosen}", file=sys.stderr)
        overrides = _resolved(overrides, cfg)
    else:
        _check_slurm_world(cfg.layout(), args.nodes, args.gpus_per_node)
    validate(cfg, world, gpu=True)  # an sbatch script runs on GPU nodes
    overrides = overrides + _before_launch(cfg)
    # The run directory absolute, so that the job writes to the same place wherever sbatch is called;
    # it must exist before the job starts, since SLURM opens the job's output files in it.
    run_dir = Path(cfg.log.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config = str(Path(args.config).resolve()) if args.config else ""
    text = sbatch_script(config, _with_run_dir(overrides, run_dir), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         cpus_per_task=args.cpus_per_task or 8 * args.gpus_per_node, run_dir=str(run_dir),
                         workdir=str(Path.cwd()), job_name=args.job_name, time=args.time, partition=args.partition,
                         account=args.account, max_restarts=args.max_restarts)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output} (the job's output goes to {run_dir}); submit it with: sbatch "
              f"{shlex.quote(args.output)}")
    else:
        print(text, end="")
    return 0


def _with_run_dir(overrides: list[str], run_dir: Path) -> list[str]:
    """The (flag, value) pairs of `overrides` with log.run_dir set to `run_dir` (a user's own dropped)."""
    kept = [pair for pair in zip(overrides[::2], overrides[1::2]) if pair[0][2:].replace("-", "_") != "log.run_dir"]
    return [*(v for pair in kept for v in pair), "--log.run_dir", str(run_dir)]


def _check_slurm_world(layout: Layout, nodes: int, gpus_per_node: int) -> None:
    """The grid against the GPUs the job asks for, the fix given in this command's options."""
    world = nodes * gpus_per_node
    if layout.world_size == world:
        return
    others = layout.world_size // layout.dp
    grid_fix = f" (e.g. --grid.dp {world // others})" if world % others == 0 else ""
    nodes_fix = (f" (--nodes {layout.world_size // gpus_per_node})" if layout.world_size % gpus_per_node == 0
                 else "")
    raise ConfigError(f"the grid {layout} has {layout.world_size} ranks, but --nodes {nodes} x --gpus-per-node "
                      f"{gpus_per_node} give {world} GPUs; change the grid so that dp*pp*cp*x*y*z = {world}{grid_fix}, "
                      f"or --nodes/--gpus-per-node so that they give {layout.world_size} GPUs{nodes_fix}")


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fourfold", description="4D hybrid parallel training and planning")
    commands = parser.add_subparsers(dest="command", required=True)
    # train, slurm and demo take the config's --section.key value overrides: their --help lists them
    with_overrides = dict(epilog=sections_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    commands.add_parser("demo", help="the main job on an embedded default: train a small Llama on 8 CPU ranks "
                                     "(takes the same --section.key value overrides as train), sample, plan",
                        usage="fourfold demo [--section.key value ...]", **with_overrides)
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
    ev.add_argument("--field", default="text", help="with --text: the JSONL field or Parquet column of each document")
    ev.add_argument("--cache-dir", default="~/.cache/fourfold", help="with --text: where its token file is kept")
    ev.add_argument("--seq", type=int, required=True, help="sequence length of each window")
    ev.add_argument("--batch", type=int, default=1, help="windows per data shard per step")
    ev.add_argument("--max-tokens", type=int, default=0,
                    help="score only the first windows, up to this many tokens (default 0: the whole file)")
    ev.add_argument("--precision", choices=PRECISIONS, default="float32",
                    help="parameters and activations (auto: bf16 on GPUs, float32 on CPU)")
    ev.add_argument("--json", action="store_true", help='print {"loss", "perplexity", "tokens"} as JSON')
    _add_grid_options(ev, "dp=1")
    tr = commands.add_parser("train", help="train from a TOML config (plus --section.key value overrides)",
                             usage="fourfold train [CONFIG.toml] [--section.key value ...] [--nproc-per-node N] "
                                   "[--max-restarts N]", **with_overrides)
    tr.add_argument("config", nargs="?", help="a TOML file (see examples/); the defaults when left out")
    tr.add_argument("--nproc-per-node", type=int, default=None, help="local ranks (default: the grid's size)")
    tr.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank fails (resumes)")
    gen = commands.add_parser("generate", help="sample text from a training checkpoint or a Hugging Face directory")
    gen.add_argument("checkpoint", help="a step-N checkpoint directory, a run's checkpoint directory (latest), or a "
                                        "Hugging Face directory (config.json, safetensors, tokenizer.json)")
    gen.add_argument("--prompt", default="In the beginning")
    gen.add_argument("--max-new-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=0)
    ex = commands.add_parser("export", help="write a training checkpoint as a Hugging Face model directory")
    ex.add_argument("checkpoint", help="a step-N checkpoint directory, or a run's checkpoint directory (latest)")
    ex.add_argument("output", help="the directory to write config.json, model.safetensors and tokenizer.json to")
    pr = commands.add_parser("prepare", help="tokenize (and pack) a config's corpus now, into the cache train and "
                                             "slurm read (for a large corpus: run it as a CPU job of its own)",
                             usage="fourfold prepare [CONFIG.toml] [--section.key value ...]", **with_overrides)
    pr.add_argument("config", nargs="?", help="a TOML file (see examples/); the defaults when left out")
    sl = commands.add_parser("slurm", help="write an sbatch script that runs `fourfold train` on N nodes",
                             usage="fourfold slurm [CONFIG.toml] --nodes N [options] [--section.key value ...]",
                             **with_overrides)
    sl.add_argument("config", nargs="?", help="a TOML file (see examples/); the defaults when left out")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, default=8)
    sl.add_argument("--cpus-per-task", type=int, default=None,
                    help="CPUs of each node's task, shared by its ranks (default: 8 per GPU)")
    sl.add_argument("--job-name", default="fourfold")
    sl.add_argument("--time", default="24:00:00")
    sl.add_argument("--partition", default="")
    sl.add_argument("--account", default="")
    sl.add_argument("--max-restarts", type=int, default=3)
    sl.add_argument("--output", default="", help="write the script here (default: print it)")
    sim = commands.add_parser("simulate", help="run one rank of a whole job on this machine (fake process group, "
                                               "FakeTensorMode): start-up, per-step Python time, memory, collectives")
    sim.add_argument("--model", required=True, help="a preset name or a Hugging Face config.json (or its directory)")
    sim.add_argument("--grid", required=True, help="the whole job's grid, e.g. dp=128,pp=16,x=2,y=4 (dims left out are 1)")
    sim.add_argument("--order", default=",".join(DEFAULT_ORDER), help="placement order, innermost first")
    sim.add_argument("--rank", type=int, default=0, help="the rank to simulate (default 0: the first stage)")
    sim.add_argument("--steps", type=int, default=2, help="timed training steps after the two counted ones")
    sim.add_argument("--layers", type=int, help="build this many layers instead of the model's (start-up and "
                                                "per-layer figures)")
    sim.add_argument("--seq", type=int, default=4096)
    sim.add_argument("--global-batch", type=int, default=1024, help="sequences per optimizer step")
    sim.add_argument("--micro-batch", type=int, default=1)
    sim.add_argument("--recompute", choices=RECOMPUTE, default="none")
    sim.add_argument("--seq-parallel", action=argparse.BooleanOptionalAction, default=True)
    sim.add_argument("--keep-gathered-inputs", action="store_true")
    sim.add_argument("--precision", choices=PRECISIONS, default="bf16")
    sim.add_argument("--virtual", type=int, default=1, help="pipeline stages per pp rank (interleaved 1F1B)")
    sim.add_argument("--stage-layers", default="", help="layers per pipeline stage, e.g. 7,8,8,...,7 (default even)")
    sim.add_argument("--json", action="store_true")
    from fourfold.cli.plan import add_commands, run as run_planner

    add_commands(commands)
    try:
        known, extra = _split_overrides(argv)
    except ValueError as err:
        parser.error(str(err))
    args = parser.parse_args(known)
    if extra and args.command not in ("train", "slurm", "demo", "prepare"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("memory", "estimate", "plan", "calibrate"):
        return run_planner(args)
    try:
        if args.command == "train":
            return _train(args, argv, extra)
        if args.command == "slurm":
            return _slurm(args, extra)
        if args.command == "prepare":
            return _prepare(args, extra)
        if args.command == "generate":
            return _generate(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "export":
            return _export(args)
        if args.command == "demo":
            return _demo(args, extra)
        return _eval(args, argv)
    except (GridError, ConfigError, JobError) as err:
        print(f"fourfold: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a training rank notes the signal instead, and stops at a step boundary)
        print("fourfold: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
