"""GPU acceptance of fourfold: one command, one JSON object on stdout, progress on stderr.

Run from the repository root on a machine with one GPU (a few minutes on an H100 or H200):

    python benchmarks/gpu_acceptance.py > acceptance.json

Options: --gpu PRESET (a preset of fourfold.spec.hardware.GPUS, when the device's name matches
none), --peak-tflops (any other bf16 peak), --micro-batch (else the largest of 8, 4, 2, 1
sequences whose planner estimate takes at most half the GPU), --warmup, --steps.

What the JSON holds:
  kernels   ring attention's per-block CUDA kernels (fourfold.parallel.context.attend_block and
            attend_block_backward) in bf16 on each kind of ring block, against float32
            references, each {name, max_error, bound, ok}: the checks of tests/gpu/test_kernels.py
            (tests/gpu/kernel_checks.py, where the bounds are explained)
  training  one bf16 training step of a 0.9B Llama on one GPU: fourfold (a one-rank grid on NCCL;
            the trainer's Model, GradientSync and AdamW) against transformers' LlamaForCausalLM
            (SDPA attention) with torch's fused AdamW, on the same batch: tokens/s and MFU
  memory    fourfold's peak memory in that step against the planner's estimate
            (fourfold.plan.memory.estimate_memory), its GPU-only terms (the CUDA context, NCCL,
            fragmentation) beside what they stand for
  model     the model both frameworks build: parameter counts, from meta-device builds
  skipped   what did not run and why; "ok": every check that ran passed (the exit status too)

Without CUDA it is a dry run (about ten seconds, light on CPU): the configuration, the FLOPs and
the memory estimate of the GPU run (for --gpu, default the trainer's preset), both models built on
the meta device, and a `smoke` section: one step of each framework's benchmark code on a tiny
model on CPU, which checks the code runs and measures nothing.

The multi-GPU checks, every collective of fourfold.parallel.comm on NCCL (the in-place ZeRO-1
reduce-scatter among them) and ring attention across GPUs, are pytest tests run under torchrun
on N >= 2 GPUs (each rank also runs the kernel tests on its own GPU):

    torchrun --nproc-per-node N -m pytest tests/gpu -m gpu
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The kernel checks live with the tests that share them (tests/gpu/kernel_checks.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gpu.kernel_checks import BLOCKS, SHAPES, check_block  # noqa: E402

from fourfold.parallel.data import GradientSync  # noqa: E402
from fourfold.parallel.grid import Grid  # noqa: E402
from fourfold.spec.job import Job  # noqa: E402
from fourfold.spec.layout import Layout  # noqa: E402
from fourfold.tools.measure import GPU_ONLY_TERMS  # noqa: E402
from fourfold.models.config import ModelConfig  # noqa: E402
from fourfold.parallel.transformer import Transformer  # noqa: E402
from fourfold.parallel.optimizer import AdamW  # noqa: E402
from fourfold.spec.hardware import GPUS  # noqa: E402
from fourfold.plan.memory import GIB, estimate_memory  # noqa: E402
from fourfold.plan.perf import model_flops_per_token  # noqa: E402
from fourfold.spec.rules import check  # noqa: E402
from fourfold.parallel.tensor.block import TensorOptions, torch_dtype  # noqa: E402
from fourfold.spec.trainconfig import TrainConfig  # noqa: E402
from fourfold.train.trainer import Model, learning_rate, local_batch  # noqa: E402

# A 0.9B Llama (hidden 2048, 16 layers, 16 heads of 128 over 8 kv heads) at sequence 2048; the dry
# run's smoke model.
MODEL = ModelConfig("llama", hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32000,
                    max_positions=2048, tied=False, eps=1e-5)
SEQ = 2048
TINY = ModelConfig("llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=256, max_positions=64,
                   tied=False, eps=1e-5)
TINY_SEQ = 64
MICRO_BATCHES = (8, 4, 2, 1)  # tried largest first
DEFAULTS = TrainConfig()  # the trainer's defaults: optimizer, overlap, initialisation
# The trainer's first (warm-up) learning rate, held: a step's cost does not depend on it.
LR = learning_rate(DEFAULTS, 0)
START = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


def gib(n: float) -> float:
    return round(n / GIB, 3)


# ----- the device and its peak ---------------------------------------------------------------

def gpu_preset(device_name: str, memory_gib: float) -> str | None:
    """The preset of this GPU: its family named as a word in the device name ('h200' is not in
    'GH200'), the nearest capacity within the family. None for no match, and for PCIe and NVL
    parts, whose clocks (and so peaks) are not the presets' SXM ones."""
    name = device_name.lower()
    if "pcie" in name or "nvl" in name:
        return None
    family = [g for g in GPUS if re.search(rf"\b{re.escape(g.split('-')[0])}\b", name)]
    return min(family, key=lambda g: abs(GPUS[g].memory_gib - memory_gib), default=None)


def device_facts(args) -> dict:
    """The device, the bf16 peak MFU is taken against, and where that peak comes from."""
    if not torch.cuda.is_available():
        preset = args.gpu or DEFAULTS.hardware.gpu
        return {"cuda": False, "planned_for": preset, "memory_gib": GPUS[preset].memory_gib,
                "peak_tflops": GPUS[preset].bf16_tflops, "peak_source": f"preset {preset} (dry run)"}
    props = torch.cuda.get_device_properties(0)
    name, memory = torch.cuda.get_device_name(0), props.total_memory / GIB
    preset = args.gpu or gpu_preset(name, memory)
    if args.peak_tflops:
        peak, source = args.peak_tflops, "--peak-tflops"
    elif preset:
        peak, source = GPUS[preset].bf16_tflops, f"preset {preset}" + ("" if args.gpu else f" (matched {name!r})")
    else:
        peak, source = None, f"no preset matches {name!r}: give --gpu or --peak-tflops for MFU"
    return {"cuda": True, "name": name, "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(memory, 2), "peak_tflops": peak, "peak_source": source,
            "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def start_process_group(device: torch.device) -> None:
    """A world of this one process (no torchrun; the store lives in the process): NCCL on the GPU,
    as the trainer's ranks join it, gloo on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----- the job -------------------------------------------------------------------------------

def job_for(micro_batch: int, seq: int) -> Job:
    """The trainer's default job on one rank, one micro-batch per step, in bf16."""
    return dataclasses.replace(DEFAULTS.job(), global_batch=micro_batch, micro_batch=micro_batch, seq=seq,
                               precision="bf16")


def choose_micro_batch(memory_gib: float) -> int:
    """The largest micro-batch whose fourfold estimate takes at most half the GPU: transformers'
    model keeps more activations per token (its norms save float32 copies), so it needs room."""
    for micro_batch in MICRO_BATCHES:
        if estimate_memory(MODEL, job_for(micro_batch, SEQ), memory_gib).total <= memory_gib * GIB / 2:
            return micro_batch
    raise RuntimeError(f"even one sequence of {SEQ} tokens is estimated above half of {memory_gib:.0f} GiB; "
                       f"give --micro-batch")


def model_section(grid: Grid) -> dict:
    """Both frameworks' models built on the meta device: the same parameter count as the config."""
    import transformers

    with torch.device("meta"):
        ours = Transformer(grid, MODEL, TensorOptions(dtype=torch.bfloat16))
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**MODEL.to_hf()),
                                                               attn_implementation="sdpa", dtype=torch.bfloat16)
    counts = {"config": MODEL.parameter_count(), "fourfold": sum(p.numel() for p in ours.parameters()),
              "transformers": sum(p.numel() for p in theirs.parameters())}
    same = len(set(counts.values())) == 1
    return {"config": dataclasses.asdict(MODEL), "seq": SEQ, "parameters": counts,
            "checks": [{"name": "parameter counts equal (config, fourfold, transformers)", "ok": same}]}


# ----- one training step of each framework ---------------------------------------------------

def fourfold_step(cfg: ModelConfig, job: Job, ids: torch.Tensor, device: torch.device):
    """The trainer's construction (trainer._train) and one step of it: (step function, model)."""
    check(cfg, job, world=1, gpu=device.type == "cuda")
    grid = Grid(job.layout)
    model = Model(grid, job, cfg, dtype=torch_dtype(job.precision, grid.device), overlap=DEFAULTS.train.overlap,
                  seed=DEFAULTS.model.seed, std=DEFAULTS.model.init_std)
    sync = GradientSync(model.module, grid, shard=DEFAULTS.optimizer.zero1)
    o = DEFAULTS.optimizer
    opt = AdamW(sync, lr=LR, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay, clip_norm=o.clip or None)
    inputs, targets = local_batch(job, grid, ids.numpy())
    scale = 1.0 / (job.global_batch * job.seq)

    def step() -> torch.Tensor:
        loss = model.step(inputs, targets, sync, scale)
        updated = opt.step()  # on the device: a skipped update (non-finite norm) reads as a NaN loss, no sync
        return torch.where(updated, loss, torch.nan)

    return step, model.module


def transformers_step(cfg: ModelConfig, ids: torch.Tensor, device: torch.device):
    """transformers' LlamaForCausalLM in bf16 with SDPA attention, torch's fused AdamW and the
    trainer's clipping, the loss in float32 over every position as fourfold scores it."""
    import transformers

    o = DEFAULTS.optimizer
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf()),
                                                              attn_implementation="sdpa", dtype=torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                            fused=True)
    inputs, targets = ids[:, :-1].to(device), ids[:, 1:].to(device)

    def step() -> torch.Tensor:
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        if o.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model


def measure(build, cfg: ModelConfig, seq: int, micro_batch: int, device: torch.device, warmup: int, steps: int,
            peak_tflops: float | None) -> dict:
    """Build one framework's step, run `warmup` steps, then time `steps` (fenced by synchronize;
    losses are read afterwards, so no step waits for the host). Memory peaks count from the built
    model on, over every step (the first traces the gradient buckets and creates the optimizer state)."""
    started = time.perf_counter()
    step, model = build()
    synchronize(device)
    out = {"build_seconds": round(time.perf_counter() - started, 2),
           "parameters": sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = [step() for _ in range(warmup)]
    synchronize(device)
    started = time.perf_counter()
    losses += [step() for _ in range(steps)]
    synchronize(device)
    seconds = (time.perf_counter() - started) / steps
    tokens_per_s = micro_batch * seq / seconds
    tflops = model_flops_per_token(cfg, seq) * tokens_per_s / 1e12
    losses = [float(loss) for loss in losses]
    out.update(seconds_per_step=round(seconds, 4), tokens_per_s=round(tokens_per_s, 1), tflops_per_s=round(tflops, 2),
               mfu=round(tflops / peak_tflops, 4) if peak_tflops else None, first_loss=losses[0], last_loss=losses[-1],
               checks=[{"name": "every loss finite", "ok": all(map(math.isfinite, losses))}])
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["memory_gib"] = {"max_allocated": gib(torch.cuda.max_memory_allocated(device)),
                             "max_reserved": gib(torch.cuda.max_memory_reserved(device)),
                             "device_used": gib(total - free), "reserved_now": gib(torch.cuda.memory_reserved(device))}
    return out


def guarded(what: str, run, device: torch.device) -> dict:
    """`run()`, or {"error": ...} if it raised (the traceback goes to stderr); device memory freed."""
    say(what)
    try:
        return run()
    except Exception as e:  # a failed section is reported; the other sections still run
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        free_device_memory(device)


def memory_section(cfg: ModelConfig, job: Job, memory_gib: float, measured: dict | None) -> dict:
    """The planner's estimate for the job, the GPU-only terms apart, beside fourfold's measured step."""
    estimate = estimate_memory(cfg, job, memory_gib)
    allocator = {k: v for k, v in estimate.terms.items() if k not in GPU_ONLY_TERMS}
    gpu_only = {k: estimate.terms[k] for k in GPU_ONLY_TERMS}
    out = {"estimate_gib": {"allocator_terms": {k: gib(v) for k, v in allocator.items()},
                            "allocator_total": gib(sum(allocator.values())),
                            "gpu_only_terms": {k: gib(v) for k, v in gpu_only.items()},
                            "total": gib(estimate.total), "fits": estimate.fits}}
    if measured is not None:  # GiB
        m = measured
        out["measured_gib"] = {
            "max_allocated": m["max_allocated"],  # against the allocator terms
            "max_reserved": m["max_reserved"],
            "reserved_minus_allocated": round(m["max_reserved"] - m["max_allocated"], 3),  # against fragmentation
            # the CUDA context, NCCL and library workspaces (if nothing else runs on the GPU):
            # against cuda_context + nccl
            "outside_allocator": round(m["device_used"] - m["reserved_now"], 3),
            "device_used": m["device_used"],  # against the total
        }
        out["measured_over_estimated"] = {
            "max_allocated / allocator terms": round(m["max_allocated"] * GIB / sum(allocator.values()), 3),
            "device_used / total": round(m["device_used"] * GIB / estimate.total, 3),
        }
    return out


# ----- the run -------------------------------------------------------------------------------

def kernel_section(device: torch.device) -> dict:
    checks = [c for shape in SHAPES for block in BLOCKS for c in check_block(block, shape, device)]
    return {"checks": checks}


def training_section(args, device: torch.device, memory_gib: float, peak: float | None) -> tuple[dict, dict]:
    micro_batch = args.micro_batch or choose_micro_batch(memory_gib)
    job = job_for(micro_batch, SEQ)
    ids = torch.randint(0, MODEL.vocab, (micro_batch, SEQ + 1), generator=torch.Generator().manual_seed(0))
    run = dict(cfg=MODEL, seq=SEQ, micro_batch=micro_batch, device=device, warmup=args.warmup, steps=args.steps,
               peak_tflops=peak)
    ours = guarded(f"fourfold: build and {args.warmup} + {args.steps} steps, micro-batch {micro_batch}",
                   lambda: measure(lambda: fourfold_step(MODEL, job, ids, device), **run), device)
    theirs = guarded("transformers: the same", lambda: measure(lambda: transformers_step(MODEL, ids, device), **run),
                     device)
    training = {"micro_batch": micro_batch, "seq": SEQ, "tokens_per_step": micro_batch * SEQ, "lr": LR,
                "flops_per_token": model_flops_per_token(MODEL, SEQ), "peak_tflops": peak,
                "note": "transformers trains in plain bf16 (bf16 gradients and AdamW state); fourfold keeps "
                        "float32 gradient accumulators, master weights and moments, as the trainer does",
                "fourfold": ours, "transformers": theirs}
    if "tokens_per_s" in ours and "tokens_per_s" in theirs:
        training["fourfold_over_transformers"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
    return training, memory_section(MODEL, job, memory_gib, ours.get("memory_gib"))


def smoke_section(device: torch.device) -> dict:
    """One step of each framework's benchmark code on a tiny model on CPU: the code runs."""
    job = job_for(2, TINY_SEQ)
    ids = torch.randint(0, TINY.vocab, (2, TINY_SEQ + 1), generator=torch.Generator().manual_seed(0))
    run = dict(cfg=TINY, seq=TINY_SEQ, micro_batch=2, device=device, warmup=1, steps=1, peak_tflops=None)
    return {"note": "a tiny model on CPU: exercises the benchmark's code, measures nothing",
            "model": dataclasses.asdict(TINY),
            "fourfold": guarded("smoke: fourfold",
                                lambda: measure(lambda: fourfold_step(TINY, job, ids, device), **run), device),
            "transformers": guarded("smoke: transformers",
                                    lambda: measure(lambda: transformers_step(TINY, ids, device), **run), device)}


def all_ok(report: dict) -> bool:
    """No section failed and every check that ran passed."""
    def walk(node):
        if isinstance(node, dict):
            if "error" in node or node.get("ok") is False:
                return False
            return all(walk(v) for v in node.values())
        if isinstance(node, list):
            return all(walk(v) for v in node)
        return True

    return walk(report)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", choices=sorted(GPUS), help="the GPU preset (peak, memory) when the name matches none")
    p.add_argument("--peak-tflops", type=float, help="the bf16 dense peak to take MFU against")
    p.add_argument("--micro-batch", type=int, help="sequences per step (default: from the planner's estimate)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    facts = device_facts(args)
    report: dict = {"device": facts, "skipped": []}
    start_process_group(device)
    try:
        report["model"] = guarded("both models on the meta device", lambda: model_section(Grid(Layout())), device)
        if cuda:
            report["kernels"] = guarded("ring attention's kernels", lambda: kernel_section(device), device)
            report["training"], report["memory"] = training_section(args, device, facts["memory_gib"],
                                                                   facts["peak_tflops"])
        else:
            why = "no CUDA device: a dry run"
            report["skipped"] = [{"what": "kernels (CUDA flash attention)", "why": why},
                                 {"what": "training step of the 0.9B model, tokens/s and MFU", "why": why},
                                 {"what": "measured GPU memory", "why": why}]
            micro_batch = args.micro_batch or choose_micro_batch(facts["memory_gib"])
            report["plan"] = {"micro_batch": micro_batch, "seq": SEQ, "tokens_per_step": micro_batch * SEQ,
                              "flops_per_token": model_flops_per_token(MODEL, SEQ), "lr": LR}
            report["memory"] = memory_section(MODEL, job_for(micro_batch, SEQ), facts["memory_gib"], None)
            report["smoke"] = smoke_section(device)
    finally:
        dist.destroy_process_group()
    report["ok"] = all_ok(report)
    report["seconds"] = round(time.perf_counter() - START, 1)
    print(json.dumps(report, indent=1))
    say(f"done: {'every check passed' if report['ok'] else 'FAILED (see the JSON)'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
