"""Time of one training step: compute + exposed communication + pipeline bubble + optimizer.

Communication volumes come from `fourfold.volumes`, the functions the runtime's ledger is
tested against; each collective runs at the bandwidth its group gets under the placement order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fourfold.blockspec import attention_chunks, block_plan
from fourfold.models.config import ModelConfig
from fourfold.plan.hardware import Cluster
from fourfold.job import Job
from fourfold.plan.memory import layer_params
from fourfold.volumes import (
    Collective,
    block_passes,
    ring_attention_passes,
    bytes_sent,
    embedding_passes,
    head_passes,
)

EFFICIENCY_MAX = 0.8  # best fraction of peak a large bf16 GEMM reaches
EFFICIENCY_HALF = 128  # GEMM dimension at which efficiency is half of the best


@dataclass(frozen=True)
class Calibration:
    """What a user can measure on their machine and feed back (`--calibrate FILE`, JSON)."""

    efficiency_max: float = EFFICIENCY_MAX
    efficiency_half: float = EFFICIENCY_HALF
    bandwidth_factor: float = 1.0  # measured / modelled bandwidth


def gemm_efficiency(m: float, n: float, k: float, cal: Calibration) -> float:
    """Small local GEMMs after heavy sharding run far below peak."""
    smallest = min(m, n, k)
    return cal.efficiency_max * smallest / (smallest + cal.efficiency_half)


def group_bandwidth(s: Job, cluster: Cluster, dims: tuple[str, ...]) -> float:
    """Bytes/s per GPU for a collective over `dims`: intra-node if the group fits in a node, else
    the node's NICs shared by the groups of this dim that cross the node boundary together."""
    return _bandwidth(s.layout, cluster, dims)


@functools.lru_cache(maxsize=65536)  # the search asks the same question for many candidates
def _bandwidth(layout, cluster: Cluster, dims: tuple[str, ...]) -> float:
    inner = min(dims, key=layout.order.index)
    stride = layout.stride(inner)
    span = stride * layout.size(dims) if len(dims) == 1 else max(layout.stride(d) * layout.size(d) for d in dims)
    if span <= cluster.gpus_per_node:
        gbs = cluster.intra_node_gbs
    else:
        gbs = cluster.inter_node_gbs * cluster.gpus_per_node / min(stride, cluster.gpus_per_node)
        gbs = min(gbs, cluster.intra_node_gbs)
    return gbs * 1e9


def comm_seconds(collectives: list[Collective], s: Job, cluster: Cluster, element_size: int, cal: Calibration) -> float:
    """Seconds of these collectives run one after another: volume over the group's bandwidth, plus
    a latency per ring step."""
    return _totals_seconds(_totals(collectives), s, cluster, element_size, cal)


def _totals(collectives: list[Collective]) -> tuple[tuple[str, str, int, int], ...]:
    """(group, op, elements, count): collectives of a kind summed (the volume is linear)."""
    totals: dict[tuple[str, str], list[int]] = {}
    for c in collectives:
        entry = totals.setdefault((c.group, c.op), [0, 0])
        entry[0] += c.numel
        entry[1] += 1
    return tuple((group, op, numel, count) for (group, op), (numel, count) in totals.items())


def _totals_seconds(totals, s: Job, cluster: Cluster, element_size: int, cal: Calibration) -> float:
    seconds = 0.0
    for group, op, numel, count in totals:
        g, bandwidth = _group_figures(s.layout, cluster, group)
        steps = 2 * (g - 1) if op == "all_reduce" else (g - 1)
        seconds += (_per_byte(op, g) * numel * element_size / (bandwidth * cal.bandwidth_factor)
                    + count * steps * cluster.latency_us * 1e-6)
    return seconds


@functools.lru_cache(maxsize=262144)
def _group_figures(layout, cluster: Cluster, group: str) -> tuple[int, float]:
    """(size, bytes/s per GPU) of a group named like a ledger entry ("x", "dp_cp")."""
    dims = tuple(group.split("_"))
    return layout.size(dims), _bandwidth(layout, cluster, dims)


@functools.lru_cache(maxsize=65536)  # independent of the placement order and of recompute
def _layer_totals(block, sizes: tuple[tuple[str, int], ...], batch: int, seq: int, seq_parallel: bool,
                  keep_inputs: bool):
    """One layer's collectives, summed: (activations outside cp and z, the input-gradient
    all-reduces, the z weight traffic)."""
    passes = block_passes(block, dict(sizes), batch, seq, seq_parallel=seq_parallel, keep_inputs=keep_inputs)
    every = passes.all()
    return (_totals([c for c in every if c.group not in ("cp", "z")]),  # ring attention: separately
            _totals([c for c in passes.backward if c.op == "all_reduce" and c.group in ("x", "y")]),
            _totals([c for c in every if c.group == "z"]))


@functools.lru_cache(maxsize=None)
def _per_byte(op: str, group_size: int) -> float:
    """Bytes sent per byte of message (the volumes are linear in the message)."""
    return float(bytes_sent(op, group_size, 1))


@dataclass
class StepTime:
    compute: float
    exposed_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    flops_per_gpu: float  # model FLOPs (6N + attention) per GPU per step

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.dp_comm + self.optimizer

    def breakdown(self) -> dict[str, float]:
        return {"compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble,
                "dp_comm": self.dp_comm, "optimizer": self.optimizer}


def model_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """6 N (non-embedding parameters) + 6 L h s for causal attention (forward and backward)."""
    matrices, _ = layer_params(cfg)
    return 6 * (matrices * cfg.layers + cfg.hidden * cfg.vocab) + 6 * cfg.layers * cfg.hidden * seq


@functools.lru_cache(maxsize=4096)
def _plan(block, x: int, y: int):
    """The block plan's shapes (sequence parallelism changes collectives, not GEMMs)."""
    return block_plan(block, x, y, seq_parallel=False)


def _layer_compute_seconds(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration, framework: str) -> tuple[float, float]:
    """(forward seconds, seconds of the dW GEMMs) of one layer for one micro-batch on one rank."""
    b = cfg.block
    if framework == "megatron":
        x, y = 1, s.y
    else:
        x, y = s.x, s.y
    T = s.seq / s.cp * s.micro_batch / s.z
    peak = cluster.gpu.bf16_tflops * 1e12
    d = b.head_dim
    plan = _plan(b, x, y)
    forward = 0.0
    for layer in plan.linears:  # each rank's block of each GEMM (z only splits the stored weights)
        k_local = layer.in_features / (x if layer.in_dim == "x" else y)
        n_local = layer.out_features / (x if layer.out_dim == "x" else y)
        forward += 2 * T * k_local * n_local / (peak * gemm_efficiency(T, k_local, n_local, cal))
    heads = plan.local_heads
    # QK^T and PV of the local queries against the whole sequence (ring attention brings the
    # other chunks' keys), causal: half of it
    attention = 2 * 2 * T * s.seq * d * heads / 2
    attention_seconds = attention / (peak * gemm_efficiency(T, d, s.seq / s.cp, cal))
    return forward + attention_seconds, forward


@functools.lru_cache(maxsize=65536)
def _head_totals(sizes: tuple[tuple[str, int], ...], vocab: int, hidden: int, tokens: int):
    """The embedding's and the LM head's collectives for one micro-batch, summed."""
    grid = dict(sizes)
    return _totals(embedding_passes(grid, vocab, hidden, tokens).all() + head_passes(grid, hidden, vocab, tokens).all())


@functools.lru_cache(maxsize=65536)
def _ring_totals(block, sizes: tuple[tuple[str, int], ...], batch: int, seq: int):
    ring = ring_attention_passes(block, dict(sizes), batch, seq)
    return _totals(ring.forward), _totals(ring.backward)


def _tensor_comm(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration, forward_seconds: float,
                 dw_seconds: float, framework: str) -> float:
    """Exposed tensor-parallel communication of one layer for one micro-batch (forward and backward)."""
    b = s.element_bytes  # bf16 on GPUs
    sizes = s.layout.sizes
    T = int(s.seq / s.cp * s.micro_batch / s.z)
    if framework == "megatron":  # 1D TP with sequence parallelism: AG + RS per sublayer, both passes
        sublayer = [Collective("y", "all_gather", T * cfg.hidden), Collective("y", "reduce_scatter", T * cfg.hidden)]
        return comm_seconds(sublayer * 4, s, cluster, b, cal)
    activations, input_grad, weights = _layer_totals(cfg.block, tuple(sizes.items()), int(s.micro_batch / s.z),
                                                     int(s.seq / s.cp), s.seq_parallel, s.keep_gathered_inputs)
    total = _totals_seconds(activations, s, cluster, b, cal)
    # The input-gradient all-reduce hides behind the dW GEMM of the same layer (the runtime's overlap).
    exposed = total - min(dw_seconds, _totals_seconds(input_grad, s, cluster, b, cal))
    # z: the weight all-gathers are prefetched one GEMM ahead and the dW reduce-scatters deferred
    # to the next one, so they hide behind the layer's compute (3x forward) up to its length.
    weights = _totals_seconds(weights, s, cluster, b, cal)
    return exposed + max(0.0, weights - 3 * forward_seconds)


def _ring_attention_exposed(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration, framework: str) -> float:
    """Ring attention over cp (the runtime's volumes): each of the cp-1 forward steps hides its
    K, V transfer behind one block attention, backward behind two (its dQ and dK/dV GEMMs)."""
    T = s.seq / s.cp * s.micro_batch / s.z
    ring_forward, ring_backward = _ring_totals(cfg.block, tuple(s.layout.sizes.items()), int(s.micro_batch / s.z),
                                               int(s.seq / s.cp))
    tp_heads = s.y if framework == "megatron" else attention_chunks(cfg.block, s.x, s.y)
    peak = cluster.gpu.bf16_tflops * 1e12
    heads = cfg.heads / tp_heads
    # each ring step attends half a block (the other half is masked and skipped)
    block_attention = 2 * T * T * cfg.block.head_dim * heads / (peak * gemm_efficiency(T, cfg.block.head_dim, T, cal))
    forward = max(0.0, _totals_seconds(ring_forward, s, cluster, s.element_bytes, cal) - (s.cp - 1) * block_attention)
    backward = max(0.0, _totals_seconds(ring_backward, s, cluster, s.element_bytes, cal) - 2 * (s.cp - 1) * block_attention)
    return forward + backward


def step_time(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration = Calibration(),
              framework: str = "fourfold") -> StepTime:
    forward, dw = _layer_compute_seconds(cfg, s, cluster, cal, framework)
    per_layer = 3 * forward  # forward, then dX and dW GEMMs in backward
    if s.recompute == "full":
        per_layer += forward
    layers_per_stage = cfg.layers / s.pp
    comm_layer = _tensor_comm(cfg, s, cluster, cal, forward, dw, framework)
    if s.recompute == "full":
        comm_layer *= 1.5  # the forward's collectives again
    micro_compute = layers_per_stage * per_layer
    micro_comm = layers_per_stage * comm_layer
    # Embedding, LM head and loss: on the first and last stage, counted once per micro-batch.
    T = s.seq / s.cp * s.micro_batch / s.z
    y = s.y
    peak = cluster.gpu.bf16_tflops * 1e12
    head = 6 * T * cfg.hidden * cfg.vocab / (s.x * y if framework == "fourfold" else y)
    micro_compute += head / (peak * gemm_efficiency(T, cfg.hidden / s.x, cfg.vocab / y, cal))
    if framework == "fourfold":
        micro_comm += _totals_seconds(_head_totals(tuple(s.layout.sizes.items()), cfg.vocab, cfg.hidden, int(T)),
                                      s, cluster, s.element_bytes, cal)
    # Pipeline: P2P of each micro-batch's activation shard in both directions, then the bubble.
    if s.pp > 1:
        shard = T * cfg.hidden / (s.x * s.y if framework == "fourfold" else s.y)
        micro_comm += comm_seconds([Collective("pp", "send", int(shard))] * 2, s, cluster, s.element_bytes, cal)
    if s.cp > 1:
        micro_comm += layers_per_stage * _ring_attention_exposed(cfg, s, cluster, cal, framework)
    m = s.microbatches
    compute, exposed = m * micro_compute, m * micro_comm
    bubble = (s.pp - 1) / s.virtual * (micro_compute + micro_comm)
    # Data-parallel gradients (fp32) over dp*cp: reduce-scatter + all-gather of the parameters.
    matrices, vectors = layer_params(cfg)
    tp = s.x * s.y * s.z if framework == "fourfold" else s.y
    params_rank = layers_per_stage * (matrices + vectors) / tp + cfg.hidden * cfg.vocab / tp
    g = s.dp * s.cp
    dp_comm = 0.0
    if g > 1:
        dims = ("dp", "cp")
        bw = group_bandwidth(s, cluster, dims) * cal.bandwidth_factor
        reduce = float(bytes_sent("reduce_scatter", g, 4 * params_rank)) / bw
        gather = float(bytes_sent("all_gather", g, s.element_bytes * params_rank)) / bw
        # Both runtimes launch each gradient bucket as soon as it is final in the last
        # micro-batch's backward (fourfold's GradientSync, Megatron's overlap_grad_reduce), so the
        # reduce-scatter hides behind that backward; the parameter all-gather follows the update.
        dp_comm = max(0.0, reduce - micro_compute * 2 / 3) + gather
    optimizer = 16 * params_rank / g / (cluster.gpu.hbm_tbs * 1e12)
    flops = model_flops_per_token(cfg, s.seq) * s.global_batch * s.seq / s.world_size
    return StepTime(compute, exposed, bubble, dp_comm, optimizer, flops)
