"""Cost primitives of the step-time model: a GEMM's and attention's seconds at their shapes, the
bandwidth a group of ranks gets under the placement order, and the seconds of collectives.

Communication volumes come from `fourfold.spec.volumes`, the functions the runtime's ledger is
tested against; each collective runs at the bandwidth its group gets under the placement order.
A mixture's expert-parallel exchanges (all-to-alls over the ep group) are priced by the share of
each rank's rows that leaves its node (`_all_to_all_figures`).
"""

from __future__ import annotations

import functools

from fourfold.plan.constants import Calibration, Constants, constants
from fourfold.spec.hardware import Cluster
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import Collective, bytes_sent


def gemm_efficiency(m: float, n: float, k: float, cal: Constants) -> float:
    """Small local GEMMs after heavy sharding run far below peak."""
    smallest = min(m, n, k)
    return cal.efficiency_max * smallest / (smallest + cal.efficiency_half)



def attention_seconds(seq: int, cp: int, batch: float, heads: float, head_dim: int, peak_tflops: float,
                      cal: Constants, flash_attention: bool = True, gathered: bool = False,
                      share: float = 1.0) -> float:
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
    their shape's efficiency. `share` < 1: sliding windows keep that share of causal attention's
    pairs (`ModelConfig.attention_share`), and the time is scaled by it (the runtime skips the
    ring's blocks no query reaches, so each cp rank keeps its part)."""
    if share != 1.0:
        return share * attention_seconds(seq, cp, batch, heads, head_dim, peak_tflops, cal, flash_attention, gathered)
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
        return bandwidth(layout, cluster, dims, 1.0, 1.0)
    k = constants(cal, cluster)
    return bandwidth(layout, cluster, dims, k.intra_node_efficiency, k.inter_node_efficiency)


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
def bandwidth(layout, cluster: Cluster, dims: tuple[str, ...], intra_efficiency: float,
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
    return totals_seconds(totals(collectives), s, cluster, element_size, cal)


def totals(collectives: list[Collective]) -> tuple[tuple[str, str, Collective, int, int], ...]:
    """(group, op, width, elements, count): collectives of a kind summed (the volume is linear);
    `width`: a collective of one element whose `element_bytes` gives the kind's element size."""
    by_kind: dict[tuple[str, str, bool, bool], list[int]] = {}
    for c in collectives:
        entry = by_kind.setdefault((c.group, c.op, c.wide, c.integer), [0, 0])
        entry[0] += c.numel
        entry[1] += 1
    return tuple((group, op, _width(wide, integer), numel, count)
                 for (group, op, wide, integer), (numel, count) in by_kind.items())


@functools.lru_cache(maxsize=None)
def _width(wide: bool, integer: bool) -> Collective:
    return Collective("", "", 1, wide=wide, integer=integer)


A2A_OPS = ("all_to_all", "all_to_all_v")


def totals_seconds(summed, s: Job, cluster: Cluster, element_size: int, cal: Constants) -> float:
    """Seconds of collectives summed by kind (`totals`), run one after another."""
    seconds = 0.0
    latency = cal.latency_us * 1e-6
    for group, op, width, numel, count in summed:
        figures = _all_to_all_figures if op in A2A_OPS else _group_figures
        g, rate = figures(s.layout, cluster, group, cal.intra_node_efficiency, cal.inter_node_efficiency)
        steps = 1 if op == "send" else 2 * (g - 1) if op == "all_reduce" else (g - 1)
        seconds += (per_byte(op, g) * numel * width.element_bytes(element_size) / rate
                    + count * steps * latency)
    return seconds


@functools.lru_cache(maxsize=262144)
def _group_figures(layout, cluster: Cluster, group: str, intra_efficiency: float,
                   inter_efficiency: float) -> tuple[int, float]:
    """(size, bytes/s per GPU) of a group named like a ledger entry ("x", "dp_cp", "ep")."""
    dims = tuple(group.split("_"))
    return group_size(layout, dims), bandwidth(layout, cluster, dims, intra_efficiency, inter_efficiency)


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


def within_replica(s: Job) -> tuple[tuple[str, int], ...]:
    """The grid sizes a layer's, the head's and the ring's collectives depend on (dp and pp set to
    1: they only shape the groups of other collectives; ep: a mixture's exchange), as the caches
    below are keyed."""
    return (*((d, 1 if d in ("dp", "pp") else n) for d, n in s.layout.sizes.items()), ("ep", s.layout.ep))



@functools.lru_cache(maxsize=65536)
def gemm_seconds(tokens: float, k: float, n: float, peak_tflops: float, cal: Constants) -> float:
    return 2 * tokens * k * n / (peak_tflops * 1e12 * gemm_efficiency(tokens, k, n, cal))



@functools.lru_cache(maxsize=None)
def per_byte(op: str, group_size: int) -> float:
    """Bytes sent per byte of message (the volumes are linear in the message)."""
    return float(bytes_sent(op, group_size, 1))


def exposed(traffic: float, compute: float, overlap: float) -> float:
    """Seconds of `traffic` left after the fraction `overlap` of it hides behind `compute`."""
    return (1 - overlap) * traffic + max(0.0, overlap * traffic - compute)


def linear_tflops(cluster: Cluster, cal: Constants, fp8: bool) -> float:
    """The peak the linear layers' GEMMs are priced at: bf16's, or FP8's speed-up over it."""
    if fp8 and not cluster.gpu.fp8_tflops:
        raise ValueError(f"{cluster.gpu.name} has no FP8 tensor cores: a run with FP8 linears needs a Hopper or "
                         f"Blackwell GPU preset")
    return cluster.gpu.bf16_tflops * (cal.fp8_speedup if fp8 else 1.0)
