"""fourfold's own runtime: 3D tensor parallelism over (x, y, z) with each linear's backward
collectives overlapped as `parallel.tensor.linear` runs them, z-sharded weights prefetched, the
vocabulary-parallel head, uneven pipeline stages, tied embeddings by sends, expert parallelism
over dp*cp. Its collectives are the volume functions the runtime's ledger is tested against."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fourfold.models.config import ModelConfig
from fourfold.plan.constants import Constants
from fourfold.plan.costs import comm_seconds, gemm_seconds, per_byte, totals, totals_seconds, within_replica
from fourfold.plan.frameworks.base import Framework
from fourfold.plan.memory import Memory, fourfold_memory
from fourfold.plan.routing import exchanged_rows, local_routing
from fourfold.spec.blockspec import LINEAR_KINDS, BlockConfig, attention_chunks, block_plan
from fourfold.spec.hardware import Cluster
from fourfold.spec.job import Job, rank_layers
from fourfold.spec.layout import DEFAULT_ORDER
from fourfold.spec.rules import Problem, padded_vocab, problems
from fourfold.spec.volumes import (
    FORWARD_CHUNKS,
    Collective,
    block_passes,
    embedding_passes,
    head_passes,
    linear_passes,
    tied_copy_sends,
)

# Placement orders the search tries: each tensor dim innermost, then context, data, pipeline.
ORDERS = [DEFAULT_ORDER, ("y", "x", "z", "cp", "dp", "pp"), ("z", "x", "y", "cp", "dp", "pp"),
          ("x", "y", "cp", "z", "dp", "pp")]
# A mixture's also: the data dims innermost, so that an expert group (ep consecutive dp*cp ranks)
# exchanges its tokens inside a node while the tensor dims cross nodes.
EXPERT_ORDERS = [("cp", "dp", "x", "y", "z", "pp")]
VIRTUALS = (2, 4)  # interleaved stages per pipeline rank the search tries


class Fourfold(Framework):
    name = "fourfold"
    keeps_gathered_inputs = True
    hides_param_gather = True  # GradientSync.set_params(overlap=True), the trainer's default

    def __init__(self, forward_chunks: int = FORWARD_CHUNKS):
        """`forward_chunks`: the linears' forward in chunks (OverlapOptions.forward_chunks; 1: the seed
        paper's AxoNN, whose forward collectives wait)."""
        self.forward_chunks = forward_chunks

    def problems(self, cfg: ModelConfig, job: Job) -> list[Problem]:
        return problems(cfg, job, gpu=True)

    def runs_grid(self, cfg: ModelConfig, pp: int, x: int, z: int) -> bool:
        return True

    def placement_orders(self, cfg: ModelConfig) -> list[tuple[str, ...]]:
        return ORDERS + EXPERT_ORDERS * bool(cfg.experts)

    def expert_replicas(self, dp: int, cp: int) -> int:
        return dp * cp

    def virtuals(self, cfg: ModelConfig, pp: int) -> tuple[int, ...]:
        return (1, *VIRTUALS)

    def published_stages(self, layers: int, chunks: int) -> tuple[int, ...]:
        return ()  # the runtime splits uneven layer counts itself

    def memory(self, cfg: ModelConfig, job: Job, memory_gib: float, rule80: bool = True,
               flash_attention: bool = True) -> Memory:
        return fourfold_memory(cfg, job, memory_gib, flash_attention)  # the whole card, term by term: no 80% rule

    def attention_split(self, block: BlockConfig, x: int, y: int) -> int:
        return attention_chunks(block, x, y)

    def head_columns(self, vocab: int, y: int) -> int:
        return padded_vocab(vocab, y)

    def loss_bytes(self, element_bytes: int) -> float:
        """`parallel.tensor.vocab`'s loss, a chunk of tokens at a time: forward the max over the
        logits (e), then each chunk's fp32 cast (e + 4), the max subtracted (8), exp in place (8)
        and the sum (4); backward the chunk's softmax rebuilt from the logits (cast e + 4,
        subtracted 8, exp 8, divided 8), masked (8), scaled (8) and written over the logits (4 + e)."""
        return 72 + 4 * element_bytes

    def update_bytes(self, element_bytes: int) -> tuple[float, float]:
        """`parallel.optimizer.AdamW.step` with the default clip and weight decay, on the shard: the
        global norm reads the gradient (4), the clip coefficient scales it in place (8), the decay
        scales the master weight in place (8; the matrices, nearly every parameter), fused AdamW reads
        weight, gradient and both moments and writes three back (28), the gather copies the weight to
        the model's dtype (4 + e); on every parameter of the rank, the gradient buffer
        zeroed (4: `GradientSync.release`)."""
        return 4 + 8 + 8 + 28 + 4 + element_bytes, 4

    def accumulate_bytes(self, element_bytes: int) -> tuple[float, float]:
        """`GradientSync._on_grad`: autograd's gradient added into the fp32 accumulator, every
        parameter, every micro-batch (read 4 and e, write 4)."""
        return 8 + element_bytes, 8 + element_bytes

    def tensor_comm(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, forward_seconds: float,
                    gemm_tflops: float, gemm_overlap: bool = False) -> float:
        b = s.element_bytes  # bf16 on GPUs
        sizes, batch, seq = within_replica(s), int(s.micro_batch / s.z), int(s.seq / s.cp)
        forward, backward, weights = _layer_totals(cfg.block, sizes, batch, seq, s.seq_parallel,
                                                   s.keep_gathered_inputs)
        passes = 2 if s.recompute == "full" else 1  # the forward's collectives again
        exposed = passes * totals_seconds(forward, s, cluster, b, k) + totals_seconds(backward, s, cluster, b, k)
        # Each linear's input re-gather hides behind its dX GEMM, its input-gradient reduction behind
        # its dW GEMM (the runtime's overlap; both GEMMs take the forward GEMM's time).
        for linear in _overlapped(cfg.block, sizes, batch, seq, s.seq_parallel, s.keep_gathered_inputs,
                                  gemm_tflops, k):
            gemm = linear.gemm
            exposed -= (min(gemm, totals_seconds(linear.regather, s, cluster, b, k))
                        + min(gemm, totals_seconds(linear.input_grad, s, cluster, b, k)))
            # Forward, in chunks (not FP8 tensorwise's GEMMs, nor the routed experts'): each chunk's GEMM,
            # input gather and reduction overlap other chunks' but the first gather and the last reduction.
            if linear.chunked and s.fp8 != "tensorwise" and self.forward_chunks > 1:
                pipelined = [gemm, *(totals_seconds(c, s, cluster, b, k) for c in linear.pipelined)]
                c = self.forward_chunks
                exposed -= passes * (c - 1) / c * (sum(pipelined) - max(pipelined))
        # z: the weight all-gathers are prefetched one GEMM ahead and the dW reduce-scatters deferred
        # to the next one, so they hide behind the layer's compute (3x forward) up to its length.
        weights = totals_seconds(weights, s, cluster, b, k)
        return exposed + max(0.0, weights - 3 * forward_seconds)

    def head_comm(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, tokens: int) -> float:
        return totals_seconds(_head_totals(within_replica(s), cfg.vocab, cfg.hidden, tokens), s, cluster,
                              s.element_bytes, k)

    def pipeline_sends(self, cfg: ModelConfig, s: Job, tokens: float) -> list[Collective]:
        """The residual stream [tokens(/y), hidden/x]: the sequence split over y only under sequence
        parallelism (`spec.volumes.pipeline_sends`)."""
        shard = int(tokens * cfg.hidden / (s.x * (s.y if s.seq_parallel else 1)))
        sends = [Collective("pp", "send", shard)]
        if cfg.experts and cfg.aux_loss:  # a mixture's load-balancing sums beside it
            sends.append(Collective("pp", "send", 2 * cfg.experts, wide=True))
        return sends

    def tied_seconds(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, bubble: float) -> float:
        """`spec.volumes.tied_copy_sends`: the first stage sends its table shard to the last stage's
        copy before the step, exposed; the last stage sends the copy's gradient (fp32) back after its
        last backward, while the first stage still drains its own (about half the bubble: the drain
        of 1F1B), so only what exceeds bubble/2 shows."""
        sizes, n = dict(s.layout.sizes), s.pp * s.virtual
        table = comm_seconds(tied_copy_sends(cfg, sizes, [0], n), s, cluster, s.element_bytes, k)
        gradient = comm_seconds(tied_copy_sends(cfg, sizes, [n - 1], n), s, cluster, s.element_bytes, k)
        return table + max(0.0, gradient - bubble / 2)


FOURFOLD = Fourfold()


def expert_exchange_bytes(cfg: ModelConfig, s: Job) -> dict[str, float]:
    """Bytes rank 0 sends to the other ranks of its expert group in one step, by ledger op
    ("all_to_all": the routing counts, "all_to_all_v": the rows and their gradients), as the step
    time prices them: one layer's collectives (`_layer_totals`, at the routing of `routing.py`),
    the forward's again under full recompute, times the layers of the most loaded pipeline rank
    and the micro-batches. What the runtime's ledger records for ("ep", op)."""
    if not cfg.block.moe or s.layout.ep == 1:
        return {}
    forward, backward, _ = _layer_totals(cfg.block, within_replica(s), int(s.micro_batch / s.z), int(s.seq / s.cp),
                                         s.seq_parallel, s.keep_gathered_inputs)
    out: dict[str, float] = {}
    for summed, times in ((forward, 2 if s.recompute == "full" else 1), (backward, 1)):
        for group, op, width, numel, _ in summed:
            if group == "ep":
                sent = per_byte(op, s.layout.ep) * numel * width.element_bytes(s.element_bytes)
                out[op] = out.get(op, 0.0) + times * sent
    layers = max(rank_layers(cfg.layers, s.pp, s.virtual, s.stage_layers))
    return {op: sent * layers * s.microbatches for op, sent in out.items()}


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
    return (totals([c for c in passes.forward if c.group not in ("cp", "z")]),  # ring attention: separately
            totals([c for c in passes.backward if c.group not in ("cp", "z")]),
            totals([c for c in passes.all() if c.group == "z"]))


@dataclass(frozen=True)
class _LinearOverlap:
    """What one linear layer hides behind its GEMMs (each the forward GEMM's seconds, `gemm`)."""

    gemm: float
    regather: tuple  # backward: its input's re-gather, behind the dX GEMM
    input_grad: tuple  # backward: dX's reduction, behind the dW GEMM
    chunked: bool  # forward: in chunks (`tensor.linear._pipelined_forward`)
    pipelined: tuple  # forward: the collectives pipelined with its chunks (each a `totals`)


@functools.lru_cache(maxsize=65536)
def _overlapped(block, sizes: tuple[tuple[str, int], ...], batch: int, seq: int, seq_parallel: bool,
                keep_inputs: bool, peak_tflops: float, cal: Constants) -> tuple[_LinearOverlap, ...]:
    """What each linear layer hides, as `parallel.tensor.linear` runs it. Backward: the re-gather of
    its input over the out-dim is in flight while dY is gathered and the dX GEMM runs, and the input
    gradient's all-reduce (or reduce-scatter) over the out-dim while the dW GEMM runs; the gather of
    dY over the in-dim waits. Forward (`forward_chunks`): the output's reduction over the in-dim and,
    chunked by tokens, a token gather of its input over the out-dim; the routed experts' linears run
    as one grouped GEMM, unchunked. From the volume functions the runtime's ledger is tested against."""
    grid = dict(sizes)
    plan = block_plan(block, grid["x"], grid["y"], seq_parallel=seq_parallel)
    tokens = batch * seq
    layers = [(plan.qkv, tokens, True), (plan.out, tokens, True)]
    if block.moe:
        layers += ([(plan.shared_up, tokens, True), (plan.shared_down, tokens, True)]
                   if plan.shared_up is not None else [])
        layers += [(layer, n, False) for n in local_routing(block, tokens, grid["ep"])
                   for layer in (plan.up, plan.down)]
    else:
        layers += [(plan.up, tokens, True), (plan.down, tokens, True)]
    out = []
    for layer, n, runs_alone in layers:
        i, o = LINEAR_KINDS[layer.kind]
        passes = linear_passes(grid, layer.kind, layer.in_features, layer.out_features, n,
                               reduction=layer.reduction, input_gather=layer.input_gather, keep_input=keep_inputs)
        gemm = gemm_seconds(n, layer.in_features / grid[i], layer.out_features / grid[o], peak_tflops, cal)
        gathers_tokens = layer.input_gather == "tokens" and grid[o] > 1
        chunked = runs_alone and (grid[i] > 1 or gathers_tokens)
        pipelined = [totals([c for c in passes.forward if c.group == i])]
        if gathers_tokens:
            pipelined.append(totals([c for c in passes.forward if c.group == o]))
        out.append(_LinearOverlap(
            gemm, totals([c for c in passes.backward if c.group == o and c.op == "all_gather"]),
            totals([c for c in passes.backward if c.group == o and c.op != "all_gather"]), chunked, tuple(pipelined)))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _head_totals(sizes: tuple[tuple[str, int], ...], vocab: int, hidden: int, tokens: int):
    """The embedding's and the LM head's collectives for one micro-batch, summed."""
    grid = dict(sizes)
    return totals(embedding_passes(grid, vocab, hidden, tokens).all() + head_passes(grid, hidden, vocab, tokens).all())
