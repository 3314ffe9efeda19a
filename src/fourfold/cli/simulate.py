"""`fourfold simulate`: one rank of a whole job on this machine (fake process group, FakeTensorMode)."""

from __future__ import annotations

import argparse
import json

from fourfold.cli.options import layer_counts
from fourfold.config import ConfigError
from fourfold.spec.job import PRECISIONS, RECOMPUTE
from fourfold.spec.layout import DEFAULT_ORDER, Layout


def add_parser(commands) -> None:
    sim = commands.add_parser("simulate", help="run one rank of a whole job on this machine (fake process group, "
                                               "FakeTensorMode): start-up, per-step Python time, memory, collectives",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_argument("--model", required=True, help="a preset name or a Hugging Face config.json (or its directory)")
    sim.add_argument("--grid", required=True,
                     help="the whole job's grid, e.g. dp=128,pp=16,x=2,y=4 (dims left out are 1)")
    sim.add_argument("--order", default=",".join(DEFAULT_ORDER), help="placement order, innermost first")
    sim.add_argument("--rank", type=int, default=0, help="the rank to simulate (0: the first stage)")
    sim.add_argument("--steps", type=int, default=2, help="timed training steps after the two counted ones")
    sim.add_argument("--layers", type=int, help="build this many layers instead of the model's (start-up and "
                                                "per-layer figures)")
    sim.add_argument("--seq", type=int, default=4096, help="sequence length")
    sim.add_argument("--global-batch", type=int, default=1024, help="sequences per optimizer step")
    sim.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    sim.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation")
    sim.add_argument("--seq-parallel", action=argparse.BooleanOptionalAction, default=True,
                     help="sequence parallelism")
    sim.add_argument("--keep-gathered-inputs", action="store_true", help="linears keep their gathered inputs")
    sim.add_argument("--precision", choices=PRECISIONS, default="bf16", help="parameters and activations")
    sim.add_argument("--virtual", type=int, default=1, help="pipeline stages per pp rank (interleaved 1F1B)")
    sim.add_argument("--stage-layers", type=layer_counts, default=(),
                     help="layers per pipeline stage, e.g. 7,8,8,...,7 (default even)")
    sim.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:

    from fourfold.models.config import load_config
    from fourfold.spec.job import Job
    from fourfold.tools.simulate import report, simulate

    cfg = load_config(args.model)
    if args.layers:
        cfg = cfg.with_layers(args.layers)
    job = Job(Layout.parse(args.grid, args.order), global_batch=args.global_batch, micro_batch=args.micro_batch,
              seq=args.seq, recompute=args.recompute, seq_parallel=args.seq_parallel, precision=args.precision,
              virtual=args.virtual, schedule="interleaved-1f1b" if args.virtual > 1 else "1f1b",
              keep_gathered_inputs=args.keep_gathered_inputs,
              stage_layers=args.stage_layers)
    try:
        sim = simulate(cfg, job, rank=args.rank, steps=args.steps)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(json.dumps(sim.as_json(), indent=1) if args.json else report(sim))
    return 0
