"""`fourfold train`, `prepare` and `slurm`: a TOML config with `--section.key value` overrides,
checked and its data prepared before any rank starts."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from fourfold.cli.options import launcher_options_removed
from fourfold.config import ConfigError, TrainConfig, as_overrides, job_settings, sections_help
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.train.launch import StopRequest, inside_torchrun, peer_lost, relaunch_with_torchrun

# train, slurm, prepare and demo take the config's overrides: their --help lists them
WITH_OVERRIDES = dict(epilog=sections_help(), formatter_class=argparse.RawDescriptionHelpFormatter)


def add_parsers(commands) -> None:
    tr = commands.add_parser("train", help="train from a TOML config (plus --section.key value overrides)",
                             usage="fourfold train [CONFIG.toml] [--section.key value ...] [--nproc-per-node N] "
                                   "[--max-restarts N]", **WITH_OVERRIDES)
    tr.add_argument("config", nargs="?", help="a TOML file (see examples/); the defaults when left out")
    tr.add_argument("--nproc-per-node", type=int, default=None, help="local ranks (default: the grid's size)")
    tr.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank fails (resumes)")
    pr = commands.add_parser("prepare", help="tokenize (and pack) a config's corpus now, into the cache train and "
                                             "slurm read (for a large corpus: run it as a CPU job of its own)",
                             usage="fourfold prepare [CONFIG.toml] [--section.key value ...]", **WITH_OVERRIDES)
    pr.add_argument("config", nargs="?", help="a TOML file (see examples/); the defaults when left out")
    sl = commands.add_parser("slurm", help="write an sbatch script that runs `fourfold train` on N nodes",
                             usage="fourfold slurm [CONFIG.toml] --nodes N [options] [--section.key value ...]",
                             **WITH_OVERRIDES)
    sl.add_argument("config", nargs="?", help="a TOML file (see examples/); the defaults when left out")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, default=8, help="(default 8)")
    sl.add_argument("--cpus-per-task", type=int, default=None,
                    help="CPUs of each node's task, shared by its ranks (default: 8 per GPU)")
    sl.add_argument("--job-name", default="fourfold", help="(default fourfold)")
    sl.add_argument("--time", default="24:00:00", help="the job's time limit (default 24:00:00)")
    sl.add_argument("--partition", default="")
    sl.add_argument("--account", default="")
    sl.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a rank fails (default 3)")
    sl.add_argument("--output", default="", help="write the script here (default: print it)")


def train(args: argparse.Namespace, argv: list[str], overrides: list[str]) -> int:
    from fourfold.config import load_train_config, validate

    cfg = load_train_config(args.config, overrides)
    if not inside_torchrun():  # check everything and prepare the data before any process starts
        from fourfold.parallel.grid import choose_device

        world = args.nproc_per_node or cfg.layout().world_size
        if cfg.grid.auto:
            refuse_dims_with_auto(overrides)
            chosen = resolve_auto_grid(cfg, world)
            print(f"grid.auto: the planner's choice on {world} x {cfg.cluster().gpu.name}: {chosen}")
            if choose_device(cfg.train.device, world) == "cpu":
                print(f"grid.auto: (this run is on CPU; the planner planned {cfg.cluster().gpu.name} GPUs, the "
                      f"[hardware] preset's, and its memory and speed figures are theirs)")
            argv = _resolved(argv, cfg)

        gpu = choose_device(cfg.train.device, world) == "cuda"
        if cfg.grid.elastic:  # checked on the grid the ranks will take (they choose it again, alike, and say it)
            from fourfold.train.elastic import regrid

            cfg, _ = regrid(cfg, world, world, gpu=gpu)
        validate(cfg, world, gpu=gpu)  # too few GPUs: refused here
        argv = argv + _before_launch(cfg)
        return relaunch_with_torchrun(world, launcher_options_removed(argv), max_restarts=args.max_restarts)
    stop = StopRequest()  # before torch is imported: a signal from now on stops the run at a step boundary
    import torch.distributed as dist

    from fourfold.parallel.grid import init_process_group
    from fourfold.train.trainer import TrainingError
    from fourfold.train.trainer import train as run_training

    tensor_dims = cfg.grid.x * cfg.grid.y * cfg.grid.z > 1
    init_process_group(device=cfg.train.device, tensor_overlap=cfg.train.overlap and tensor_dims)
    try:
        summary = run_training(cfg, stop)
    except TrainingError as err:  # every rank stops at the same step: rank 0 says why, once
        if int(os.environ["RANK"]) == 0:
            _say(f"fourfold: error: {err}")
        dist.barrier()  # said before any rank exits (torchrun then stops the others)
        return 1
    except RuntimeError as err:
        if not peer_lost(err):
            raise
        _say(f"fourfold: rank {os.environ['RANK']} stopped: another rank is gone (torchrun's line names it)")
        return 1
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0 and not summary["stopped"]:  # a stopped run has said so in one line
        from fourfold.train.report import closing_line

        print(closing_line(summary, cfg.log.run_dir, cfg.checkpoint.every))
    return 0


def _say(line: str) -> None:
    """A rank's line on stderr in one write: ranks failing together would otherwise interleave a
    line and its newline (stderr writes through), running two ranks' lines into one."""
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def refuse_dims_with_auto(overrides: list[str]) -> None:
    """grid.auto chooses every grid dim: one given on the command line beside it would be dropped
    in silence (a config file's dims only give the world size when --nproc-per-node does not)."""
    grid_flags = {f"--grid.{d}" for d in (*Layout().sizes, "order")}
    given = [f"{flag} {value}" for flag, value in zip(overrides[::2], overrides[1::2]) if flag in grid_flags]
    if given:
        raise ConfigError(f"--grid.auto true chooses the grid, so {', '.join(given)} would be dropped: leave "
                          f"{'them' if len(given) > 1 else 'it'} out (give the ranks with --nproc-per-node N), or "
                          f"set --grid.auto false")


def resolve_auto_grid(cfg: TrainConfig, world: int) -> Job:
    """With grid.auto: take the planner's best job for `hardware` on `world` GPUs that this run can
    use (the search returns only jobs the rule function accepts); returns it."""
    from fourfold.train.elastic import planner_job

    job = planner_job(cfg, world)
    if job is None:
        raise ConfigError(f"the planner found no configuration of {world} ranks that fits and that this run can use; "
                          f"set the grid by hand")
    cfg.use_job(job)
    return job


def _resolved(argv: list[str], cfg: TrainConfig) -> list[str]:
    """`argv` with the job the planner chose (every setting `job_settings` names), for the ranks."""
    return list(argv) + as_overrides(job_settings(cfg.job()))


def _before_launch(cfg) -> list[str]:
    """The checks that read files (the data's, the checkpoint the run starts from), then the data
    prepared here, before any rank starts: tokenized (and, for data.packing = documents, packed).
    Returns the overrides that hand the ranks the files. No rank then reads the corpus, and rank
    0 does not prepare it while every other rank waits at the start-up barrier (whose timeout a
    large corpus would pass)."""
    from fourfold.data import corpus
    from fourfold.data.checks import check_data_files
    from fourfold.train.resume import check_checkpoint

    check_writable(cfg)
    check_data_files(cfg)
    changed = check_checkpoint(cfg)  # (and model.hf's weights, when the run starts from them)
    if changed:
        print(f"the model's settings differ from its checkpoint's ({'; '.join(changed)}): training goes on with "
              f"this config's", file=sys.stderr)  # (slurm prints its script on stdout)
    if not (cfg.data.text or cfg.data.files or cfg.data.tokens):  # (the ranks are handed its token file)
        print(f"data: {cfg.data_source()}", file=sys.stderr)  # (slurm prints its script on stdout)
    files, tokens, windows = _prepared_data(cfg)
    try:  # a corpus of fewer windows than one global batch: known now, not on rank 0 after the launch
        corpus.TokenLoader(tokens, cfg.batch.seq, cfg.batch.global_batch, packing=cfg.data.packing, windows=windows)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    return files


def check_writable(cfg: TrainConfig) -> None:
    """log.run_dir and the checkpoint directory (with checkpoint.every > 0), created now and a file
    written in each, so that a directory the run cannot write is refused before any rank starts,
    not at the first save after the steps before it were trained."""
    import tempfile

    places = [("log.run_dir", Path(cfg.log.run_dir))]
    if cfg.checkpoint.every > 0:
        places.append(("checkpoint.dir" if cfg.checkpoint.dir else "the checkpoint directory", cfg.checkpoint_dir))
    for key, folder in places:
        folder = folder.expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
                pass
        except OSError as e:
            raise ConfigError(f"{key} {folder} cannot be written ({e.strerror or e}): give a directory this user can "
                              f"create and write to") from None
    if cfg.checkpoint.every > 0:  # room for one checkpoint: said now, not found at the first save
        from fourfold.spec.job import ELEMENT_BYTES

        element = ELEMENT_BYTES[cfg.train.precision] if cfg.train.precision != "auto" else 4  # (CPU's float32)
        size = cfg.model_config().parameter_count() * (element + 3 * max(4, element))  # weights, master, m, v
        free = shutil.disk_usage(cfg.checkpoint_dir.expanduser()).free
        if free < size:
            print(f"warning: {cfg.checkpoint_dir} has {free / 2**30:.2f} GiB free, and one checkpoint of this model "
                  f"takes about {size / 2**30:.2f} GiB: its saves will fail (checkpoint.on_failure decides whether "
                  f"training goes on)", file=sys.stderr)


def _prepared_data(cfg) -> tuple[list[str], Path, Path | None]:
    """The corpus tokenized (and, for data.packing = documents, packed) into the cache, where the
    job's rank 0 finds it: the overrides that hand the ranks its files, the token file, and the
    windows file."""
    from fourfold.data.prepare import packed_windows, tokens_files

    tokenizer, tokens = tokens_files(cfg.data, cfg.tokenizer)
    windows = packed_windows(cfg.data, cfg.batch.seq, tokenizer, tokens)
    files = ["--data.tokenizer", str(Path(tokenizer).resolve()), "--data.tokens", str(Path(tokens).resolve())]
    return files, tokens, windows


def prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    """Tokenize (and pack) a config's corpus here, as its own job (a large corpus takes hours on
    many cores: `data.workers`), so that `train` and `slurm` find it in data.cache_dir."""
    from fourfold.config import load_train_config, validate_data
    from fourfold.data.checks import check_data_files

    cfg = load_train_config(args.config, overrides)
    validate_data(cfg)
    check_data_files(cfg)
    files, _, windows = _prepared_data(cfg)
    print(f"prepared in {cfg.data.cache_dir}, where `fourfold train` and `fourfold slurm` with this config find it"
          f"{f' (packed windows: {windows})' if windows else ''}; or give them {shlex.join(files)}")
    return 0


def slurm(args: argparse.Namespace, overrides: list[str]) -> int:
    from fourfold.config import load_train_config, validate
    from fourfold.train.elastic import counts_without_grid, min_nodes
    from fourfold.train.slurm import sbatch_script

    cfg = load_train_config(args.config, overrides)  # fail now, not in the queue
    world = args.nodes * args.gpus_per_node
    if cfg.grid.auto:
        refuse_dims_with_auto(overrides)
        chosen = resolve_auto_grid(cfg, world)
        print(f"grid.auto: the planner's choice on {world} x {cfg.cluster().gpu.name}: {chosen}", file=sys.stderr)
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
    fewest = min_nodes(cfg, args.nodes, args.gpus_per_node)
    missing = counts_without_grid(cfg, fewest, args.nodes, args.gpus_per_node)
    if missing:
        print(f"grid.elastic: a restart on {', '.join(map(str, missing))} node(s) would be refused: no grid of "
              f"grid.fallbacks runs on as many (add one to each)", file=sys.stderr)
    text = sbatch_script(config, _with_run_dir(overrides, run_dir), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         cpus_per_task=args.cpus_per_task or 8 * args.gpus_per_node, run_dir=str(run_dir),
                         workdir=str(Path.cwd()), job_name=args.job_name, time=args.time, partition=args.partition,
                         account=args.account, max_restarts=args.max_restarts, min_nodes=fewest)
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
