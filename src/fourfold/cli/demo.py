"""`fourfold demo` (`make demo`): the main job on an embedded default. A small Llama trains on the
bundled corpus on 8 CPU ranks (the config in fourfold/configs/demo.toml: dp2 x2 y2 with sequence
parallelism), writes checkpoints, samples text from the last one, and then the planner recommends
a configuration for a large model on a large cluster."""

from __future__ import annotations

import argparse
import time
from importlib.resources import files

from fourfold.models.config import load_config

DEMO_CONFIG = str(files("fourfold.configs") / "demo.toml")


def add_parser(commands) -> None:
    from fourfold.cli.train import WITH_OVERRIDES

    commands.add_parser("demo", help="the main job on an embedded default: train a small Llama on 8 CPU ranks "
                                     "(takes the same --section.key value overrides as train), sample, plan",
                        usage="fourfold demo [--section.key value ...]", **WITH_OVERRIDES)


def run(overrides: list[str]) -> int:
    from fourfold.cli.train import train
    from fourfold.config import load_train_config

    # Every demo run trains from scratch in its own directory (a user's --log.run_dir still wins).
    overrides = ["--log.run_dir", time.strftime("runs/demo-%Y%m%d-%H%M%S"), *overrides]
    cfg = load_train_config(DEMO_CONFIG, overrides)
    print(f"fourfold demo: training {cfg.model.preset} on the bundled King James Bible, config {DEMO_CONFIG}")
    launch = argparse.Namespace(config=DEMO_CONFIG, nproc_per_node=None, max_restarts=0)
    code = train(launch, ["train", DEMO_CONFIG, *overrides], overrides)
    if code:
        return code
    show_samples(str(cfg.checkpoint_dir))
    print_plan()
    return 0


def show_samples(checkpoints: str) -> None:
    from fourfold.train.generate import generate

    print(f"\nsamples from {checkpoints} (greedy, then temperature 0.8):")
    print("  " + generate(checkpoints, "And God said", max_new_tokens=40).replace("\n", " "))
    print("  " + generate(checkpoints, "In the beginning", max_new_tokens=40, temperature=0.8).replace("\n", " "))


def print_plan(model: str = "llama-3.1-70b", gpus: int = 512, cluster: str = "dgx-h100") -> None:
    """What the planner recommends for a large model on a large cluster (same as `fourfold plan`)."""
    from fourfold.cli.plan import HEADER, error_note, row
    from fourfold.plan.constants import Calibration
    from fourfold.plan.search import search
    from fourfold.spec.hardware import make_cluster
    from fourfold.spec.job import Job

    base = Job(seq=4096, global_batch=1024, seq_parallel=True, precision="bf16")
    found = search(load_config(model), gpus, make_cluster(cluster), base, top=3)
    print(f"\nthe planner's best configurations for {model} on {gpus} GPUs of {cluster} "
          f"(seq 4096, 1024 sequences/step):")
    print(HEADER)
    for r in found[:3]:
        print(row(r, r["tie"]))
    print(error_note(Calibration()))
