"""Evaluate one configuration, or search every configuration of a GPU count, best first."""

from __future__ import annotations

import math

from dataclasses import replace

from fourfold.blockspec import RECOMPUTE, attention_chunks, mlp_chunks
from fourfold.layout import DEFAULT_ORDER, GridError, factorisations
from fourfold.models.config import ModelConfig
from fourfold.plan.hardware import Cluster
from fourfold.plan.memory import Setup, estimate_memory
from fourfold.plan.perf import Calibration, group_bandwidth, step_time

# Placement orders the search tries: each tensor dim innermost, then context, data, pipeline.
ORDERS = [DEFAULT_ORDER, ("y", "x", "z", "cp", "dp", "pp"), ("z", "x", "y", "cp", "dp", "pp"),
          ("x", "y", "cp", "z", "dp", "pp")]
COMM_GROUPS = [("x",), ("y",), ("z",), ("cp",), ("pp",), ("dp", "cp")]  # every group the perf model times


def check(cfg: ModelConfig, s: Setup) -> None:
    """Raise ValueError naming the fix when the model or batch does not divide over the setup."""
    if s.framework == "megatron" and (s.x != 1 or s.z != 1):
        raise ValueError("the megatron profile has 1D tensor parallelism: give --tp (y) and leave x = z = 1")
    if cfg.hidden % s.x or cfg.hidden % s.y:
        raise ValueError(f"hidden={cfg.hidden} must be divisible by x={s.x} and y={s.y}")
    attention_chunks(cfg.block, s.x, s.y)  # raises GridError naming the fix
    mlp_chunks(cfg.block, s.x, s.y)
    if cfg.vocab % s.y:
        raise ValueError(f"vocab={cfg.vocab} must be divisible by y={s.y}")
    if cfg.layers % (s.pp * s.vpp):
        raise ValueError(f"layers={cfg.layers} must be divisible by pp*vpp={s.pp * s.vpp}")
    if s.micro_batch % s.z:
        raise ValueError(f"micro-batch {s.micro_batch} must be divisible by z={s.z} (z splits whole sequences)")
    if s.global_batch % (s.dp * s.micro_batch):
        raise ValueError(f"global batch {s.global_batch} must be divisible by dp*micro_batch={s.dp * s.micro_batch}")
    if s.cp > 1 and s.seq % (2 * s.cp):
        raise ValueError(f"sequence {s.seq} must be divisible by 2*cp={2 * s.cp} (causal load balancing)")
    if s.pp > 1 and s.micro_batches < s.pp:
        raise ValueError(f"{s.micro_batches} micro-batches are fewer than pp={s.pp} stages; raise the global batch")


def evaluate(cfg: ModelConfig, s: Setup, cluster: Cluster, cal: Calibration = Calibration(), rule80: bool = True) -> dict:
    """Memory and speed of one configuration, as the JSON object the CLI prints."""
    check(cfg, s)
    mem = estimate_memory(cfg, s, cluster.gpu.memory_gib, rule80)
    t = step_time(cfg, s, cluster, cal)
    tokens = s.global_batch * s.seq
    tflops = t.flops_per_gpu / t.total / 1e12
    return {
        "framework": s.framework, "dp": s.dp, "pp": s.pp, "cp": s.cp, "x": s.x, "y": s.y, "z": s.z, "tp": s.tp,
        "vpp": s.vpp, "order": ",".join(s.order), "micro_batch": s.micro_batch, "recompute": s.recompute,
        "memory_gib": mem.gib, "memory_limit_gib": mem.limit_bytes / 2**30, "fits": mem.fits,
        "step_seconds": t.total, "tokens_per_second": tokens / t.total, "model_tflops_per_gpu": tflops,
        "mfu": tflops / cluster.gpu.bf16_tflops,
        "memory_breakdown_gib": mem.breakdown_gib(), "time_breakdown_seconds": t.breakdown(),
    }


def rounded_seconds(seconds: float) -> float:
    """A step time to four significant digits: closer candidates count as equally fast."""
    return round(seconds, 3 - math.floor(math.log10(seconds))) if seconds > 0 else seconds


def search(cfg: ModelConfig, gpus: int, cluster: Cluster, base: Setup, *, micro_batches=(1, 2, 4, 8),
           recomputes=RECOMPUTE, cal: Calibration = Calibration(), rule80: bool = True, include_unfit: bool = False) -> list[dict]:
    """Every valid (dp, pp, cp, x, y, z), micro-batch, order and recompute option on `gpus`, best first."""
    results = []
    orders = ORDERS if base.framework == "fourfold" else [DEFAULT_ORDER]
    for dp, pp, cp, x, y, z in factorisations(gpus):
        if base.framework == "megatron" and (x != 1 or z != 1):
            continue
        for mb in micro_batches:
            setup = replace(base, dp=dp, pp=pp, cp=cp, x=x, y=y, z=z, micro_batch=mb)
            try:
                check(cfg, setup)
            except (ValueError, GridError):
                continue
            for recompute in recomputes:
                setup = replace(setup, recompute=recompute)
                fits = estimate_memory(cfg, setup, cluster.gpu.memory_gib, rule80).fits  # the order never changes memory
                if not (fits or include_unfit):
                    continue
                # The order changes time only through the bandwidth each group gets: evaluate one
                # order per distinct set of bandwidths, keep the fastest.
                placements = {}
                for o in orders:
                    placed = replace(setup, order=o)
                    placements.setdefault(tuple(group_bandwidth(placed, cluster, g) for g in COMM_GROUPS), placed)
                best = min((evaluate(cfg, placed, cluster, cal, rule80) for placed in placements.values()),
                           key=lambda r: r["step_seconds"])
                results.append(best)
                if fits:
                    break  # a lighter recompute fits: heavier ones are only slower
    # Among equally fast candidates (step times equal to 0.1%), the simpler one first: less
    # context parallelism, then the smaller model-parallel group, then less memory.
    results.sort(key=lambda r: (not r["fits"], rounded_seconds(r["step_seconds"]), r["cp"],
                                r["pp"] * r["tp"], r["memory_gib"]))
    return results


