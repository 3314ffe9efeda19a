"""Megatron-LM (Megatron-Core) as its published runs ran: 1D tensor parallelism over y with
sequence parallelism, the column-parallel linears' backward overlapped
(LinearWithGradAccumulationAndAsyncCommunication), even pipeline stages, tied embeddings by an
all-reduce, experts over data-parallel ranks with the all-to-all token dispatcher; memory by the
closed formulas of arXiv 2411.06465 with its 80% rule (`plan.memory.megatron_memory`)."""

from __future__ import annotations

import functools

from fourfold.models.config import ModelConfig
from fourfold.plan.constants import Constants
from fourfold.plan.costs import bandwidth, gemm_seconds, totals, totals_seconds
from fourfold.plan.frameworks.base import CP_COMMS, Framework
from fourfold.plan.memory import Memory, megatron_memory
from fourfold.spec.blockspec import BlockConfig, block_plan
from fourfold.spec.hardware import Cluster
from fourfold.spec.job import Job, megatron_stages
from fourfold.spec.layout import DEFAULT_ORDER
from fourfold.spec.rules import Problem, problems
from fourfold.spec.volumes import Collective, bytes_sent

MAX_VIRTUAL = 8  # the most interleaved stages per pipeline rank the search tries


class Megatron(Framework):
    name = "megatron"
    keeps_gathered_inputs = False
    hides_param_gather = False  # overlap_param_gather: a run or the calibration says

    def __init__(self, cp_comm: str = "p2p"):
        """`cp_comm`: Megatron-Core's cp_comm_type, one of CP_COMMS (p2p: its default)."""
        if cp_comm not in CP_COMMS:
            raise ValueError(f"cp_comm {cp_comm!r}: give one of {', '.join(CP_COMMS)} (Megatron-Core's cp_comm_type)")
        self.cp_comm = cp_comm

    def __repr__(self) -> str:
        return f"<{self.name} profile, cp_comm {self.cp_comm}>"

    def problems(self, cfg: ModelConfig, job: Job) -> list[Problem]:
        found = problems(cfg, job, gpu=True)
        if job.x != 1 or job.z != 1:
            found.append(Problem("the megatron profile has 1D tensor parallelism",
                                 "give --tp (y) and leave x = z = 1"))
        if job.layout.ep > 1 and job.dp % job.layout.ep:
            found.append(Problem(f"Megatron-Core splits the experts over data-parallel ranks only: ep={job.layout.ep} "
                                 f"does not divide dp={job.dp}", "choose an ep dividing dp, or --framework fourfold "
                                 "(ep over dp*cp)"))
        if job.layout.ep > 1 and cfg.block.shared_ffn:
            found.append(Problem("Megatron-Core (0.8) has no shared experts: the megatron profile prices a mixture "
                                 "with one as a dense MLP beside the experts, without expert parallelism",
                                 "leave --ep 1, or --framework fourfold"))
        if cfg.block.moe and job.y > 1 and not job.seq_parallel:
            found.append(Problem("Megatron-Core's mixture layers need sequence parallelism with tensor parallelism",
                                 "give --seq-parallel (the default), or --tp 1"))
        if job.layout.ep > 1 and job.cp > 1:
            found.append(Problem("the megatron profile prices expert parallelism without context parallelism "
                                 "(Megatron's ep ranks sit between cp and dp, a placement it does not model)",
                                 "leave --cp 1 with --ep, or --framework fourfold"))
        if self.cp_comm == "a2a" and job.cp > 1 and (cfg.heads // job.y % job.cp or cfg.kv_heads // job.y % job.cp):
            found.append(Problem(f"cp_comm a2a splits each tensor-parallel rank's heads over cp: cp={job.cp} does not "
                                 f"divide its {cfg.heads // job.y} query and {cfg.kv_heads // job.y} key/value heads",
                                 "choose a cp dividing them, or --cp-comm p2p or all_gather"))
        chunks = job.pp * job.virtual
        bridge = megatron_stages(cfg.layers, chunks)
        if cfg.layers % chunks and not (bridge and job.stage_layers == bridge):
            # Megatron-Core (to 0.9) builds num_layers // pp layers on every pipeline rank, and // virtual
            # per chunk (transformer_block.get_num_layers_to_build): no uneven stages, but for the split of
            # later versions that count the embedding and the loss as a layer each (Megatron-Bridge's)
            split = f", or give the split that counts the embedding and the loss as a layer each: {list(bridge)}"
            found.append(Problem(f"Megatron-LM builds the same number of layers on every pipeline stage: pp * "
                                 f"virtual = {chunks} does not divide the model's {cfg.layers} layers",
                                 "choose --pp (and --virtual) dividing the layers, or --framework fourfold "
                                 f"(uneven stages){split if bridge else ''}"))
        return found

    def runs_grid(self, cfg: ModelConfig, pp: int, x: int, z: int) -> bool:
        return x == 1 and z == 1 and cfg.layers % pp == 0  # 1D tensor parallelism, even stages

    def placement_orders(self, cfg: ModelConfig) -> list[tuple[str, ...]]:
        return [DEFAULT_ORDER]

    def expert_replicas(self, dp: int, cp: int) -> int:
        return dp if cp == 1 else 1

    def virtuals(self, cfg: ModelConfig, pp: int) -> tuple[int, ...]:
        return (1, *(v for v in interleavings(cfg.layers, pp) if v <= MAX_VIRTUAL))

    def published_stages(self, layers: int, chunks: int) -> tuple[int, ...]:
        return megatron_stages(layers, chunks) if layers % chunks else ()

    def memory(self, cfg: ModelConfig, job: Job, memory_gib: float, rule80: bool = True,
               flash_attention: bool = True) -> Memory:
        return megatron_memory(cfg, job, memory_gib, rule80)  # its runs use flash attention

    def attention_split(self, block: BlockConfig, x: int, y: int) -> int:
        return y

    def head_columns(self, vocab: int, y: int) -> int:
        return vocab

    def loss_bytes(self, element_bytes: int) -> float:
        """Megatron-Core's `vocab_parallel_cross_entropy` (tensor_parallel/cross_entropy.py, 0.8),
        whole logits at once: forward the fp32 cast (e read, 4 written), the max (4), the max
        subtracted in place (8), exp in place (8), the sum (4), the softmax's division in place
        (8); backward the gradient scaled in place (8) and cast back to the logits' dtype (4 + e)."""
        return 48 + 2 * element_bytes

    def update_bytes(self, element_bytes: int) -> tuple[float, float]:
        """Megatron-Core 0.8's distributed optimizer on the shard: the gradient norm reads the
        gradient (4; the clip's scaling runs only when the norm exceeds it, rare once training
        settles), the fused Adam reads weight, gradient and both moments and writes three back (28,
        the decay inside), the weight copied to the model's dtype (4 + e); on every
        parameter of the rank, the gradient buffer's NaN check before its reduce-scatter
        (`check_for_nan_in_grad`, Megatron-LM's default: a norm, 4) and its zeroing (4)."""
        return 4 + 28 + 4 + element_bytes, 8

    def accumulate_bytes(self, element_bytes: int) -> tuple[float, float]:
        """Megatron-LM's gradient_accumulation_fusion (its default with Transformer Engine): the
        weight-gradient GEMMs accumulate into main_grad themselves; the embedding's gradient is added
        by the DDP hook (`main_grad.add_(grad)`: read 4 and e, write 4)."""
        return 0, 8 + element_bytes

    def tensor_comm(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, forward_seconds: float,
                    gemm_tflops: float, gemm_overlap: bool = False) -> float:
        """With sequence parallelism each sublayer all-gathers its input and reduce-scatters its output
        in forward, and the row-parallel linear all-gathers its output gradient in backward, exposed;
        the column-parallel linear's backward re-gathers its input (for the weight gradient) while its
        dX GEMM runs and reduce-scatters the input gradient while its dW GEMM runs. Without sequence
        parallelism: an all-reduce in forward, and one in backward behind the dW GEMM. A mixture's
        experts (without a shared one) move their tokens with the all-to-all dispatcher instead
        (`_dispatch`), exposed. `gemm_overlap` (Transformer Engine's userbuffers, NeMo's and
        Megatron-Bridge's tp_comm_overlap, sequence parallel): every one of those collectives runs
        in chunks beside the GEMM that consumes or produces it (`_pipelined_with_gemms`)."""
        T = s.seq / s.cp * s.micro_batch / s.z
        dispatched = cfg.block.moe and not cfg.block.shared_ffn
        sublayers = 1 if dispatched else 2  # attention, and a dense MLP
        forward, backward, (regather, reduction) = _tensor_totals(int(T) * cfg.hidden, s.seq_parallel, sublayers)
        seconds = functools.partial(totals_seconds, s=s, cluster=cluster, element_size=s.element_bytes, cal=k)
        passes = 2 if s.recompute == "full" else 1
        if gemm_overlap and s.seq_parallel and not dispatched and s.y > 1:
            return _pipelined_with_gemms(cfg.block, T, s.y, seconds(regather), seconds(reduction), passes,
                                         gemm_tflops, k, cluster.gpu.sms)
        exposed = passes * seconds(forward) + seconds(backward) + sublayers * (seconds(regather) + seconds(reduction))
        for in_features, out_features in _column_parallel(cfg.block, s.y, dispatched):
            gemm = gemm_seconds(T, in_features, out_features / s.y, gemm_tflops, k)
            exposed -= min(gemm, seconds(regather)) + min(gemm, seconds(reduction))
        if dispatched:  # the dispatch and its backward (the same collectives), the forward's again under full recompute
            exposed += (passes + 1) * seconds(_dispatch(int(T), cfg.hidden, cfg.block.top_k, s.y, s.layout.ep))
        return exposed

    def head_comm(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, tokens: int) -> float:
        return 0.0  # not priced: the gather of the sequence-parallel stream before the output layer is left out

    def pipeline_sends(self, cfg: ModelConfig, s: Job, tokens: float) -> list[Collective]:
        """A tensor-parallel rank's 1/tp of the stream: its sequence shard under sequence parallelism,
        else a 1/tp slice of it, gathered over NVLink on arrival (the scatter-gather optimisation,
        Narayanan et al. 2021, section 4.1)."""
        return [Collective("pp", "send", int(tokens * cfg.hidden / s.y))]

    def tied_seconds(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, bubble: float) -> float:
        """The two stages' embedding gradients all-reduced over a group of 2 (fp32 main grads), after
        the backward, exposed."""
        bw = bandwidth(s.layout, cluster, ("pp",), k.intra_node_efficiency, k.inter_node_efficiency)
        return float(bytes_sent("all_reduce", 2, 4 * cfg.hidden * cfg.vocab // s.y)) / bw + 2 * k.latency_us * 1e-6


MEGATRON = Megatron()


def interleavings(layers: int, pp: int) -> list[int]:
    """Each v > 1 that divides a pipeline rank's layers: the interleavings Megatron-LM can run (it
    takes the layers of a virtual stage, --num-layers-per-virtual-pipeline-stage)."""
    per_rank = layers // pp
    return [v for v in range(2, per_rank + 1) if per_rank % v == 0]


@functools.lru_cache(maxsize=4096)
def _column_parallel(block: BlockConfig, y: int, dispatched: bool) -> tuple[tuple[int, int], ...]:
    """(in, out features) of the column-parallel linears whose backward overlaps: QKV and, with a
    dense MLP, its up projection."""
    plan = block_plan(block, 1, y, seq_parallel=False)
    return tuple((layer.in_features, layer.out_features) for layer in ((plan.qkv,) if dispatched else
                                                                          (plan.qkv, plan.up)))


def _pipelined_with_gemms(block: BlockConfig, T: float, y: int, gather: float, scatter: float, passes: int,
                          gemm_tflops: float, k: Constants, sms: int) -> float:
    """One layer's sequence-parallel collectives each pipelined with its GEMM (the seconds of one
    all-gather and one reduce-scatter of the stream), as Transformer Engine's userbuffers run them
    (`initialize_ub`'s default methods, TE 1.9): the all-gathers into the column-parallel GEMMs (QKV,
    up; forward, `passes` times) and of dY into the row-parallel dX GEMMs (backward) by ring exchange,
    a 1/y chunk of the GEMM on each chunk while the next arrives (the first is local: the gather
    hides behind the GEMM's last y-1 chunks); the reduce-scatters out of the row-parallel GEMMs
    (out, down; forward) pipelined in UB_SCATTER_CHUNKS, each chunk's reduction beside the next
    chunk's GEMM, the last one's exposed; in backward the column-parallel linear's input re-gather
    and dX reduce-scatter in bulk beside its dX and dW GEMMs (as without userbuffers). The pipelined
    and bulk ones run on UB_COMM_SMS of the GPU's `sms` beside their GEMM, which loses that share of
    its rate while both run (`sms` 0, unknown: not priced)."""
    plan = block_plan(block, 1, y, seq_parallel=False)
    n, share = UB_SCATTER_CHUNKS, UB_COMM_SMS / sms if sms else 0.0
    seconds = 0.0
    for column, row in ((plan.qkv, plan.out), (plan.up, plan.down)):
        col = gemm_seconds(T, column.in_features, column.out_features / y, gemm_tflops, k)
        rowg = gemm_seconds(T, row.in_features / y, row.out_features, gemm_tflops, k)
        scattered = scatter / n + max(0.0, scatter - rowg) * (n - 1) / n
        seconds += passes * (max(0.0, gather - col * (y - 1) / y) + scattered)
        seconds += max(0.0, gather - rowg * (y - 1) / y) + max(0.0, gather - col) + max(0.0, scatter - col)
        seconds += share * (passes * min(scatter, rowg) + min(gather, col) + min(scatter, col))
    return seconds


# The chunks of a row-parallel GEMM whose output reduce-scatter is pipelined with it: Transformer
# Engine's default `num_splits` of the "pipeline" method (`initialize_ub`, TE 1.9: 4; ring exchange: tp)
UB_SCATTER_CHUNKS = 4
# The SMs each SM-based userbuffers overlap ("pipeline", "bulk") runs on beside its GEMM: TE 1.9's default
# `num_sm`, with `set_sm_margin` False (the GEMM is launched on every SM, and shares them while both run)
UB_COMM_SMS = 16


@functools.lru_cache(maxsize=4096)
def _dispatch(tokens: int, hidden: int, top_k: int, tp: int, ep: int):
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
    return totals(out)


@functools.lru_cache(maxsize=4096)
def _tensor_totals(elements: int, seq_parallel: bool, sublayers: int = 2):
    """The tensor-parallel collectives of `sublayers` of one layer (attention and the MLP) on
    activations of `elements`: (forward, exposed backward, (the re-gather, the input-gradient
    reduction) of one column-parallel linear)."""
    if seq_parallel:
        gather, scatter = Collective("y", "all_gather", elements), Collective("y", "reduce_scatter", elements)
        return (totals([gather, scatter] * sublayers), totals([gather] * sublayers),
                (totals([gather]), totals([scatter])))
    reduce = Collective("y", "all_reduce", elements)
    return totals([reduce] * sublayers), (), ((), totals([reduce]))
