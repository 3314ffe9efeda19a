"""Time of one training step: compute + exposed communication + pipeline bubble + optimizer,
under a framework profile (`plan.frameworks`) for the parts each framework does its own way.
The cost primitives are `plan.costs`, the constants `plan.constants`."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from fourfold.models.config import ModelConfig
from fourfold.plan.constants import Calibration, Constants, constants
from fourfold.plan.costs import (
    attention_seconds,
    bandwidth,
    comm_seconds,
    exposed,
    gemm_efficiency,
    group_size,
    linear_tflops,
    per_byte,
    totals,
    totals_seconds,
    within_replica,
)
from fourfold.plan.frameworks import CP_COMMS, FOURFOLD, Framework
from fourfold.plan.routing import expert_params, expert_tokens, replicated_params, routed_tokens
from fourfold.spec.blockspec import block_plan
from fourfold.spec.counts import flops_per_token as model_flops_per_token
from fourfold.spec.counts import layer_params
from fourfold.spec.hardware import Cluster
from fourfold.spec.job import Job, rank_layers
from fourfold.spec.volumes import Collective, ring_attention_passes


@dataclass(frozen=True)
class RunTraits:
    """What a measured run's software did that fourfold's plans do not: the planner plans flash
    attention, bf16 linears and the ring of `parallel.context`; measured runs tell what they ran."""

    flash_attention: bool = True  # False: runs that predate it (Megatron-LM 2021)
    fp8: bool = False  # FP8 linear layers (Transformer Engine, torchao's Float8)
    cp_comm: str | None = None  # context parallelism's exchange (CP_COMMS; None: the framework profile's)
    # Transformer Engine's userbuffers: the sequence-parallel collectives pipelined with their GEMMs
    # (NeMo's and Megatron-Bridge's performance recipes: MegatronCommOverlapCallback(tp_comm_overlap=True))
    tp_comm_overlap: bool = False
    grad_reduce_bytes: int = 4  # the gradients' reduce-scatter in fp32 (4) or bf16 (2: grad_reduce_in_fp32=False)

    def __post_init__(self) -> None:
        if self.cp_comm is not None and self.cp_comm not in CP_COMMS:
            raise ValueError(f"cp_comm {self.cp_comm!r}: give one of {', '.join(CP_COMMS)}")


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
                          traits: RunTraits = RunTraits(), attention_share: float = 1.0,
                          expert_tflops: float = 0.0) -> tuple[float, float]:
    """(seconds of the GEMMs, seconds of attention) of one layer's forward for one micro-batch on one rank;
    x = 1 for the megatron profile's 1D tensor parallelism; a mixture's experts/ep experts on the
    rows the ep ranks send them. `linear_tflops`, `expert_tflops`: the dense linear layers' and the
    routed experts' peaks (FP8's speed-up; 0: bf16). `attention_share`: of causal attention's pairs,
    what the layers attend on average (sliding windows)."""
    T = seq / cp * batch
    peak = (linear_tflops or peak_tflops) * 1e12
    expert_peak = (expert_tflops or peak_tflops) * 1e12
    d = block.head_dim
    plan = _plan(block, x, y)
    gemms = 0.0
    if block.mla:  # the latents on every y rank (columns over x), the per-head projections on this rank's heads
        heads = plan.local_heads
        for k, n in ((block.hidden / x, block.q_lora), (block.hidden / x, block.kv_lora + block.rope_dim),
                     (block.q_lora, heads * d), (block.kv_lora, heads * (block.nope_dim + block.v_dim))):
            gemms += 2 * T * k * n / (peak * gemm_efficiency(T, k, n, cal))
    for layer in plan.linears:  # each rank's block of each GEMM (z only splits the stored weights)
        if block.mla and layer is plan.qkv:  # (latent attention has none)
            continue
        k_local = layer.in_features / (x if layer.in_dim == "x" else y)
        n_local = layer.out_features / (x if layer.out_dim == "x" else y)
        # a mixture's experts: each on its share of the routed tokens, one after another (routing.py);
        # with expert parallelism, experts/ep of them, each on its share of the ep ranks' tokens
        routed = block.moe and layer in (plan.up, plan.down)
        tokens, times = (expert_tokens(block, T * ep), block.experts // ep) if routed else (T, 1)
        gemms += times * 2 * tokens * k_local * n_local / ((expert_peak if routed else peak)
                                                           * gemm_efficiency(tokens, k_local, n_local, cal))
    if block.moe:  # the router's GEMM on the stream's features of this x rank (the shared gate's is a GEMV)
        gemms += 2 * T * block.hidden / x * block.experts / (
            peak * gemm_efficiency(T, block.hidden / x, block.experts, cal))
    # the local queries against the whole sequence (ring attention brings the other chunks' keys)
    attention = attention_seconds(seq, cp, batch, plan.local_heads, d, peak_tflops, cal, traits.flash_attention,
                                  traits.cp_comm in ("all_gather", "a2a"), attention_share)
    return gemms, attention


@functools.lru_cache(maxsize=65536)
def _ring_totals(block, sizes: tuple[tuple[str, int], ...], batch: int, seq: int):
    ring = ring_attention_passes(block, dict(sizes), batch, seq)
    return totals(ring.forward), totals(ring.backward)


def _ring_attention_exposed(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, framework: Framework,
                            cp_comm: str = "p2p") -> float:
    """Ring attention over cp (the runtime's volumes): each of the cp-1 forward steps hides its
    K, V transfer behind one block attention (the next block is in flight while the current one
    is attended: `parallel.context`, and TransformerEngine's ring for Megatron), backward behind
    the block's backward (2.5 block attentions: flash attention's); `cal.ring_overlap` (1: both
    runtimes) of the traffic can hide.
    `cp_comm` "all_gather" (Llama 3, Megatron-Core's cp_comm_type all_gather): K and V all-gathered
    before attention, again in backward, and dK, dV (fp32) reduce-scattered after it, exposed;
    "a2a": `_a2a_seconds`."""
    if cp_comm == "all_gather":
        return _gathered_kv_seconds(cfg, s, cluster, cal, framework)
    if cp_comm == "a2a":
        return _a2a_seconds(cfg, s, cluster, cal, framework)
    ring_forward, ring_backward = _ring_totals(cfg.block, within_replica(s), int(s.micro_batch / s.z),
                                               int(s.seq / s.cp))
    tp_heads = framework.attention_split(cfg.block, s.x, s.y)
    # one ring step's attention: the rank's attention over its cp steps, on average
    block_attention = attention_seconds(s.seq, s.cp, s.micro_batch / s.z, cfg.heads / tp_heads, cfg.block.head_dim,
                                        cluster.gpu.bf16_tflops, cal, share=cfg.attention_share(s.seq)) / s.cp
    forward = exposed(totals_seconds(ring_forward, s, cluster, s.element_bytes, cal), (s.cp - 1) * block_attention,
                      cal.ring_overlap) * _attention_passes(s)
    backward = exposed(totals_seconds(ring_backward, s, cluster, s.element_bytes, cal),
                       (2 + FLASH_BACKWARD_EXTRA) * (s.cp - 1) * block_attention, cal.ring_overlap)
    return forward + backward


def _attention_passes(s: Job) -> int:
    """How often the attention core's forward runs a step: again in backward under full recompute
    and under selective (Megatron-Core's checkpointed core attention, fourfold's `recompute="selective"`)."""
    return 2 if s.recompute in ("full", "selective") else 1


def _gathered_kv_seconds(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, framework: Framework) -> float:
    kv_heads = cfg.kv_heads // framework.attention_split(cfg.block, s.x, s.y)
    whole = int(s.micro_batch / s.z) * kv_heads * s.seq * cfg.block.head_dim  # K (or V) of the whole sequence
    gathers = [Collective("cp", "all_gather", whole)] * 2  # K and V
    scatters = [Collective("cp", "reduce_scatter", whole, wide=True)] * 2  # dK and dV
    return comm_seconds(gathers * (_attention_passes(s) + 1) + scatters, s, cluster, s.element_bytes, cal)


def _a2a_seconds(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, framework: Framework) -> float:
    """Megatron-Core's cp_comm_type a2a (DeepSpeed-Ulysses; Transformer Engine's
    AttnFuncWithCPAndQKVOA2A): Q, K and V all-to-all over cp before attention, from a sequence
    chunk of every head to the whole sequence of heads/cp, and the output back after it; backward
    the same for dO, then dQ, dK, dV. Each rank sends (cp-1)/cp of each tensor, exposed (attention
    waits for its inputs); attention itself is the whole sequence's on heads/cp (`attention_seconds`
    as gathered). With full or selective recompute the forward's all-to-alls run again."""
    split = framework.attention_split(cfg.block, s.x, s.y)
    local = int(s.micro_batch / s.z) * s.seq // s.cp * cfg.block.head_dim  # one head's rows of this rank
    q, kv = cfg.heads // split * local, cfg.kv_heads // split * local
    forward = [Collective("cp", "all_to_all", n) for n in (q, kv, kv, q)]  # Q, K, V, then the output
    return comm_seconds(forward * (_attention_passes(s) + 1), s, cluster, s.element_bytes, cal)


# A layer's backward: the GEMMs' dX and dW, twice their forward. Attention's without flash attention
# too (dP, dS from the stored scores, then dQ, dK, dV); flash attention recomputes the scores in its
# backward, which is 2.5 times its forward (five matmuls to two: Dao 2023, FlashAttention-2, the
# FLOP count of its benchmarks): half a forward more than the rest.
FLASH_BACKWARD_EXTRA = 0.5


@dataclass(frozen=True)
class _Compute:
    """The part of a step's time no placement order or collective changes."""

    forward: float  # one layer's forward, one micro-batch
    layer: float  # one layer's forward and backward (and recompute), with the fixed overhead
    head: float  # the LM head and loss of one micro-batch, on the last pipeline rank
    ranks: tuple[int, ...]  # layers of each pipeline rank
    optimizer: float
    micro_batch_overhead: float

    def rank_seconds(self, r: int, layer_comm: float = 0.0) -> float:
        """One micro-batch on pipeline rank `r`."""
        return (self.ranks[r] * (self.layer + layer_comm) + (self.head if r == len(self.ranks) - 1 else 0.0)
                + self.micro_batch_overhead)


@functools.lru_cache(maxsize=256)  # (every candidate of a search asks it: a copy each is 15% of the search)
def _with_exchange(traits: RunTraits, framework: Framework) -> RunTraits:
    """`traits` with its cp exchange: a measured run's own, else the framework profile's."""
    return traits if traits.cp_comm else dataclasses.replace(traits, cp_comm=framework.cp_comm)


def _compute(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Constants, framework: Framework,
             traits: RunTraits = RunTraits()) -> _Compute:
    traits = _with_exchange(traits, framework)
    gemms, attention = _layer_compute_cached(cfg.block, s.x, s.y, s.seq, s.cp,
                                             s.micro_batch / s.z, cluster.gpu.bf16_tflops, cal, s.layout.ep,
                                             linear_tflops(cluster, cal, _fp8(s, traits)), traits,
                                             cfg.attention_share(s.seq), linear_tflops(cluster, cal, traits.fp8))
    T = s.seq / s.cp * s.micro_batch / s.z
    traffic = _elementwise_traffic(cfg, s, T, _fp8(s, traits))
    if not traits.flash_attention:  # attention's score matrices through HBM (Dao et al. 2022, standard attention)
        traffic += _score_traffic(cfg, s, T, framework)
    forward = gemms + attention + traffic / (cluster.gpu.hbm_tbs * 1e12)
    per_layer = forward + 2 * forward + (FLASH_BACKWARD_EXTRA * attention if traits.flash_attention else 0.0)
    if s.recompute == "full":
        per_layer += forward
    elif s.recompute == "selective":  # the attention core again
        per_layer += attention
    vocab = framework.head_columns(cfg.vocab, s.y)
    head = 6 * T * cfg.hidden * vocab / (s.x * s.y)
    head /= cluster.gpu.bf16_tflops * 1e12 * gemm_efficiency(T, cfg.hidden / s.x, vocab / s.y, cal)
    # the loss: passes over the rank's logits in fp32, bound by HBM bandwidth
    head += T * vocab / (s.x * s.y) * framework.loss_bytes(s.element_bytes) / (cluster.gpu.hbm_tbs * 1e12)
    # the gradients accumulated outside the GEMMs, every micro-batch (`Framework.accumulate_bytes`): each
    # layer's; the head's (a tied head's copy on the last stage of a pipeline), the embedding's where the
    # last stage is the first too (a tied head's gradient is the embedding's there)
    linear_bytes, table_bytes = framework.accumulate_bytes(s.element_bytes)
    hbm = cluster.gpu.hbm_tbs * 1e12
    per_layer += linear_bytes * sum(_layer_params_per_rank(cfg, s)) / hbm
    head_bytes = (table_bytes if s.pp == 1 else 0.0) + (0.0 if cfg.tied and s.pp == 1 else linear_bytes)
    head += head_bytes * _table_per_rank(cfg, s) / hbm
    ranks = rank_layers(cfg.layers, s.pp, s.virtual, s.stage_layers)
    dense, experts = _params_per_rank(cfg, s, ranks)
    # ZeRO-1: the update on the dense parameters' shard of 1/(dp*cp), the experts' of 1/(dp*cp/ep); the
    # gradient buffer's passes over every parameter the rank holds
    shard_bytes, rank_bytes = framework.update_bytes(s.element_bytes)
    shard = (dense + experts * s.layout.ep) / (s.dp * s.cp)
    optimizer = (shard_bytes * shard + rank_bytes * (dense + experts)) / hbm
    return _Compute(forward, per_layer + cal.layer_overhead_us * 1e-6, head, ranks, optimizer,
                    cal.micro_batch_overhead_us * 1e-6)


def _fp8(s: Job, traits: RunTraits) -> bool:
    """Whether the dense linears' GEMMs run in FP8: the job asks (train.fp8), or a measured run did.
    A mixture's routed experts run in FP8 only in a measured run's framework (Transformer Engine's
    grouped GEMM): fourfold's train.fp8 leaves their grouped GEMM in the model's dtype."""
    return bool(s.fp8) or traits.fp8


def _elementwise_traffic(cfg: ModelConfig, s: Job, tokens: float, fp8: bool = False) -> float:
    """Bytes of one layer's forward elementwise work, bound by HBM bandwidth (roofline): each op
    reads its inputs and writes its output once, in the job's precision: two norms (2h a token)
    and two residual adds (3h) on the residual stream (split over the tensor group under sequence
    parallelism), the MLP's activation (3F gated, 2F else) on the local F; with FP8 linears, each
    linear's input cast to FP8 (read in the job's precision, written in one byte: 3h + F a token
    on the local features, as Transformer Engine quantises them)."""
    tp = s.x * s.y
    stream = 10 * cfg.hidden / (tp if s.seq_parallel else 1)
    b = cfg.block
    if b.moe:  # the activation on the top_k experts' features (and the shared expert's); each expert's
        # weighted output added into the sum (read, read, write) on the features of this x rank
        activation = 3 * (routed_tokens(b, cfg.ffn) + b.shared_ffn) / tp
        activation += 3 * routed_tokens(b, cfg.hidden) / s.x
    else:
        activation = (3 if b.gated else 2) * cfg.ffn / tp
    cast = (s.element_bytes + 1) * (3 * cfg.hidden + cfg.ffn) / tp if fp8 else 0.0
    return tokens * (s.element_bytes * (stream + activation) + cast)


def _score_traffic(cfg: ModelConfig, s: Job, tokens: float, framework: Framework) -> float:
    """Bytes of one layer's forward attention without flash attention: the local heads' scores
    S = QK^T and probabilities P = softmax(S), each written to HBM and read back once;
    backward moves twice that (its dP and dS), so it scales with the forward like the GEMMs."""
    heads = cfg.heads / framework.attention_split(cfg.block, s.x, s.y)
    return 4 * s.element_bytes * heads * tokens * s.seq


def _params_per_rank(cfg: ModelConfig, s: Job, ranks: tuple[int, ...]) -> tuple[float, float]:
    """(dense parameters, expert parameters) held by a rank of the most loaded pipeline stage: a
    mixture's experts split over the ep ranks too (their gradients reduced over dp*cp/ep replicas).
    The vocabulary tables: the embedding's on the first stage, the head's on the last, both on the one
    stage of a pipeline of one (a tied head's is the embedding's)."""
    dense, experts = _layer_params_per_rank(cfg, s)
    tables = 2 if s.pp == 1 and not cfg.tied else 1
    return max(ranks) * dense + tables * _table_per_rank(cfg, s), max(ranks) * experts


def _layer_params_per_rank(cfg: ModelConfig, s: Job) -> tuple[float, float]:
    """(dense parameters, expert parameters) of one layer on a rank: the tensor grid's share, a
    mixture's experts split over the ep ranks too."""
    matrices, vectors = layer_params(cfg)
    tp = s.x * s.y * s.z
    replicated = replicated_params(cfg.block)  # a mixture's router and shared gate: split over x only
    experts = expert_params(cfg.block)
    held = replicated / s.x - replicated / tp
    return (matrices - experts + vectors) / tp + held, experts / (tp * s.layout.ep)


def compute_bound(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration = Calibration(),
                  framework: Framework = FOURFOLD) -> float:
    """A lower bound of `step_time(...).total` for every placement order: the slowest pipeline
    rank's compute for every micro-batch and the bubble, and the optimizer (communication only
    adds). The search evaluates candidates in this order and stops where it exceeds what it keeps."""
    c = _compute(cfg, s, cluster, constants(cal, cluster), framework)
    slowest = max(c.rank_seconds(r) for r in range(len(c.ranks)))
    return (s.microbatches + (s.pp - 1) / s.virtual) * slowest + c.optimizer


def placement_bound(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration = Calibration(),
                    framework: Framework = FOURFOLD) -> float:
    """A lower bound of `step_time(...).total` for every placement order, tighter than
    `compute_bound`: the step as if the whole job were one node. No group gets more than the
    intra-node bandwidth, and every exposed time only grows as bandwidth falls."""
    return step_time(cfg, s, _one_node(cluster, s.world_size), cal, framework).total


@functools.lru_cache(maxsize=64)
def _one_node(cluster: Cluster, gpus: int) -> Cluster:
    return dataclasses.replace(cluster, gpus_per_node=gpus)


def step_time(cfg: ModelConfig, s: Job, cluster: Cluster, cal: Calibration = Calibration(),
              framework: Framework = FOURFOLD, traits: RunTraits = RunTraits()) -> StepTime:
    """`framework`: the profile whose tensor parallelism, head, pipeline sends and tied embedding
    are priced. `traits`: what a measured run did otherwise (`RunTraits`): without flash attention,
    its attention moves its score matrices through HBM; with FP8 linear layers their GEMMs run at
    `fp8_speedup` times bf16's rate and their inputs are cast (attention and the head stay bf16);
    context parallelism by all-gathered K and V instead of the ring."""
    k = constants(cal, cluster)
    traits = _with_exchange(traits, framework)
    c = _compute(cfg, s, cluster, k, framework, traits)
    layer_comm = framework.tensor_comm(cfg, s, cluster, k, c.forward, linear_tflops(cluster, k, _fp8(s, traits)),
                                       traits.tp_comm_overlap)
    if s.cp > 1:
        layer_comm += _ring_attention_exposed(cfg, s, cluster, k, framework, traits.cp_comm)
    T = s.seq / s.cp * s.micro_batch / s.z
    # The pipeline runs at the pace of its slowest rank: its layers (uneven splits), plus the head on the last.
    pace = max(range(len(c.ranks)), key=lambda r: c.rank_seconds(r, layer_comm))
    micro_compute = c.rank_seconds(pace)
    micro_comm = c.ranks[pace] * layer_comm + framework.head_comm(cfg, s, cluster, k, int(T))
    # Pipeline: P2P of each micro-batch's activation shard in both directions, at each of the
    # rank's `virtual` stages (interleaving sends v times as often), over the pp group's link.
    if s.pp > 1:
        sends = framework.pipeline_sends(cfg, s, T)
        micro_comm += comm_seconds(sends * 2 * s.virtual, s, cluster, s.element_bytes, k)
    m = s.microbatches
    # Interleaved 1F1B (Narayanan et al. 2021): the bubble is (p-1)/v micro-batch times.
    bubble = (s.pp - 1) / s.virtual * (micro_compute + micro_comm)
    dp_comm = _dp_exposed(cfg, s, cluster, k, c, micro_compute, framework, traits.grad_reduce_bytes)
    flops = model_flops_per_token(cfg, s.seq) * s.global_batch * s.seq / s.world_size
    tied = framework.tied_seconds(cfg, s, cluster, k, bubble) if cfg.tied and s.pp > 1 else 0.0
    return StepTime(m * micro_compute, m * micro_comm, bubble, dp_comm, c.optimizer, flops, tied)


def _dp_exposed(cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, c: _Compute,
                micro_compute: float, framework: Framework = FOURFOLD, grad_bytes: int = 4) -> float:
    """Data-parallel gradients (fp32, or bf16: `grad_bytes` 2) over dp*cp: the reduce-scatter, then the parameter
    all-gather after the update. Both runtimes launch each gradient bucket as soon as it is final in the last
    micro-batch's backward (fourfold's GradientSync, Megatron's overlap_grad_reduce), so the fraction
    `dp_overlap` of the reduce-scatter can hide behind that backward (2/3 of its compute); the all-gather
    hides behind the next step's first forward (1/3): fourfold's whole (each bucket waited by the first layer
    using it, `GradientSync.set_params`), Megatron's as overlap_param_gather says (`param_gather_overlap`).
    Not the embedding table's bucket: its gradients are final last (Megatron-Core buckets the parameters
    in reverse order), and its parameters are the first the next forward waits for, so both show."""
    g = s.dp * s.cp
    if g == 1:
        return 0.0
    dense, experts = _params_per_rank(cfg, s, c.ranks)
    reduce = gather = table_reduce = table_gather = 0.0
    # the dense parameters over dp*cp; with expert parallelism the experts' over their replicas (edp)
    for params, group, table in ((dense, ("dp", "cp"), _table_per_rank(cfg, s)),
                                 (experts, ("edp",) if s.layout.ep > 1 else ("dp", "cp"), 0.0)):
        size = group_size(s.layout, group)
        if size == 1 or params == 0:
            continue
        bw = bandwidth(s.layout, cluster, group, k.intra_node_efficiency, k.inter_node_efficiency)
        reduced, gathered = grad_bytes * per_byte("reduce_scatter", size) / bw, s.element_bytes * per_byte(
            "all_gather", size) / bw  # seconds a parameter
        reduce, gather = reduce + reduced * (params - table), gather + gathered * (params - table)
        table_reduce, table_gather = table_reduce + reduced * table, table_gather + gathered * table
    hides_gather = 1.0 if framework.hides_param_gather else k.param_gather_overlap
    return (exposed(reduce, micro_compute * 2 / 3, k.dp_overlap) + table_reduce
            + exposed(gather, micro_compute / 3, hides_gather) + table_gather)


def _table_per_rank(cfg: ModelConfig, s: Job) -> float:
    """The embedding table's parameters on a rank: the vocabulary split over the tensor grid."""
    return cfg.hidden * cfg.vocab / (s.x * s.y * s.z)
