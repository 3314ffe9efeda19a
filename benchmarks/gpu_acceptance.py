"""GPU acceptance of fourfold on ONE GPU: one command, a JSON report rewritten after every section.

Run from the repository root (not yet run on a GPU; it ends by --deadline-s, 480 s, keeping what finished):

    python benchmarks/gpu_acceptance.py --output benchmarks/results/acceptance-H200.json

The report holds what finished whatever happens after: it is written (atomically) when each
section starts ("running": its name) and ends; at the deadline a watchdog writes "stopped" and
ends the process (a hang, a slow compile); a crash leaves the last section named in "running".
Strict JSON: a non-finite number is null. Progress goes to stderr. Exit status 0: every check passed.

Sections (each {"error": ...} if it raised; the others still run):
  device          the GPU, torch, CUDA, NCCL; the bf16 peak MFU is taken against (--gpu, --peak-tflops)
  process_group   a one-rank NCCL world, started inside the guard
  model           fourfold's and transformers' models of the ~1B Llama built on the meta device: equal counts
  ring_attention  context._RingAttention forward and backward for cp = 2, 4, 8 with GQA, the cp ranks as
                  threads on the one GPU (tests/gpu/ring_checks.py), against float64 attention
  kernels         ring attention's per-block flash kernels against float32 (tests/gpu/kernel_checks.py)
  same_weights    transformers' random init loaded into fourfold: step-1 loss and gradient norm of fourfold
                  (bf16, fp32 master weights) and of transformers with autocast, each against transformers
                  in float32; fourfold's error at most twice autocast's (floor 1e-3 relative); both losses
                  after 10 AdamW steps
  throughput      tokens/s and MFU of fourfold, transformers like for like (fp32 master weights, bf16
                  autocast, fused AdamW) and transformers in pure bf16 (bf16 weights and moments); the host
                  syncs in each one's timed steps (torch.cuda.set_sync_debug_mode: fourfold's must be 0) and
                  the attention kernels fourfold's step dispatched (which SDPA backend ran: cuDNN's where
                  it takes the shapes, `context.preferred_kernels`, else flash; transformers' steps run
                  torch's default order, flash first: compare kernels before tokens/s)
  memory          fourfold's peak at recompute none / selective / full x micro-batch 1 / 8 against the
                  planner's estimate (fourfold.plan.memory.fourfold_memory): max_allocated within 10% of
                  its allocator terms
  compile         train.compile off and on: compile seconds, tokens/s
  flash           fourfold's attention forced onto the flash kernel (sdpa_kernel(FLASH_ATTENTION), which
                  `preferred_kernels` keeps): a silent fall-back would raise here; its tokens/s against the
                  throughput section's (cuDNN first)

Owed by issue #38's levers, which one GPU cannot measure (a multi-GPU job's, docs/benchmarks.md):
  param_gather    ZeRO-1's parameter all-gather left in flight (optimizer.overlap_param_gather true) against
                  waited (false): step time of a dp-only 8-GPU job with bf16 parameters, and whether the
                  first layers' forward runs while the gathers are in flight (an nsys timeline)
  grouped_experts a Mixtral layer (bf16, no ep, then ep8) with its experts as one torch._grouped_mm against
                  their loop (`ParallelMoE.grouped_gemm` false): step time, the grouped kernel taken (an
                  nsys trace), no host sync in the dropless step (set_sync_debug_mode), and CUDA peak against
                  the estimator's stacked-weight and all-rows terms
  masked          document-masked attention (GQA, and a sliding window) on one rank: flash's varlen kernel
                  (`masked_attention`, the default in bf16 on CUDA) equal to the banded path within bf16
                  tolerance, its time and peak against the banded efficient kernel's (`varlen=False`,
                  K/V repeated) and against causal attention; the cp ring's masked blocks
                  on the efficient kernel (`context._masked_efficient`): equal to `_masked_math` in bf16
                  tolerance on every row, those that see none of a block's keys included (their lse
                  -inf), its time and peak against it
  compile_whole   a dp-only Llama step with train.compile (each block one graph): tokens/s against eager,
                  zero graph breaks (torch._dynamo counters) with ZeRO-1's gathers in flight
  forward_tp      a tp8 (y8, sequence parallel) Llama step with train.overlap on (forward_chunks 2) against
                  forward_chunks 1: step time, and the NCCL kernels beside the chunked GEMMs in an nsys trace
                  with CUDA_DEVICE_MAX_CONNECTIONS=1; on x2 y4, the rank-slice GEMMs of the feature
                  reduce-scatters (`linear._features_scattered`) against one GEMM and the reordering copy;
                  with micro-batch 1 and 4, a chunk's GEMM block by block (`linear._gemm_by_blocks`, 8
                  GEMMs of a slice each on y8) against one GEMM and its landing copy, and step time per
                  token at both micro-batches (the token collectives copy nothing at either)
  fp8             an 8B-class step with train.fp8 tensorwise and rowwise against bf16: tokens/s (torchtitan:
                  about 1.28x for tensorwise on H100), the loss gap over 100 steps, _scaled_mm taken (an
                  nsys trace), and the planner's fp8_speedup against the measured ratio

Owed by issue #40's families (not sections yet: each wants the family's kernel choice settled first):
  windows         a Gemma 3 / GPT-OSS layer's sliding-window attention: fourfold runs it as banded SDPA with
                  a boolean mask (the math kernel on CUDA: fp32 scores kept); its time and memory against
                  FlexAttention's block mask and flash-attn's window_size, which should replace it
  sinks           GPT-OSS's sinks go through the flash kernel that returns the log-sum-exp (the ring of one
                  rank): bf16 error against float32, and the step time against plain SDPA without sinks
  mla             DeepSeek-V3's latent attention pads V from 128 to 192 features for flash: the padded PV
                  product's share of the step, against a kernel that takes the smaller V head (cuDNN, TE)
  balance         the balancing bias update's cost (one all-reduce of [layers, experts] a step, no host sync:
                  torch.cuda.set_sync_debug_mode must stay silent)

--dry-run (the default without CUDA): every section on a tiny model on CPU, which checks the code and
measures nothing (compile is skipped: inductor on CPU takes minutes); tests/gpu/test_acceptance.py
runs it. N >= 2 GPUs: also `torchrun --nproc-per-node N -m pytest tests/gpu -m gpu` (NCCL collectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

START = time.perf_counter()


def _report_before_imports(imported) -> None:
    """Write the report before torch and fourfold are imported (run as a script), so that an image
    without them, or a broken install, leaves a report naming the failed import and its fix
    instead of none. `imported()` does the imports."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--output", default="acceptance.json")
    path = Path(early.parse_known_args()[0].output)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(data: dict) -> None:
        path.with_name(path.name + ".tmp").write_text(json.dumps(data, indent=1) + "\n")
        os.replace(path.with_name(path.name + ".tmp"), path)

    write({"ok": None, "running": "imports", "skipped": []})
    try:
        imported()
    except Exception as e:
        write({"ok": False, "running": None, "skipped": [], "imports": {
            "error": f"{type(e).__name__}: {e}", "fix": "install fourfold's dependencies beside this machine's "
            "torch (pip install -e . keeps it; the bundled corpus is not needed); fourfold itself is read from src/"}})
        traceback.print_exc(file=sys.stderr)
        sys.exit(2)


# fourfold from this checkout (no install needed); the kernel and ring checks from the tests that share them.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
if __name__ == "__main__":
    _report_before_imports(lambda: [importlib.import_module(name) for name in (
        "torch", "fourfold.parallel.model", "fourfold.checkpoint.hf", "fourfold.plan.memory", "gpu.kernel_checks")])


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fourfold.checkpoint.hf import load_hf  # noqa: E402
from fourfold.config import TrainConfig  # noqa: E402
from fourfold.models.config import ModelConfig  # noqa: E402
from fourfold.parallel.data import GradientSync  # noqa: E402
from fourfold.parallel.grid import Grid  # noqa: E402
from fourfold.parallel.model import Model, local_batch  # noqa: E402
from fourfold.parallel.optimizer import AdamW  # noqa: E402
from fourfold.parallel.tensor.block import TensorOptions  # noqa: E402
from fourfold.parallel.transformer import Transformer  # noqa: E402
from fourfold.plan.memory import GIB, fourfold_memory  # noqa: E402
from fourfold.plan.perf import model_flops_per_token  # noqa: E402
from fourfold.spec.hardware import GPUS  # noqa: E402
from fourfold.spec.job import Job  # noqa: E402
from fourfold.spec.layout import Layout  # noqa: E402
from fourfold.tools.measure import GPU_ONLY_TERMS  # noqa: E402
from fourfold.train.schedule import learning_rate  # noqa: E402
from gpu.kernel_checks import BLOCKS, SHAPES, Shape, check_block  # noqa: E402
from gpu.ring_checks import check_ring  # noqa: E402

DEFAULTS = TrainConfig()  # the trainer's defaults: optimizer, overlap, initialisation
# the peak rate (a step's cost does not depend on it)
LR = learning_rate(DEFAULTS.optimizer, DEFAULTS.train.steps, DEFAULTS.optimizer.warmup)


@dataclasses.dataclass(frozen=True)
class Setup:
    """The sizes of a run: the GPU's, or the dry run's tiny ones."""
    model: ModelConfig
    seq: int
    micro_batch: int  # the throughput section's
    ring: Shape  # per cp: seq divisible by 2 * 8
    steps: int
    warmup: int


# A 1.1B Llama (hidden 2048, 22 layers, 16 heads of 128 over 8 kv heads, TinyLlama's shape) at seq 2048.
GPU = Setup(ModelConfig("llama", hidden=2048, layers=22, heads=16, kv_heads=8, head_dim=128, ffn=5632, vocab=32000,
                        max_positions=2048, tied=False, eps=1e-5), seq=2048, micro_batch=8,
            ring=Shape(1, 8, 2, 4096, 128), steps=10, warmup=3)
DRY = Setup(ModelConfig("llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=176, vocab=256,
                        max_positions=64, tied=False, eps=1e-5), seq=64, micro_batch=8, ring=Shape(1, 4, 2, 128, 32),
            steps=2, warmup=1)
DRY_RUN_GPU = "h100-80gb"  # the memory the dry run's estimates take
MICRO_BATCHES = (1, 8)
RECOMPUTE = ("none", "selective", "full")
SAME_WEIGHT_STEPS = 10
MEMORY_TOLERANCE = 0.10  # the estimate's allocator terms against max_allocated (5% under fake tensors)
FLOOR = 1e-3  # relative: a distance below this is no signal (transformers' own may be ~0 by chance;
# at 2e-4 an 8-layer model's gradient norm failed by chance)


def say(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


def gib(n: float) -> float:
    return round(n / GIB, 3)


def strict(node):
    """The report with every non-finite float as None (strict JSON has no NaN)."""
    if isinstance(node, float):
        return node if math.isfinite(node) else None
    if isinstance(node, dict):
        return {k: strict(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [strict(v) for v in node]
    return node


class Report:
    """The JSON report, rewritten after every change; a watchdog ends the run at the deadline."""

    def __init__(self, path: Path, deadline_s: float):
        self.path, self.data, self.lock = path, {"ok": None, "running": None, "skipped": []}, threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self.watchdog = threading.Timer(max(0.0, deadline_s - (time.perf_counter() - START)), self._stop, [deadline_s])
        self.watchdog.daemon = True
        self.watchdog.start()

    def write(self) -> None:
        with self.lock:
            self.data["seconds"] = round(time.perf_counter() - START, 1)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(strict(self.data), indent=1, allow_nan=False) + "\n")
            os.replace(tmp, self.path)

    def _stop(self, deadline_s: float) -> None:
        self.data["stopped"] = f"deadline of {deadline_s:g} s passed during {self.data['running']}"
        self.data["ok"] = False
        self.write()
        say(self.data["stopped"])
        os._exit(3)

    def section(self, name: str, run, device: torch.device) -> dict:
        """`run()` into report[name], or {"error": ...} if it raised (the traceback to stderr)."""
        say(name)
        self.data["running"] = name
        self.write()
        try:
            result = run()
        except Exception as e:  # reported; the other sections still run
            traceback.print_exc(file=sys.stderr)
            result = {"error": f"{type(e).__name__}: {e}"}
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        self.data[name] = result
        self.data["running"] = None
        self.write()
        return result

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append({"what": what, "why": why})
        self.write()

    def finish(self) -> bool:
        self.watchdog.cancel()
        self.data["ok"] = all_ok(self.data)
        self.write()
        return self.data["ok"]


def all_ok(report: dict) -> bool:
    """No section failed and every check that ran passed."""
    def walk(node):
        if isinstance(node, dict):
            return "error" not in node and node.get("ok") is not False and all(walk(v) for v in node.values())
        return all(walk(v) for v in node) if isinstance(node, list) else True

    return walk({k: v for k, v in report.items() if k != "ok"})


# ----- the device ----------------------------------------------------------------------------

def gpu_preset(device_name: str, memory_gib: float) -> str | None:
    """The preset of this GPU: its family named as a word in the device name ('h200' is not in
    'GH200'), the nearest capacity within the family. None for no match, and for PCIe and NVL
    parts, whose clocks (and so peaks) are not the presets' SXM ones."""
    name = device_name.lower()
    if "pcie" in name or "nvl" in name:
        return None
    family = [g for g in GPUS if re.search(rf"\b{re.escape(g.split('-')[0])}\b", name)]
    return min(family, key=lambda g: abs(GPUS[g].memory_gib - memory_gib), default=None)


def device_facts(args, device: torch.device) -> dict:
    """The device, the bf16 peak MFU is taken against, and where that peak comes from."""
    facts = {"torch": torch.__version__, "dry_run": device.type != "cuda"}
    if device.type != "cuda":
        preset = args.gpu or DRY_RUN_GPU
        return facts | {"memory_gib": GPUS[preset].memory_gib, "peak_tflops": None, "peak_source": "dry run"}
    props = torch.cuda.get_device_properties(device)
    name, memory = torch.cuda.get_device_name(device), props.total_memory / GIB
    preset = args.gpu or gpu_preset(name, memory)
    if args.peak_tflops:
        peak, source = args.peak_tflops, "--peak-tflops"
    elif preset:
        peak, source = GPUS[preset].bf16_tflops, f"preset {preset}" + ("" if args.gpu else f" (matched {name!r})")
    else:
        peak, source = None, f"no preset matches {name!r}: give --gpu or --peak-tflops for MFU"
    return facts | {"name": name, "capability": list(torch.cuda.get_device_capability(device)),
                    "memory_gib": round(memory, 2), "peak_tflops": peak, "peak_source": source,
                    "cuda_runtime": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def start_process_group(device: torch.device) -> dict:
    """A world of this one process (no torchrun; the store lives in the process): NCCL on the GPU,
    as the trainer's ranks join it, gloo on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return {"backend": dist.get_backend()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----- the frameworks' steps -----------------------------------------------------------------

def job_for(setup: Setup, micro_batch: int, recompute: str = "none") -> Job:
    """The trainer's default job on one rank, one micro-batch per step, in bf16."""
    return dataclasses.replace(DEFAULTS.job(), global_batch=micro_batch, micro_batch=micro_batch, seq=setup.seq,
                               precision="bf16", recompute=recompute)


def batch(setup: Setup, micro_batch: int) -> torch.Tensor:
    return torch.randint(0, setup.model.vocab, (micro_batch, setup.seq + 1), generator=torch.Generator().manual_seed(0))


def fourfold_step(cfg: ModelConfig, job: Job, ids: torch.Tensor, *, compile: bool = False, load: str = ""):
    """The trainer's construction (trainer._train) and its step: (step -> loss, model, optimizer)."""
    grid = Grid(job.layout)
    model = Model(grid, job, cfg, dtype=torch.bfloat16, overlap=DEFAULTS.train.overlap, seed=DEFAULTS.model.seed,
                  std=DEFAULTS.model.init_std, compile=compile)
    if load:
        load_hf(model.module, load)
    sync = GradientSync(model.module, grid, shard=DEFAULTS.optimizer.zero1)
    o = DEFAULTS.optimizer
    opt = AdamW(sync, lr=LR, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                decay_vectors=o.decay_norms_and_biases, clip_norm=o.clip or None)
    batch = local_batch(job, grid, ids.numpy())
    scale = 1.0 / (job.global_batch * job.seq)

    def step() -> torch.Tensor:
        loss = model.step(batch, sync, scale)
        updated = opt.step()  # on the device: a skipped update (non-finite norm) reads as a NaN loss, no sync
        return torch.where(updated, loss, torch.nan)

    return step, model.module, opt


def transformers_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf()),
                                                             attn_implementation="sdpa", dtype=dtype)


def forward_backward(model, ids: torch.Tensor, device: torch.device, autocast: bool) -> torch.Tensor:
    """transformers' loss in float32 over every position, as fourfold scores it, and its backward.
    autocast: bf16 autocast over fp32 weights (its Trainer's bf16=True); else the weights' dtype."""
    inputs, targets = ids[:, :-1].to(device), ids[:, 1:].to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach()


def transformers_step(model, ids: torch.Tensor, device: torch.device, autocast: bool):
    """transformers' model with torch's fused AdamW and the trainer's clipping: step -> (loss,
    gradient norm before clipping)."""
    o = DEFAULTS.optimizer
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                            fused=True)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        loss = forward_backward(model, ids, device, autocast)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip or math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, norm

    return step


def timed(step, setup: Setup, micro_batch: int, device: torch.device, peak: float | None) -> dict:
    """`warmup` steps, then `steps` timed (fenced by synchronize; losses read afterwards, so no
    step waits for the host). The first step's seconds beside (compilation, optimizer state)."""
    started = time.perf_counter()
    losses = [step()]
    synchronize(device)
    first = time.perf_counter() - started
    losses += [step() for _ in range(setup.warmup - 1)]
    synchronize(device)
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as syncs:  # a step that waits for the host, counted
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            losses += [step() for _ in range(setup.steps)]
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    seconds = (time.perf_counter() - started) / setup.steps
    tokens_per_s = micro_batch * setup.seq / seconds
    tflops = model_flops_per_token(setup.model, setup.seq) * tokens_per_s / 1e12
    losses = [float(loss[0] if isinstance(loss, tuple) else loss) for loss in losses]
    host_syncs = sum("synchroniz" in str(w.message) for w in syncs) if device.type == "cuda" else None
    return {"first_step_seconds": round(first, 2), "seconds_per_step": round(seconds, 4),
            "tokens_per_s": round(tokens_per_s, 1), "tflops_per_s": round(tflops, 2),
            "mfu": round(tflops / peak, 4) if peak else None, "first_loss": losses[0], "last_loss": losses[-1],
            "host_syncs_in_timed_steps": host_syncs,  # torch.cuda.set_sync_debug_mode's warnings
            "checks": [{"name": "every loss finite", "ok": all(map(math.isfinite, losses))}]}


class _AttentionKernels(TorchDispatchMode):
    """The attention operators a step dispatches (which SDPA backend ran: flash, efficient, cuDNN, math)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if "attention" in name:
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


def attention_kernels(step) -> list[str]:
    with _AttentionKernels() as seen:
        step()
    return sorted(seen.seen)


def peak_memory(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"max_allocated": gib(torch.cuda.max_memory_allocated(device)),
            "max_reserved": gib(torch.cuda.max_memory_reserved(device)),
            "device_used": gib(total - free), "reserved_now": gib(torch.cuda.memory_reserved(device))}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ----- the sections --------------------------------------------------------------------------

def model_section(setup: Setup) -> dict:
    """Both frameworks' models built on the meta device: the same parameter count as the config."""
    grid = Grid(Layout())
    with torch.device("meta"):
        ours = Transformer(grid, setup.model, TensorOptions(dtype=torch.bfloat16))
    theirs = transformers_model(setup.model, torch.device("meta"), torch.bfloat16)
    counts = {"config": setup.model.parameter_count(), "fourfold": sum(p.numel() for p in ours.parameters()),
              "transformers": sum(p.numel() for p in theirs.parameters())}
    return {"config": dataclasses.asdict(setup.model), "seq": setup.seq, "parameters": counts,
            "checks": [{"name": "parameter counts equal (config, fourfold, transformers)",
                        "ok": len(set(counts.values())) == 1}]}


def ring_section(setup: Setup, device: torch.device) -> dict:
    return {"shape": str(setup.ring), "checks": [c for cp in (2, 4, 8) for c in check_ring(setup.ring, cp, device)]}


def kernel_section(device: torch.device) -> dict:
    return {"checks": [c for shape in SHAPES for block in BLOCKS for c in check_block(block, shape, device)]}


def _close(name: str, value: float, reference: float, yardstick: float) -> dict:
    """value within max(2 x the yardstick's distance, FLOOR relative) of the reference."""
    distance, allowed = abs(value - reference), max(2 * abs(yardstick - reference), FLOOR * abs(reference))
    return {"name": name, "fourfold": value, "transformers_autocast": yardstick, "transformers_float32": reference,
            "distance": distance, "allowed": allowed, "ok": distance <= allowed}


def same_weights_section(setup: Setup, device: torch.device) -> dict:
    """transformers' initial weights in fourfold: step 1 of fourfold and of transformers with
    autocast against transformers in float32, then SAME_WEIGHT_STEPS steps of both."""
    ids = batch(setup, 1)
    theirs = transformers_model(setup.model, device, torch.float32)
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        step, _, opt = fourfold_step(setup.model, job_for(setup, 1), ids, load=directory)
    ours = []
    for _ in range(SAME_WEIGHT_STEPS):
        loss = float(step())
        ours.append((loss, opt.last_norm))
    del step, opt
    exact_loss = float(forward_backward(theirs, ids, device, autocast=False))  # float32, no update
    exact_norm = float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), math.inf))
    theirs.zero_grad(set_to_none=True)
    step = transformers_step(theirs, ids, device, autocast=True)
    autocast = [tuple(map(float, step())) for _ in range(SAME_WEIGHT_STEPS)]
    return {"tokens": setup.seq,
            "checks": [_close("step-1 loss", ours[0][0], exact_loss, autocast[0][0]),
                       _close("step-1 gradient norm", ours[0][1], exact_norm, autocast[0][1])],
            f"loss_at_step_{SAME_WEIGHT_STEPS}": {"fourfold": ours[-1][0], "transformers_autocast": autocast[-1][0],
                                                 "relative_difference": abs(ours[-1][0] / autocast[-1][0] - 1)}}


def throughput_section(setup: Setup, device: torch.device, peak: float | None) -> dict:
    mb, ids = setup.micro_batch, batch(setup, setup.micro_batch)
    out = {"micro_batch": mb, "seq": setup.seq, "tokens_per_step": mb * setup.seq, "lr": LR,
           "flops_per_token": model_flops_per_token(setup.model, setup.seq), "peak_tflops": peak}
    step = fourfold_step(setup.model, job_for(setup, mb), ids)[0]
    out["fourfold"] = timed(step, setup, mb, device, peak)
    out["fourfold"]["attention_kernels"] = attention_kernels(step)  # (one more step, watched)
    out["fourfold"]["checks"].append({"name": "no host sync in fourfold's timed steps",
                                      "ok": out["fourfold"]["host_syncs_in_timed_steps"] in (0, None)})
    del step
    gc.collect()
    for name, dtype, autocast in (("transformers_autocast", torch.float32, True),
                                  ("transformers_bf16", torch.bfloat16, False)):
        step = transformers_step(transformers_model(setup.model, device, dtype), ids, device, autocast)
        out[name] = timed(step, setup, mb, device, peak)
        del step
        gc.collect()
    out["fourfold_over_transformers_autocast"] = round(
        out["fourfold"]["tokens_per_s"] / out["transformers_autocast"]["tokens_per_s"], 3)
    return out


def memory_section(setup: Setup, device: torch.device, memory_gib: float) -> dict:
    """fourfold's peak over two steps (from the model's build on) against the planner's estimate: its
    allocator terms against max_allocated, its total (with the CUDA context, NCCL, fragmentation)
    against the device memory in use."""
    rows = []
    for micro_batch in MICRO_BATCHES:
        for recompute in RECOMPUTE:
            job = job_for(setup, micro_batch, recompute)
            estimate = fourfold_memory(setup.model, job, memory_gib)
            allocator = sum(v for k, v in estimate.terms.items() if k not in GPU_ONLY_TERMS)
            row = {"micro_batch": micro_batch, "recompute": recompute,
                   "estimate_gib": {"allocator_terms": gib(allocator), "total": gib(estimate.total)}}
            reset_peak(device)
            step = fourfold_step(setup.model, job, batch(setup, micro_batch))[0]
            losses = [float(step()) for _ in range(2)]
            row["losses_finite"] = {"name": "both losses finite", "ok": all(map(math.isfinite, losses))}
            measured = peak_memory(device)
            if measured:
                row["measured_gib"] = measured
                row["max_allocated / allocator terms"] = round(measured["max_allocated"] * GIB / allocator, 3)
                row["device_used / total"] = round(measured["device_used"] * GIB / estimate.total, 3)
                row["checks"] = [{"name": f"max_allocated within {MEMORY_TOLERANCE:.0%} of the allocator terms",
                                  "ok": abs(row["max_allocated / allocator terms"] - 1) <= MEMORY_TOLERANCE}]
            rows.append(row)
            del step
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"seq": setup.seq, "runs": rows}


def compile_section(setup: Setup, device: torch.device, peak: float | None) -> dict:
    """train.compile off and on: the first step's extra seconds (compilation) and tokens/s."""
    mb, ids, out = setup.micro_batch, batch(setup, setup.micro_batch), {}
    for compile in (False, True):
        step = fourfold_step(setup.model, job_for(setup, mb), ids, compile=compile)[0]
        out["on" if compile else "off"] = timed(step, setup, mb, device, peak)
        del step
        gc.collect()
    out["compile_seconds"] = round(out["on"]["first_step_seconds"] - out["off"]["first_step_seconds"], 2)
    out["on_over_off"] = round(out["on"]["tokens_per_s"] / out["off"]["tokens_per_s"], 3)
    return out


def flash_section(setup: Setup, device: torch.device, peak: float | None) -> dict:
    """fourfold's steps with SDPA allowed the flash kernel only: a fall-back would raise."""
    mb, ids = setup.micro_batch, batch(setup, setup.micro_batch)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        step = fourfold_step(setup.model, job_for(setup, mb), ids)[0]
        return timed(step, setup, mb, device, peak)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="acceptance.json", help="the JSON report, rewritten after every section")
    p.add_argument("--deadline-s", type=float, default=480.0, help="stop here, keeping what finished (default 480)")
    p.add_argument("--dry-run", action="store_true", help="tiny models on CPU (the default without CUDA)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the GPU preset (peak, memory) when the name matches none")
    p.add_argument("--peak-tflops", type=float, help="the bf16 dense peak to take MFU against")
    args = p.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    setup, device = (DRY, torch.device("cpu")) if dry else (GPU, torch.device("cuda", 0))
    report = Report(Path(args.output), args.deadline_s)
    facts = report.section("device", lambda: device_facts(args, device), device)
    peak, memory_gib = facts.get("peak_tflops"), facts.get("memory_gib", 80.0)
    if "error" in report.section("process_group", lambda: start_process_group(device), device):
        report.skip("every other section", "no process group (see process_group)")
        return 0 if report.finish() else 1
    report.section("model", lambda: model_section(setup), device)
    report.section("ring_attention", lambda: ring_section(setup, device), device)
    if dry:
        report.skip("kernels", "CUDA's flash kernels: a dry run")
    else:
        report.section("kernels", lambda: kernel_section(device), device)
    report.section("same_weights", lambda: same_weights_section(setup, device), device)
    report.section("throughput", lambda: throughput_section(setup, device, peak), device)
    report.section("memory", lambda: memory_section(setup, device, memory_gib), device)
    if dry:
        report.skip("compile", "inductor on CPU takes minutes: a dry run")
    else:
        report.section("compile", lambda: compile_section(setup, device, peak), device)
    report.section("flash", lambda: flash_section(setup, device, peak), device)
    dist.destroy_process_group()
    ok = report.finish()
    say(f"done, {args.output}: {'every check passed' if ok else 'FAILED (see the report)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
