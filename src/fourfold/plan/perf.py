"""Time of one training step: compute + exposed communication + pipeline bubble + optimizer.

Communication volumes come from `fourfold.spec.volumes`, the functions the runtime's ledger is
tested against; each collective runs at the bandwidth its group gets under the placement order.
A mixture's expert-parallel exchanges (all-to-alls over the ep group) are priced by the share of
each rank's rows that leaves its node (`_all_to_all_figures`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from fourfold.models.config import ModelConfig
from fourfold.plan.routing import (
    exchanged_rows,
    expert_params,
    expert_tokens,
    local_routing,
    replicated_params,
    routed_tokens,
)
from fourfold.spec.blockspec import LINEAR_KINDS, attention_chunks, block_plan
from fourfold.spec.counts import flops_per_token as model_flops_per_token
from fourfold.spec.counts import layer_params
from fourfold.spec.hardware import Cluster
from fourfold.spec.job import Job, rank_layers
from fourfold.spec.layout import Layout
from fourfold.spec.rules import padded_vocab
from fourfold.spec.volumes import (
    Collective,
    block_passes,
    bytes_sent,
    embedding_passes,
    head_passes,
    linear_passes,
    ring_attention_passes,
    tied_copy_sends,
)


@dataclass(frozen=True)
class Profile:
    """Hardware constants fitted to runs on one cluster (`Cluster.name`): they apply to that cluster
    only; any other keeps its preset's measured defaults (`fourfold.spec.hardware`)."""

    cluster: str
    efficiency_max: float  # best fraction of peak a large bf16 GEMM reaches
    efficiency_half: float  # smallest GEMM dimension at which a GEMM runs at half of that
    intra_node_efficiency: float  # collective bus bandwidth / the preset's link peak, inside a node
    inter_node_efficiency: float  # the same across nodes


# The hardware profiles of the shipped runs' clusters, fitted with the defaults below.
FITTED_A100 = Profile("dgx-a100", efficiency_max=0.7898, efficiency_half=188.6, intra_node_efficiency=1.0,
                      inter_node_efficiency=0.3)
FITTED_H100 = Profile("dgx-h100", efficiency_max=0.7509, efficiency_half=184.7, intra_node_efficiency=1.0,
                      inter_node_efficiency=1.0)
# every B200 run is FP8: its GEMM figures stand for FP8's too (fp8_speedup is at its bound)
FITTED_B200 = Profile("dgx-b200", efficiency_max=0.9561, efficiency_half=1701, intra_node_efficiency=1.0,
                      inter_node_efficiency=1.0)


@dataclass(frozen=True)
class Calibration:
    """The step-time model's fitted constants (`fourfold calibrate`, `--calibrate FILE.json`): those
    of software (the same on every cluster), and a `Profile` of hardware constants per cluster the
    runs were measured on. Each means something physical, so that a fit carries over."""

    # Defaults: fitted to the published Megatron-LM runs (`python benchmarks/planner_calibration.py`,
    # docs/planner.md "Calibration"); UNCALIBRATED below holds the guesses they replace.
    attention_ratio: float = 0.367  # flash attention's best rate as a fraction of the GEMMs' best (efficiency_max)
    attention_half: float = 512  # keys a query attends in one kernel call at which attention runs at half that rate
    fp8_speedup: float = 1.8  # an FP8 GEMM's speed over a bf16 GEMM of the same shape (runs with FP8 linears)
    ring_overlap: float = 1.0  # fraction of ring attention's traffic that can hide behind block attention
    dp_overlap: float = 1.0  # fraction of the data-parallel reduce-scatter that hides behind the last backward
    param_gather_overlap: float = 0.0  # fraction of the parameter all-gather that hides behind the first forward
    layer_overhead_us: float = 952.3  # fixed cost of a layer's forward and backward on a micro-batch (launches)
    micro_batch_overhead_us: float = 10000  # fixed cost of a micro-batch on a pipeline rank (host side: schedule, loss)
    latency_us: float | None = None  # cost of one collective step (None: the cluster preset's)
    cv_error: float | None = 0.0980  # cross-validated mean error of a step time (fraction): leave one source out
    # the same by kind of configuration (cp > 1, else pp > 1, else tensor parallel, else data only):
    # the band within which `plan` cannot tell a candidate of that kind from the fastest
    cv_errors: tuple[tuple[str, float], ...] = (("cp", 0.0698), ("dp", 0.0950), ("pp", 0.1129), ("tp", 0.0092))
    profiles: tuple[Profile, ...] = (FITTED_A100, FITTED_B200, FITTED_H100)  # the clusters the fit was measured on

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """From a JSON file of constants (`fourfold calibrate` writes one; its "fit" record is left
        aside); constants it leaves out keep their defaults."""
        data = json.loads(Path(path).read_text())
        data.pop("fit", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if "bandwidth_factor" in unknown:
            raise ValueError(f"{path}: bandwidth_factor is now two constants: give its value as intra_node_efficiency "
                             f"and inter_node_efficiency, or write the file again with `fourfold calibrate`")
        hardware = sorted(set(unknown) & {f.name for f in dataclasses.fields(Profile)})
        if hardware:
            raise ValueError(f"{path}: {', '.join(hardware)} belong to the cluster they were measured on: give them in "
                             f"`profiles` with the cluster's name, or write the file again with `fourfold calibrate`")
        if unknown:
            raise ValueError(f"{path}: unknown constants {', '.join(unknown)}; the constants are "
                             f"{', '.join(sorted(known))} (`fourfold calibrate` writes them)")
        profiles = tuple(Profile(**p) for p in data.pop("profiles", []))
        errors = tuple((k, float(v)) for k, v in data.pop("cv_errors", []))
        return cls(**data, profiles=profiles, cv_errors=errors)

    def error_band(self, kind: str) -> float:
        """The cross-validated error of a configuration of `kind` (cp, pp, tp, dp), else the overall one."""
        return dict(self.cv_errors).get(kind, self.cv_error or 0.0)

    def profile(self, cluster: Cluster) -> Profile:
        """The hardware constants of `cluster`: fitted on it, else its preset's measured defaults."""
        for p in self.profiles:
            if p.cluster == cluster.name:
                return p
        return Profile(cluster.name, cluster.gpu.gemm_efficiency, cluster.gpu.ridge, cluster.intra_node_efficiency,
                       cluster.inter_node_efficiency)


@dataclass(frozen=True)
class Constants:
    """Every constant of one step-time evaluation: the calibration's software constants and its
    hardware constants for the cluster (`constants`)."""

    efficiency_max: float
    efficiency_half: float
    attention_ratio: float
    attention_half: float
    fp8_speedup: float
    intra_node_efficiency: float
    inter_node_efficiency: float
    ring_overlap: float
    dp_overlap: float
    param_gather_overlap: float
    layer_overhead_us: float
    micro_batch_overhead_us: float
    latency_us: float


@functools.lru_cache(maxsize=1024)
def constants(cal: Calibration, cluster: Cluster) -> Constants:
    p = cal.profile(cluster)
    return Constants(p.efficiency_max, p.efficiency_half, cal.attention_ratio, cal.attention_half, cal.fp8_speedup,
                     p.intra_node_efficiency, p.inter_node_efficiency, cal.ring_overlap, cal.dp_overlap,
                     cal.param_gather_overlap, cal.layer_overhead_us, cal.micro_batch_overhead_us,
                     cluster.latency_us if cal.latency_us is None else cal.latency_us)


# The guesses the model had before any fit (docs/planner.md's "uncalibrated" model): no overheads,
# every overlap perfect, the presets' measured hardware defaults.
UNCALIBRATED = Calibration(attention_ratio=1.0, attention_half=0, fp8_speedup=2.0, ring_overlap=1.0, dp_overlap=1.0,
                           param_gather_overlap=0.0, layer_overhead_us=0.0, micro_batch_overhead_us=0.0,
                           cv_error=None, profiles=())


def gemm_efficiency(m: float, n: float, k: float, cal: Constants) -> float:
    """Small local GEMMs after heavy sharding run far below peak."""
    smallest = min(m, n, k)
    return cal.efficiency_max * smallest / (smallest + cal.efficiency_half)


@dataclass(frozen=True)
class RunTraits:
    """What a measured run's software did that fourfold's plans do not: the planner plans flash
    attention, bf16 linears and the ring of `parallel.context`; measured runs tell what they ran."""

    flash_attention: bool = True  # False: runs that predate it (Megatron-LM 2021)
    fp8: bool = False  # FP8 linear layers (Transformer Engine, torchao's Float8)
    cp_comm: str = "p2p"  # context parallelism's exchange: the ring ("p2p") or an all-gather of K and V

    def __post_init__(self) -> None:
        if self.cp_comm not in CP_COMMS:
            raise ValueError(f"cp_comm {self.cp_comm!r}: give one of {', '.join(CP_COMMS)}")


CP_COMMS = ("p2p", "all_gather")  # Megatron-Core's cp_comm_type p2p and all_gather (Llama 3's); a2a is not priced


def attention_seconds(seq: int, cp: int, batch: float, heads: float, head_dim: int, peak_tflops: float,
                      cal: Constants, flash_attention: bool = True, gathered: bool = False) -> float:
    """Forward seconds of one layer's causal attention on one rank, for `batch` sequences of `seq`
    tokens split over `cp` ranks. Flash attention skips the masked tiles (half the pairs) and runs
    at `attention_ratio` of the GEMMs' best rate, lowered by the keys a query attends in one kernel
    call, k / (k + attention_half): each call pays its softmax rescaling and tile edges. cp = 1: one
    causal call, seq/2 keys a query on average. Ring attention (load-balanced: a rank holds chunks
    i and 2cp-1-i of c = seq/2cp tokens) runs cp calls of 2c^2 pairs each: its own chunks causally
    (c keys a query on average), about (cp-1)/2 steps of every local query against one chunk (c
    keys), and (cp-1)/2 of half the queries against two chunks (2c keys). `gathered`: K and V
    all-gathered first (Llama 3's context parallelism), each local chunk attends every earlier key
    in one call, seq/2 keys a query on average as without cp. Without flash attention
    (Megatron-LM 2021): every pair's score is computed (no tile is skipped) by batched GEMMs at
    their shape's efficiency."""
    pair = 4 * head_dim * heads * batch  # FLOPs of one (query, key) pair: QK^T and PV
    peak = peak_tflops * 1e12
    if not flash_attention:
        queries = seq / cp * batch
        return pair * seq / cp * seq / (peak * gemm_efficiency(queries, head_dim, seq, cal))
    rate = peak * cal.efficiency_max * cal.attention_ratio
    if gathered:
        return attention_seconds(seq, 1, batch, heads, head_dim, peak_tflops, cal) / cp
    c = seq / (2 * cp)

    def slowdown(keys: float) -> float:
        return (keys + cal.attention_half) / keys

    return pair * 2 * c * c * ((1 + (cp - 1) / 2) * slowdown(c) + (cp - 1) / 2 * slowdown(2 * c)) / rate


def group_bandwidth(layout: Layout, cluster: Cluster, dims: tuple[str, ...], cal: Calibration | None = None) -> float:
    """Bytes/s per GPU for a collective over `dims`: intra-node if the group fits in a node, else
    the node's NICs shared by the groups of this dim that cross the node boundary together; each
    at the calibrated fraction of the preset's figure (`cal`; None: the preset's own)."""
    if cal is None:
        return _bandwidth(layout, cluster, dims, 1.0, 1.0)
    k = constants(cal, cluster)
    return _bandwidth(layout, cluster, dims, k.intra_node_efficiency, k.inter_node_efficiency)


EXPERT_GROUPS = ("ep", "edp")  # expert parallelism's groups (`Grid.expert_group`): not dims of the layout


def group_ranks(layout: Layout, group: str | tuple[str, ...]) -> tuple[int, ...]:
    """Global ranks of rank 0's group: of dims, or an expert group (consecutive members of the dp*cp
    group for "ep", every ep-th for "edp"; `Layout`'s docstring). Every rank's group is placed alike."""
    dims = tuple(group.split("_")) if isinstance(group, str) else group
    if dims in (("ep",), ("edp",)):
        data = layout.group_ranks(("dp", "cp"), 0)
        return tuple(data[: layout.ep] if dims == ("ep",) else data[:: layout.ep])
    return tuple(layout.group_ranks(dims, 0))


def group_size(layout: Layout, group: str | tuple[str, ...]) -> int:
    dims = tuple(group.split("_")) if isinstance(group, str) else group
    if dims in (("ep",), ("edp",)):
        return layout.ep if dims == ("ep",) else layout.dp * layout.cp // layout.ep
    return layout.size(dims)


@functools.lru_cache(maxsize=65536)  # the search asks the same question for many candidates
def _bandwidth(layout, cluster: Cluster, dims: tuple[str, ...], intra_efficiency: float,
               inter_efficiency: float) -> float:
    if layout.ep == 1 and dims == ("edp",):  # without expert parallelism an expert's replicas are dp*cp
        dims = ("dp", "cp")
    if dims not in (("ep",), ("edp",)):  # dims of size 1 add no ranks: they must not set the placement
        dims = tuple(d for d in dims if layout.size(d) > 1)
    if not dims or (layout.ep == 1 and dims == ("ep",)):  # a group of one rank
        stride = span = 1
    elif dims in (("ep",), ("edp",)):  # not a dim: from its ranks (nearest members' distance, the span)
        ranks = group_ranks(layout, dims)
        stride = min((b - a for a, b in zip(ranks, ranks[1:])), default=1)
        span = ranks[-1] - ranks[0] + stride
    else:
        inner = min(dims, key=layout.order.index)
        stride = layout.stride(inner)
        span = stride * layout.size(dims) if len(dims) == 1 else max(layout.stride(d) * layout.size(d) for d in dims)
    intra = cluster.intra_node_gbs * intra_efficiency
    if span <= cluster.gpus_per_node:
        gbs = intra
    else:
        gbs = cluster.inter_node_gbs * inter_efficiency * cluster.gpus_per_node / min(stride, cluster.gpus_per_node)
        gbs = min(gbs, intra)
    return gbs * 1e9


def comm_seconds(collectives: list[Collective], s: Job, cluster: Cluster, element_size: int, cal: Constants) -> float:
    """Seconds of these collectives run one after another: volume over the group's bandwidth, plus
    a latency per ring step."""
    return _totals_seconds(_totals(collectives), s, cluster, element_size, cal)


def _totals(collectives: list[Collective]) -> tuple[tuple[str, str, Collective, int, int], ...]:
    """(group, op, width, elements, count): collectives of a kind summed (the volume is linear);
    `width`: a collective of one element whose `element_bytes` gives the kind's element size."""
    totals: dict[tuple[str, str, bool, bool], list[int]] = {}
    for c in collectives:
        entry = totals.setdefault((c.group, c.op, c.wide, c.integer), [0, 0])
        entry[0] += c.numel
        entry[1] += 1
    return tuple((group, op, _width(wide, integer), numel, count)
                 for (group, op, wide, integer), (numel, count) in totals.items())


@functools.lru_cache(maxsize=None)
def _width(wide: bool, integer: bool) -> Collective:
    return Collective("", "", 1, wide=wide, integer=integer)


A2A_OPS = ("all_to_all", "all_to_all_v")


def _totals_seconds(totals, s: Job, cluster: Cluster, element_size: int, cal: Constants) -> float:
    seconds = 0.0
    latency = cal.latency_us * 1e-6
    for group, op, width, numel, count in totals:
        figures = _all_to_all_figures if op in A2A_OPS else _group_figures
        g, bandwidth = figures(s.layout, cluster, group, cal.intra_node_efficiency, cal.inter_node_efficiency)
        steps = 1 if op == "send" else 2 * (g - 1) if op == "all_reduce" else (g - 1)
        seconds += (_per_byte(op, g) * numel * width.element_bytes(element_size) / bandwidth
                    + count * steps * latency)
    return seconds


@functools.lru_cache(maxsize=262144)
def _group_figures(layout, cluster: Cluster, group: str, intra_efficiency: float,
                   inter_efficiency: float) -> tuple[int, float]:
    """(size, bytes/s per GPU) of a group named like a ledger entry ("x", "dp_cp", "ep")."""
    dims = tuple(group.split("_"))
    return group_size(layout, dims), _bandwidth(layout, cluster, dims, intra_efficiency, inter_efficiency)


@functools.lru_cache(maxsize=65536)
def _all_to_all_figures(layout, cluster: Cluster, group: str, intra_efficiency: float,
                        inter_efficiency: float) -> tuple[int, float]:
    """(size, bytes/s per GPU of the bytes a rank sends to the others) of an all-to-all over `group`.
    Not a ring: each rank sends to every other member directly (NCCL's all-to-all is g-1 concurrent
    sends and receives; nccl-tests' bus bandwidth of it is (g-1)/g of the algorithm bandwidth, the
    share of a rank's message that leaves it). Of what a rank sends to the others, the share bound
    for members on other nodes, (g - m)/(g - 1) with m members on its node, goes through the node's
    NICs, and every rank of the node sends at once (every rank is in an expert group), so each
    gets its own NIC bandwidth; the rest rides NVLink, concurrently: the slower of the two paces it
    (DeepSpeed-MoE, Rajbhandari et al. 2022, and Megatron-Core's MoE guide: the exchange across nodes
    is bound by the inter-node links)."""
    ranks = group_ranks(layout, group)
    g = len(ranks)
    intra = cluster.intra_node_gbs * intra_efficiency * 1e9
    inter = min(cluster.inter_node_gbs * inter_efficiency * 1e9, intra)
    if g == 1:
        return 1, intra
    node = ranks[0] // cluster.gpus_per_node
    on_node = sum(1 for r in ranks if r // cluster.gpus_per_node == node)
    off = (g - on_node) / (g - 1)
    return g, 1 / max(off / inter, (1 - off) / intra)


def _within_replica(s: Job) -> tuple[tuple[str, int], ...]:
    """The grid sizes a layer's, the head's and the ring's collectives depend on (dp and pp set to
    1: they only shape the groups of other collectives; ep: a mixture's exchange), as the caches
    below are keyed."""
    return (*((d, 1 if d in ("dp", "pp") else n) for d, n in s.layout.sizes.items()), ("ep", s.layout.ep))


@functools.lru_cache(maxsize=65536)  # independent of the placement order and of recompute
def _layer_totals(block, sizes: tuple[tuple[str, int], ...], batch: int, seq: int, seq_parallel: bool,
                  keep_inputs: bool):
    """One layer's collectives, summed: (forward activations outside cp and z, backward ones, the z
    weight traffic)."""
    grid = dict(sizes)
    tokens, ep = batch * seq, grid["ep"]
    # a mixture: routing.py's assumption, on expert-group rank 0 (the busiest)
    routed = local_routing(block, tokens, ep) if block.moe else ()
    exchanged = exchanged_rows(block, tokens, ep) if block.moe else (0, 0)
    passes = block_passes(block, grid, batch, seq, seq_parallel=seq_parallel, keep_inputs=keep_inputs,
                          routed=routed, exchanged=exchanged)
    return (_totals([c for c in passes.forward if c.group not in ("cp", "z")]),  # ring attention: separately
            _totals([c for c in passes.backward if c.group not in ("cp", "z")]),
            _totals([c for c in passes.all() if c.group == "z"]))


def expert_exchange_bytes(cfg: ModelConfig, s: Job) -> dict[str, float]:
    """Bytes rank 0 sends to the other ranks of its expert group in one step, by ledger op
    ("all_to_all": the routing counts, "all_to_all_v": the rows and their gradients), as the step
    time prices them: one layer's collectives (`_layer_totals`, at the routing of `routing.py`),
    the forward's again under full recompute, times the layers of the most loaded pipeline rank
    and the micro-batches. What the runtime's ledger records for ("ep", op)."""
    if not cfg.block.moe or s.layout.ep == 1:
        return {}
    forward, backward, _ = _layer_totals(cfg.block, _within_replica(s), int(s.micro_batch / s.z), int(s.seq / s.cp),
                                         s.seq_parallel, s.keep_gathered_inputs)
    out: dict[str, float] = {}
    for totals, times in ((forward, 2 if s.recompute == "full" else 1), (backward, 1)):
        for group, op, width, numel, _ in totals:
            if group == "ep":
                sent = _per_byte(op, s.layout.ep) * numel * width.element_bytes(s.element_bytes)
                out[op] = out.get(op, 0.0) + times * sent
    layers = max(rank_layers(cfg.layers, s.pp, s.virtual, s.stage_layers))
    return {op: sent * layers * s.microbatches for op, sent in out.items()}


@functools.lru_cache(maxsize=65536)
def _gemm_seconds(tokens: float, k: float, n: float, peak_tflops: float, cal: Constants) -> float:
    return 2 * tokens * k * n / (peak_tflops * 1e12 * gemm_efficiency(tokens, k, n, cal))


@functools.lru_cache(maxsize=65536)
def _overlapped(block, sizes: tuple[tuple[str, int], ...], batch: int, seq: int, seq_parallel: bool,
                keep_inputs: bool, peak_tflops: float, cal: Constants):
    """What each linear layer's backward hides, as `parallel.tensor.linear` runs it: the re-gather of
    its input over the out-dim is in flight while dY is gathered and the dX GEMM runs, and the
    input gradient's all-reduce (or reduce-scatter) over the out-dim while the dW GEMM runs; the
    gather of dY over the in-dim waits. (GEMM seconds, re-gather collectives, input-gradient
    collectives) per layer, from the volume functions the runtime's ledger is tested against."""
    grid = dict(sizes)
    plan = block_plan(block, grid["x"], grid["y"], seq_parallel=seq_parallel)
    tokens = batch * seq
    layers = [(plan.qkv, tokens), (plan.out, tokens)]
    if block.moe:
        layers += [(plan.shared_up, tokens), (plan.shared_down, tokens)] if plan.shared_up is not None else []
        layers += [(layer, n) for n in local_routing(block, tokens, grid["ep"]) for layer in (plan.up, plan.down)]
    else:
        layers += [(plan.up, tokens), (plan.down, tokens)]
    out = []
    for layer, n in layers:
        i, o = LINEAR_KINDS[layer.kind]
        passes = linear_passes(grid, layer.kind, layer.in_features, layer.out_features, n,
                               reduction=layer.reduction, input_gather=layer.input_gather, keep_input=keep_inputs)
        gemm = _gemm_seconds(n, layer.in_features / grid[i], layer.out_features / grid[o], peak_tflops, cal)
        out.append((gemm, _totals([c for c in passes.backward if c.group == o and c.op == "all_gather"]),
                    _totals([c for c in passes.backward if c.group == o and c.op != "all_gather"])))
    return tuple(out)


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
    tied_embedding: float = 0.0  # a tied table over pipeline stages: its sends (fourfold), its all-reduce (megatron)

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.dp_comm + self.optimizer + self.tied_embedding

    def breakdown(self) -> dict[str, float]:
        return {"compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble,
                "dp_comm": self.dp_comm, "optimizer": self.optimizer, "tied_embedding": self.tied_embedding}


@functools.lru_cache(maxsize=4096)
def _plan(block, x: int, y: int):
    """The block plan's shapes (sequence parallelism changes collectives, not GEMMs)."""
    return block_plan(block, x, y, seq_parallel=False)


@functools.lru_cache(maxsize=65536)  # many grids share a replica's shapes (dp and pp do not change them)
def _layer_compute_cached(block, x: int, y: int, seq: int, cp: int, batch: float, peak_tflops: float,
                          cal: Constants, ep: int = 1, linear_tflops: float = 0.0,
                          traits: RunTraits = RunTraits()) -> tuple[float, float]:
    """(forward seconds, seconds of the dW GEMMs) of one layer for one micro-batch on one rank;
    x = 1 for the megatron profile's 1D tensor parallelism; a mixture's experts/ep experts on the
    rows the ep ranks send them. `linear_tflops`: the linear layers' peak (FP8's speed-up; 0: bf16)."""
    T = seq / cp * batch
    peak = (linear_tflops or peak_tflops) * 1e12
    d = block.head_dim
    plan = _plan(block, x, y)
    forward = 0.0
    for layer in plan.linears:  # each rank's block of each GEMM (z only splits the stored weights)
        k_local = layer.in_features / (x if layer.in_dim == "x" else y)
        n_local = layer.out_features / (x if layer.out_dim == "x" else y)
        # a mixture's experts: each on its share of the routed tokens, one after another (routing.py);
        # with expert parallelism, experts/ep of them, each on its share of the ep ranks' tokens
        tokens, times = ((expert_tokens(block, T * ep), block.experts // ep)
                         if block.moe and layer in (plan.up, plan.down) else (T, 1))
        forward += times * 2 * tokens * k_local * n_local / (peak * gemm_efficiency(tokens, k_local, n_local, cal))
    if block.moe:  # the router's GEMM on the stream's features of this x rank (the shared gate's is a GEMV)
        forward += 2 * T * block.hidden / x * block.experts / (
            peak * gemm_efficiency(T, block.hidden / x, block.experts, cal))
    # the local queries against the whole sequence (ring attention brings the other chunks' keys)
    attention = attention_seconds(seq, cp, batch, plan.local_heads, d, peak_tflops, cal, traits.flash_attention,
                                  traits.cp_comm == "all_gather")
    return forward + attention, forward


@functools.lru_cache(maxsize=65536)
def _head_totals(sizes: tuple[tuple[str, int], ...], vocab: int, hidden: int, tokens: int):
    """The embedding's and the LM head's collectives for one micro-batch, summed."""
    grid = dict(sizes)
    return _totals(embedding_passes(grid, vocab, hidden, tokens).all() + head_passes(grid, hidden, vocab, tokens).all())


@functools.lru_cache(maxsize=65536)
def _ring_totals(block, sizes: tuple[tuple[str, int], ...], batch: int, seq: int):
    ring = ring_attention_passes(block, dict(sizes), batch, seq)
    return _totals(ring.forward), _totals(ring.backward)


def _tensor_comm(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, forward_seconds: float,
                 framework: str, gemm_tflops: float) -> float:
    """Exposed tensor-parallel communication of one layer for one micro-batch (forward, backward,
    and the forward again under full recompute); `gemm_tflops`: the linear layers' peak."""
    b = s.element_bytes  # bf16 on GPUs
    if framework == "megatron":
        return _megatron_tensor_comm(cfg, s, cluster, cal, gemm_tflops)
    sizes, batch, seq = _within_replica(s), int(s.micro_batch / s.z), int(s.seq / s.cp)
    forward, backward, weights = _layer_totals(cfg.block, sizes, batch, seq, s.seq_parallel, s.keep_gathered_inputs)
    passes = 2 if s.recompute == "full" else 1  # the forward's collectives again
    exposed = passes * _totals_seconds(forward, s, cluster, b, cal) + _totals_seconds(backward, s, cluster, b, cal)
    # Each linear's input re-gather hides behind its dX GEMM, its input-gradient reduction behind
    # its dW GEMM (the runtime's overlap; both GEMMs take the forward GEMM's time).
    for gemm, regather, reduction in _overlapped(cfg.block, sizes, batch, seq, s.seq_parallel,
                                                 s.keep_gathered_inputs, gemm_tflops, cal):
        exposed -= (min(gemm, _totals_seconds(regather, s, cluster, b, cal))
                    + min(gemm, _totals_seconds(reduction, s, cluster, b, cal)))
    # z: the weight all-gathers are prefetched one GEMM ahead and the dW reduce-scatters deferred
    # to the next one, so they hide behind the layer's compute (3x forward) up to its length.
    weights = _totals_seconds(weights, s, cluster, b, cal)
    return exposed + max(0.0, weights - 3 * forward_seconds)


def _megatron_tensor_comm(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, gemm_tflops: float) -> float:
    """Megatron-LM's 1D tensor parallelism. With sequence parallelism each sublayer all-gathers its
    input and reduce-scatters its output in forward, and the row-parallel linear all-gathers its
    output gradient in backward, exposed; the column-parallel linear's backward re-gathers its input
    (for the weight gradient) while its dX GEMM runs and reduce-scatters the input gradient while
    its dW GEMM runs (Megatron's LinearWithGradAccumulationAndAsyncCommunication). Without sequence
    parallelism: an all-reduce in forward, and one in backward behind the dW GEMM. A mixture's
    experts (without a shared one) move their tokens with the all-to-all dispatcher instead
    (`_megatron_dispatch`), exposed."""
    T = s.seq / s.cp * s.micro_batch / s.z
    dispatched = cfg.block.moe and not cfg.block.shared_ffn
    sublayers = 1 if dispatched else 2  # attention, and a dense MLP
    forward, backward, (regather, reduction) = _megatron_totals(int(T) * cfg.hidden, s.seq_parallel, sublayers)
    seconds = functools.partial(_totals_seconds, s=s, cluster=cluster, element_size=s.element_bytes, cal=cal)
    passes = 2 if s.recompute == "full" else 1
    exposed = passes * seconds(forward) + seconds(backward) + sublayers * (seconds(regather) + seconds(reduction))
    plan = _plan(cfg.block, 1, s.y)
    for layer in (plan.qkv,) if dispatched else (plan.qkv, plan.up):  # the column-parallel layers
        gemm = _gemm_seconds(T, layer.in_features, layer.out_features / s.y, gemm_tflops, cal)
        exposed -= min(gemm, seconds(regather)) + min(gemm, seconds(reduction))
    if dispatched:  # the dispatch and its backward (the same collectives), the forward's again under full recompute
        exposed += (passes + 1) * seconds(_megatron_dispatch(int(T), cfg.hidden, cfg.block.top_k, s.y, s.layout.ep))
    return exposed


@functools.lru_cache(maxsize=4096)
def _megatron_dispatch(tokens: int, hidden: int, top_k: int, tp: int, ep: int):
    """The collectives of Megatron-Core's all-to-all token dispatcher (MoEAlltoAllTokenDispatcher,
    0.8) around one mixture layer's experts, forward: the stream from sequence- to hidden-split over
    tp (an all-to-all of a rank's tokens/tp x hidden), each (token, expert) choice's row of hidden/tp
    to its expert's ep rank (an all-to-all), the rows all-gathered over tp (the experts are split
    over tp too), then back: a reduce-scatter over tp, an all-to-all over ep, an all-to-all to
    sequence-split. Balanced routing: every rank sends and receives top_k x tokens rows."""
    rows = tokens * top_k
    out = []
    if tp > 1:
        out += [Collective("y", "all_to_all", tokens * hidden // tp)] * 2
        out += [Collective("y", "all_gather", rows * hidden), Collective("y", "reduce_scatter", rows * hidden)]
    if ep > 1:
        out += [Collective("ep", "all_to_all", rows * hidden // tp)] * 2
    return _totals(out)


@functools.lru_cache(maxsize=4096)
def _megatron_totals(elements: int, seq_parallel: bool, sublayers: int = 2):
    """Megatron's tensor-parallel collectives of `sublayers` of one layer (attention and the MLP) on
    activations of `elements`: (forward, exposed backward, (the re-gather, the input-gradient
    reduction) of one column-parallel linear)."""
    if seq_parallel:
        gather, scatter = Collective("y", "all_gather", elements), Collective("y", "reduce_scatter", elements)
        return (_totals([gather, scatter] * sublayers), _totals([gather] * sublayers),
                (_totals([gather]), _totals([scatter])))
    reduce = Collective("y", "all_reduce", elements)
    return _totals([reduce] * sublayers), (), ((), _totals([reduce]))


def _ring_attention_exposed(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, framework: str,
                            cp_comm: str = "p2p") -> float:
    """Ring attention over cp (the runtime's volumes): each of the cp-1 forward steps hides its
    K, V transfer behind one block attention (the next block is in flight while the current one
    is attended: `parallel.context`, and TransformerEngine's ring for Megatron), backward behind
    two (its dQ and dK/dV GEMMs); `cal.ring_overlap` (1: both runtimes) of the traffic can hide.
    `cp_comm` "all_gather" (Llama 3, Megatron-Core's cp_comm_type all_gather): K and V all-gathered
    before attention, again in backward, and dK, dV (fp32) reduce-scattered after it, exposed."""
    if cp_comm == "all_gather":
        return _gathered_kv_seconds(cfg, s, cluster, cal, framework)
    ring_forward, ring_backward = _ring_totals(cfg.block, _within_replica(s), int(s.micro_batch / s.z),
                                               int(s.seq / s.cp))
    tp_heads = s.y if framework == "megatron" else attention_chunks(cfg.block, s.x, s.y)
    # one ring step's attention: the rank's attention over its cp steps, on average
    block_attention = attention_seconds(s.seq, s.cp, s.micro_batch / s.z, cfg.heads / tp_heads, cfg.block.head_dim,
                                        cluster.gpu.bf16_tflops, cal) / s.cp
    forward = _exposed(_totals_seconds(ring_forward, s, cluster, s.element_bytes, cal), (s.cp - 1) * block_attention,
                       cal.ring_overlap)
    backward = _exposed(_totals_seconds(ring_backward, s, cluster, s.element_bytes, cal),
                        2 * (s.cp - 1) * block_attention, cal.ring_overlap)
    return forward + backward


def _gathered_kv_seconds(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, framework: str) -> float:
    kv_heads = cfg.kv_heads // (s.y if framework == "megatron" else attention_chunks(cfg.block, s.x, s.y))
    whole = int(s.micro_batch / s.z) * kv_heads * s.seq * cfg.block.head_dim  # K (or V) of the whole sequence
    gathers = [Collective("cp", "all_gather", whole)] * 2  # K and V
    scatters = [Collective("cp", "reduce_scatter", whole, wide=True)] * 2  # dK and dV
    passes = 2 if s.recompute == "full" else 1
    return comm_seconds(gathers * (passes + 1) + scatters, s, cluster, s.element_bytes, cal)


def _exposed(traffic: float, compute: float, overlap: float) -> float:
    """Seconds of `traffic` left after the fraction `overlap` of it hides behind `compute`."""
    return (1 - overlap) * traffic + max(0.0, overlap * traffic - compute)


@dataclass(frozen=True)
class _Compute:
    """The part of a step's time no placement order or collective changes."""

    forward: float  # one layer's forward, one micro-batch
    dw: float  # its weight-gradient GEMMs
    layer: float  # one layer's forward and backward (and recompute), with the fixed overhead
    head: float  # the LM head and loss of one micro-batch, on the last pipeline rank
    ranks: tuple[int, ...]  # layers of each pipeline rank
    optimizer: float
    micro_batch_overhead: float

    def rank_seconds(self, r: int, layer_comm: float = 0.0) -> float:
        """One micro-batch on pipeline rank `r`."""
        return (self.ranks[r] * (self.layer + layer_comm) + (self.head if r == len(self.ranks) - 1 else 0.0)
                + self.micro_batch_overhead)


def linear_tflops(cluster: Cluster, cal: Constants, fp8: bool) -> float:
    """The peak the linear layers' GEMMs are priced at: bf16's, or FP8's speed-up over it."""
    if fp8 and not cluster.gpu.fp8_tflops:
        raise ValueError(f"{cluster.gpu.name} has no FP8 tensor cores: a run with FP8 linears needs a Hopper or "
                         f"Blackwell GPU preset")
    return cluster.gpu.bf16_tflops * (cal.fp8_speedup if fp8 else 1.0)


def _compute(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, framework: str,
             traits: RunTraits = RunTraits()) -> _Compute:
    forward, dw = _layer_compute_cached(cfg.block, s.x if framework == "fourfold" else 1, s.y, s.seq, s.cp,
                                        s.micro_batch / s.z, cluster.gpu.bf16_tflops, cal, s.layout.ep,
                                        linear_tflops(cluster, cal, traits.fp8), traits)
    T = s.seq / s.cp * s.micro_batch / s.z
    traffic = _elementwise_traffic(cfg, s, T, framework, traits.fp8)
    if not traits.flash_attention:  # attention's score matrices through HBM (Dao et al. 2022, standard attention)
        traffic += _score_traffic(cfg, s, T, framework)
    forward += traffic / (cluster.gpu.hbm_tbs * 1e12)
    per_layer = 3 * forward  # forward, then dX and dW GEMMs in backward
    if s.recompute == "full":
        per_layer += forward
    vocab = padded_vocab(cfg.vocab, s.y) if framework == "fourfold" else cfg.vocab  # the head's GEMM columns
    head = 6 * T * cfg.hidden * vocab / (s.x * s.y if framework == "fourfold" else s.y)
    head /= cluster.gpu.bf16_tflops * 1e12 * gemm_efficiency(T, cfg.hidden / s.x, vocab / s.y, cal)
    ranks = rank_layers(cfg.layers, s.pp, s.virtual, s.stage_layers)
    dense, experts = _params_per_rank(cfg, s, ranks, framework)
    # ZeRO-1: the dense parameters' shard of 1/(dp*cp), the experts' of 1/(dp*cp/ep)
    optimizer = 16 * (dense + experts * s.layout.ep) / (s.dp * s.cp) / (cluster.gpu.hbm_tbs * 1e12)
    return _Compute(forward, dw, per_layer + cal.layer_overhead_us * 1e-6, head, ranks, optimizer,
                    cal.micro_batch_overhead_us * 1e-6)


def _elementwise_traffic(cfg: ModelConfig, s: Job, tokens: float, framework: str, fp8: bool = False) -> float:
    """Bytes of one layer's forward elementwise work, bound by HBM bandwidth (roofline): each op
    reads its inputs and writes its output once, in the job's precision: two norms (2h a token)
    and two residual adds (3h) on the residual stream (split over the tensor group under sequence
    parallelism), the MLP's activation (3F gated, 2F else) on the local F; with FP8 linears, each
    linear's input cast to FP8 (read in the job's precision, written in one byte: 3h + F a token
    on the local features, as Transformer Engine quantises them)."""
    tp = s.x * s.y if framework == "fourfold" else s.y
    stream = 10 * cfg.hidden / (tp if s.seq_parallel else 1)
    b = cfg.block
    if b.moe:  # the activation on the top_k experts' features (and the shared expert's); each expert's
        # weighted output added into the sum (read, read, write) on the features of this x rank
        activation = 3 * (routed_tokens(b, cfg.ffn) + b.shared_ffn) / tp
        activation += 3 * routed_tokens(b, cfg.hidden) / (s.x if framework == "fourfold" else 1)
    else:
        activation = (3 if b.gated else 2) * cfg.ffn / tp
    cast = (s.element_bytes + 1) * (3 * cfg.hidden + cfg.ffn) / tp if fp8 else 0.0
    return tokens * (s.element_bytes * (stream + activation) + cast)


def _score_traffic(cfg: ModelConfig, s: Job, tokens: float, framework: str) -> float:
    """Bytes of one layer's forward attention without flash attention: the local heads' scores
    S = QK^T and probabilities P = softmax(S), each written to HBM and read back once;
    backward moves twice that (its dP and dS), so it scales with the forward like the GEMMs."""
    heads = cfg.heads / (s.y if framework == "megatron" else attention_chunks(cfg.block, s.x, s.y))
    return 4 * s.element_bytes * heads * tokens * s.seq


def _params_per_rank(cfg: ModelConfig, s: Job, ranks: tuple[int, ...], framework: str) -> tuple[float, float]:
    """(dense parameters, expert parameters) held by a rank of the most loaded pipeline stage: a
    mixture's experts split over the ep ranks too (their gradients reduced over dp*cp/ep replicas)."""
    matrices, vectors = layer_params(cfg)
    tp = s.x * s.y * s.z if framework == "fourfold" else s.y
    replicated = replicated_params(cfg.block)  # a mixture's router and shared gate: over x only (fourfold)
    experts = expert_params(cfg.block)
    held = replicated / (s.x if framework == "fourfold" else 1) - replicated / tp
    dense = max(ranks) * ((matrices - experts + vectors) / tp + held) + cfg.hidden * cfg.vocab / tp
    return dense, max(ranks) * experts / (tp * s.layout.ep)


def compute_bound(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration = Calibration(),
                  framework: str = "fourfold") -> float:
    """A lower bound of `step_time(...).total` for every placement order: the slowest pipeline
    rank's compute for every micro-batch and the bubble, and the optimizer (communication only
    adds). The search evaluates candidates in this order and stops where it exceeds what it keeps."""
    c = _compute(cfg, s, cluster, constants(cal, cluster), framework)
    slowest = max(c.rank_seconds(r) for r in range(len(c.ranks)))
    return (s.microbatches + (s.pp - 1) / s.virtual) * slowest + c.optimizer


def placement_bound(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration = Calibration(),
                    framework: str = "fourfold") -> float:
    """A lower bound of `step_time(...).total` for every placement order, tighter than
    `compute_bound`: the step as if the whole job were one node. No group gets more than the
    intra-node bandwidth, and every exposed time only grows as bandwidth falls."""
    return step_time(cfg, s, _one_node(cluster, s.world_size), cal, framework).total


@functools.lru_cache(maxsize=64)
def _one_node(cluster: Cluster, gpus: int) -> Cluster:
    return dataclasses.replace(cluster, gpus_per_node=gpus)


def step_time(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration = Calibration(),
              framework: str = "fourfold", traits: RunTraits = RunTraits()) -> StepTime:
    """`traits`: what a measured run did otherwise (`RunTraits`): without flash attention, its
    attention moves its score matrices through HBM; with FP8 linear layers their GEMMs run at
    `fp8_speedup` times bf16's rate and their inputs are cast (attention and the head stay bf16);
    context parallelism by all-gathered K and V instead of the ring."""
    k = constants(cal, cluster)
    c = _compute(cfg, s, cluster, k, framework, traits)
    layer_comm = _tensor_comm(cfg, s, cluster, k, c.forward, framework, linear_tflops(cluster, k, traits.fp8))
    if s.cp > 1:
        layer_comm += _ring_attention_exposed(cfg, s, cluster, k, framework, traits.cp_comm)
    T = s.seq / s.cp * s.micro_batch / s.z
    # The pipeline runs at the pace of its slowest rank: its layers (uneven splits), plus the head on the last.
    pace = max(range(len(c.ranks)), key=lambda r: c.rank_seconds(r, layer_comm))
    micro_compute = c.rank_seconds(pace)
    micro_comm = c.ranks[pace] * layer_comm
    if framework == "fourfold":
        micro_comm += _totals_seconds(_head_totals(_within_replica(s), cfg.vocab, cfg.hidden, int(T)),
                                      s, cluster, s.element_bytes, k)
    # Pipeline: P2P of each micro-batch's activation shard in both directions, at each of the
    # rank's `virtual` stages (interleaving sends v times as often), over the pp group's link.
    if s.pp > 1:
        shard = T * cfg.hidden / (s.x * s.y if framework == "fourfold" else s.y)
        sends = [Collective("pp", "send", int(shard))]
        if cfg.experts and cfg.aux_loss and framework == "fourfold":  # a mixture's load-balancing sums beside it
            sends.append(Collective("pp", "send", 2 * cfg.experts, wide=True))
        micro_comm += comm_seconds(sends * 2 * s.virtual, s, cluster, s.element_bytes, k)
    m = s.microbatches
    compute, exposed = m * micro_compute, m * micro_comm
    # Interleaved 1F1B (Narayanan et al. 2021): the bubble is (p-1)/v micro-batch times.
    bubble = (s.pp - 1) / s.virtual * (micro_compute + micro_comm)
    dp_comm = _dp_exposed(cfg, s, cluster, k, c, framework, micro_compute)
    flops = model_flops_per_token(cfg, s.seq) * s.global_batch * s.seq / s.world_size
    tied = _tied_seconds(cfg, s, cluster, k, framework, bubble) if cfg.tied and s.pp > 1 else 0.0
    return StepTime(compute, exposed, bubble, dp_comm, c.optimizer, flops, tied)


def _tied_seconds(cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, framework: str, bubble: float) -> float:
    """A tied embedding over pipeline stages, once per step. fourfold (`spec.volumes.tied_copy_sends`):
    the first stage sends its table shard to the last stage's copy before the step, exposed; the last
    stage sends the copy's gradient (fp32) back after its last backward, while the first stage still
    drains its own (about half the bubble: the drain of 1F1B), so only what exceeds bubble/2 shows.
    Megatron: the two stages' embedding gradients all-reduced over a group of 2 (fp32 main grads),
    after the backward, exposed."""
    sizes = dict(s.layout.sizes)
    if framework == "fourfold":
        n = s.pp * s.virtual
        table = comm_seconds(tied_copy_sends(cfg, sizes, [0], n), s, cluster, s.element_bytes, k)
        gradient = comm_seconds(tied_copy_sends(cfg, sizes, [n - 1], n), s, cluster, s.element_bytes, k)
        return table + max(0.0, gradient - bubble / 2)
    bw = _bandwidth(s.layout, cluster, ("pp",), k.intra_node_efficiency, k.inter_node_efficiency)
    return float(bytes_sent("all_reduce", 2, 4 * cfg.hidden * cfg.vocab // s.y)) / bw + 2 * k.latency_us * 1e-6


def _dp_exposed(cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, c: _Compute, framework: str,
                micro_compute: float) -> float:
    """Data-parallel gradients (fp32) over dp*cp: the reduce-scatter, then the parameter all-gather
    after the update. Both runtimes launch each gradient bucket as soon as it is final in the last
    micro-batch's backward (fourfold's GradientSync, Megatron's overlap_grad_reduce), so the fraction
    `dp_overlap` of the reduce-scatter can hide behind that backward (2/3 of its compute); Megatron's
    overlap_param_gather hides the all-gather behind the next step's first forward (1/3)."""
    g = s.dp * s.cp
    if g == 1:
        return 0.0
    dense, experts = _params_per_rank(cfg, s, c.ranks, framework)
    reduce = gather = 0.0
    # the dense parameters over dp*cp; with expert parallelism the experts' over their replicas (edp)
    for params, group in ((dense, ("dp", "cp")), (experts, ("edp",) if s.layout.ep > 1 else ("dp", "cp"))):
        size = group_size(s.layout, group)
        if size == 1 or params == 0:
            continue
        bw = _bandwidth(s.layout, cluster, group, k.intra_node_efficiency, k.inter_node_efficiency)
        reduce += float(bytes_sent("reduce_scatter", size, 4 * params)) / bw
        gather += float(bytes_sent("all_gather", size, s.element_bytes * params)) / bw
    return (_exposed(reduce, micro_compute * 2 / 3, k.dp_overlap)
            + _exposed(gather, micro_compute / 3, k.param_gather_overlap))
