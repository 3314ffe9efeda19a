"""Memory per GPU of one training configuration.

The two framework profiles' formulas (`plan.frameworks` chooses):
- `megatron`: the closed formulas of arXiv 2411.06465 for Megatron-LM (bf16, flash attention,
  sequence parallelism, distributed optimizer, 1F1B), reproduced exactly; first pipeline stage;
  with the seed paper's rule that a configuration fits when the estimate is under 80% of the card.
- `fourfold`: fourfold's own runtime, term by term (z-sharded weights and their gathered copies,
  the tensors each layer saves for backward, in-flight micro-batches, logits, communication
  buffers, CUDA context, fragmentation), compared with the whole card.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fourfold.models.config import ModelConfig
from fourfold.plan.routing import expert_params, head_params, replicated_params, routed_tokens
from fourfold.spec.blockspec import LINEAR_KINDS, BlockConfig, block_plan, mlp_chunks
from fourfold.spec.counts import layer_params
from fourfold.spec.job import Job, most_layers_on_a_rank
from fourfold.spec.rules import loss_chunk_tokens, padded_vocab
from fourfold.spec.schedule import held_layers

GIB = 2**30

# Terms the 80% rule stands for, modelled (assumptions to calibrate; docs/planner.md).
CUDA_CONTEXT_BYTES = 0.5 * GIB
NCCL_BYTES_PER_COMMUNICATOR = 32 * 2**20
FRAGMENTATION = 0.05  # of the dynamic (activation and buffer) bytes
BUCKET_BYTES = 25 * 2**20  # GradientSync's default bucket (fp32)


@dataclass
class Memory:
    terms: dict[str, float] = field(default_factory=dict)  # bytes
    limit_bytes: float = 0.0
    replicas: int = 1  # ranks holding the same weights (dp*cp): they share the writing of them
    expert_replicas: int = 1  # with expert parallelism: the ranks holding the same experts (dp*cp/ep)
    expert_weights: float = 0.0  # bytes of the "weights" term that are experts' (their replicas share them)

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def gib(self) -> float:
        return self.total / GIB

    @property
    def fits(self) -> bool:
        return self.total <= self.limit_bytes

    @property
    def checkpoint_host_bytes(self) -> float:
        """Host memory an async checkpoint save stages: its share of the weights (the `replicas`
        write whole parameters, about 1/n each: a rank may stage up to one parameter more) and
        its optimizer share (what it writes). A save or load adds nothing on the GPU: both use
        the rank's own tensors."""
        weights = self.terms.get("weights", self.terms.get("weights_and_grads", 0.0) / 3)
        dense = weights - self.expert_weights
        return dense / self.replicas + self.expert_weights / self.expert_replicas + self.terms["optimizer"]

    def breakdown_gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.terms.items()}


def megatron_memory(cfg: ModelConfig, s: Job, memory_gib: float, rule80: bool = True) -> Memory:
    """The seed paper's formulas (first pipeline stage), bytes; t = TP (y), c = CP, p = PP, d = DP."""
    h, F, a, k, v, L = cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.vocab, cfg.layers
    t, c, p, d, b, seq = s.y, s.cp, s.pp, s.dp, s.micro_batch, s.seq
    matrices, vectors = layer_params(cfg)
    replicated = replicated_params(cfg.block)  # a mixture's router (and shared gate), not split
    experts = expert_params(cfg.block)  # ours: a mixture's experts also split over the ep ranks
    ep = s.layout.ep
    stage = most_layers_on_a_rank(L, s)  # L / p when the layers divide evenly
    # the dense parameters, and the embedding on the first stage
    params = stage * ((matrices - replicated - experts) / t + replicated + vectors) + h * v / t
    if p == 1:
        params += (0 if cfg.tied else h * v / t) + h  # LM head and final norm on the same stage
    expert_held = stage * experts / (t * ep)
    if s.recompute == "full":  # our extension: each layer keeps its bf16 input, sequence-parallel
        per_layer = 2 * (seq / c) * b * h / t
    elif cfg.block.moe:  # ours: the MLP's terms for the top_k experts a token runs (and a shared one),
        # the router's logits (bf16) and probabilities (fp32), replicated over t
        F = routed_tokens(cfg.block, F) + cfg.block.shared_ffn
        per_layer = (seq / c) * b * (h * (12 + 4 * k / a + 8 * F / h) / t + 6 * cfg.block.experts)
    else:  # flash attention: selective recompute keeps the same tensors
        per_layer = (seq / c) * b * h * (12 + 4 * k / a + 8 * F / h) / t
    terms = {
        "weights_and_grads": (params + expert_held) * (2 + 4),
        # the distributed optimizer: dense parameters over dp*cp, an expert's over its dp*cp/ep replicas
        "optimizer": params * 12 / (d * c) + expert_held * 12 / (d * c // ep),
        # 1F1B: p micro-batches of a stage's layers in flight; interleaved over v chunks (ours, as the
        # schedule holds them: p (1 + (p - 1) / (p v)) of a stage's layers, Korthikanti et al. 2022, when m > p)
        "activations": (held_layers(L, p, s.virtual, s.microbatches, s.schedule) if s.virtual > 1 else p * stage)
                       * per_layer,
        "first_stage_inputs": 8 * (seq / c) * b * h * p / t,
    }
    if p == 1:
        terms["logits"] = 4 * (seq / c) * b * h * (1 + v / h) / t
    limit = memory_gib * GIB * (0.8 if rule80 else 1.0)
    return Memory(terms, limit, replicas=d * c, expert_replicas=d * c // ep, expert_weights=2 * expert_held)


def fourfold_memory(cfg: ModelConfig, s: Job, memory_gib: float, flash_attention: bool = True,
                    gloo: bool = False) -> Memory:
    """fourfold's runtime on the most loaded pipeline stage, bytes, against the whole card; `gloo`:
    on CPU processes, whose reduce-scatter (an all-to-all) receives into a second buffer. A model
    whose layers are of several kinds (DeepSeek-V3's first dense layers) is each kind's memory
    weighted by its share of the layers: exact for the terms that add up over layers (weights,
    gradients, optimizer state, activations), the average of the others."""
    kinds = dict(cfg.layer_kinds)
    if len({(b.experts, b.ffn, b.mla) for b in kinds}) == 1:  # (windows and RoPE change no byte)
        return _uniform_memory(cfg, cfg.block, s, memory_gib, flash_attention, gloo)
    parts = [(n / cfg.layers, _uniform_memory(cfg, b, s, memory_gib, flash_attention, gloo)) for b, n in kinds.items()]
    terms = {k: sum(share * m.terms[k] for share, m in parts) for k in parts[0][1].terms}
    first = parts[0][1]
    return Memory(terms, first.limit_bytes, replicas=first.replicas, expert_replicas=first.expert_replicas,
                  expert_weights=sum(share * m.expert_weights for share, m in parts))


def _uniform_memory(cfg: ModelConfig, blk: BlockConfig, s: Job, memory_gib: float, flash_attention: bool,
                    gloo: bool) -> Memory:
    """`fourfold_memory` of the model with every layer's block `blk`."""
    h, v, L = cfg.hidden, padded_vocab(cfg.vocab, s.y), cfg.layers  # the tables' rows, padded to a multiple of y
    x, y, z, c, p = s.x, s.y, s.z, s.cp, s.pp
    d = blk.head_dim
    matrices, vectors = layer_params(cfg, block=blk)
    replicated = replicated_params(blk)  # a mixture's router and shared gate, the latents: split over x only
    experts = expert_params(blk)  # a mixture's experts: split over x, y, z and over the ep ranks
    heads = head_params(blk)  # latent attention's per-head projections: by head group, not over z
    ep, replicas = s.layout.ep, s.dp * c
    layers_here = most_layers_on_a_rank(L, s)
    expert_held = layers_here * experts / (x * y * z * ep)
    chunks = block_plan(blk, x, y, seq_parallel=s.seq_parallel).attention_chunks
    params = layers_here * ((matrices - replicated - experts - heads) / (x * y * z) + (vectors + replicated) / x
                            + heads / chunks)
    embed = h * v / (x * y * z)
    # Tied with pp > 1, the last stage holds a copy of the table that is no parameter: its weights and
    # an fp32 gradient, (e + 4) bytes an element, less than the first stage's table with its optimizer
    # state (e + 4 + 12 / (dp*cp)): max(first, last) is the first's, counted here as the embedding.
    head = 0 if cfg.tied else embed
    params += max(embed, head) if p > 1 else embed + head + h / x  # first or last stage; both when p = 1
    # ZeRO-1: the dense parameters' optimizer state over the dp*cp ranks, the experts' over their
    # dp*cp/ep replicas (the same bytes per rank as without expert parallelism: 1/ep of the experts
    # over 1/ep of the ranks)
    sharded = params / replicas + expert_held / (replicas // ep)
    params += expert_held
    # Activations saved for backward by one layer on this rank, as measured by autograd's saved
    # tensors (tests/plan/test_planner_measured.py holds the whole step's peak to these terms).
    e = s.element_bytes
    T = (s.seq / c) * (s.micro_batch / z)  # tokens on this rank
    Ts = T / y if s.seq_parallel else T  # tokens of the residual stream
    plan = block_plan(blk, x, y, seq_parallel=s.seq_parallel)
    heads_local, kv, ffn_local = plan.local_heads, plan.local_kv_heads, plan.local_ffn
    up_rows = plan.up.out_features / plan.mlp_chunks

    def saved_input(layer) -> float:
        """The input a linear layer keeps for backward: local (gathered again in backward), or as
        gathered over its out-dim with keep_gathered_inputs."""
        gathered = T * layer.in_features / (x if layer.in_dim == "x" else y)
        if layer.input_gather == "none" or s.keep_gathered_inputs:
            return gathered
        return gathered / (x if layer.out_dim == "x" else y)
    math_path = not flash_attention and c == 1  # ring attention (cp > 1) keeps no probabilities
    # The flash kernel's output, [b, s, heads, d] in memory, is the out-projection's input as it is (a view:
    # counted there); ring attention's merged output is a tensor of its own.
    attention = ({"attention probabilities": (s.micro_batch / z) * heads_local * (s.seq / c) ** 2} if math_path else
                 {"attention output and stats": (T * heads_local * d if c > 1 else 0.0) + T * heads_local / d})
    saved = {
        # (and a [tokens] fp32 statistic: the rest is recomputed in backward); Gemma's post-norms: 4
        "norm inputs": (4 if blk.post_norms else 2) * Ts * h / x,
        "qkv input": saved_input(plan.qkv),
        "q, k, v": T * (heads_local + 2 * kv) * d,
        # q/k norms keep their inputs, views of the QKV output, so all of it stays alive
        "qkv output": T * (heads_local + 2 * kv) * d if blk.qk_norm or blk.qk_norm_all_heads else 0.0,
        **attention,
        "rope tables": (2 * (s.seq / c) * (blk.rope_dim if blk.mla else d)) if blk.rope else 0.0,  # for q and k
        "out-proj input": saved_input(plan.out),
        "mlp input": saved_input(plan.up),
        "gate/up output": T * up_rows,
        # GELU's output (GeGLU's gelu(gate) too); SwiGLU keeps only its inputs (the gate/up output: block._SwiGLU)
        "activation output": 0.0 if blk.activation == "swiglu" else T * ffn_local,
        "down input": saved_input(plan.down),
    }
    if blk.mla:  # the stream (gathered over y with sequence parallelism), the latents before and after their
        # norms (kv's with its rotary part), q, k and V padded to their head size, the kernel's output
        saved.update({
            "qkv input": T * h / x,
            "q, k, v": 3 * T * heads_local * d,
            "latents": T * (2 * blk.q_lora + 2 * blk.kv_lora + blk.rope_dim),
            "attention output and stats": T * heads_local * d + T * heads_local / d,
        })
    if blk.moe:  # the experts on top_k * T tokens in all (whatever the routing, without expert parallelism;
        # with it, the rows this rank's experts received from the ep group: top_k * T at a balanced routing)
        routed = routed_tokens(blk, T) / T
        chosen = blk.top_k * T * h / x  # this rank's own choices' rows: top_k * T whatever the routing
        saved.update({
            "mlp input": T * h / x,  # the stream (gathered over y first with sequence parallelism), the router's input
            "gate/up output": routed * T * up_rows,
            "activation output": 0.0 if blk.activation == "swiglu" else routed * T * ffn_local,
            "down input": routed * saved_input(plan.down),
            # kept by their product with the routing weights (with expert parallelism: as they came back)
            "expert outputs": chosen,
            # Measured under fake tensors (tests/plan/test_planner_measured.py): the experts' rows (the
            # tokens of their choices, or with expert parallelism the rows the ep ranks sent: the gate/up
            # GEMM's input) and, without expert parallelism, one more [top_k * T, h/x] (with it, the rows
            # back from the all-to-all are the only outputs kept: 1/top_k less of T*h per layer, measured).
            "expert inputs": routed * T * h / x,
            "weighted expert outputs": chosen if ep == 1 else 0.0,
            "router logits and probabilities": T * blk.experts * (e + max(e, 4)) / e,  # softmax in fp32 at least
        })
        if plan.shared_up is not None:  # a dense MLP of shared_ffn on every token, and its gate's output
            chunks = mlp_chunks(blk, x, y, ffn=blk.shared_ffn)
            saved.update({
                "shared gate/up output": T * plan.shared_up.out_features / chunks,
                "shared activation output": 0.0 if blk.activation == "swiglu" else T * blk.shared_ffn / chunks,
                "shared down input": saved_input(plan.shared_down),
                "shared output": T * h / x + T,
            })
    per_layer = e * sum(saved.values())
    # Selective recompute redoes the attention core (RoPE and the kernel) in backward: it rebuilds q, k, v
    # and the attention's outputs, and keeps the core's input, qkv, as large as the rotated q, k, v: what it
    # saves there is the attention's outputs (with the math path, the probabilities; with flash, little).
    # Eager (the default), it also rebuilds the down projection's input from the gate/up output
    # (block.rebuilt_in_backward) and the norms' outputs where the next GEMM keeps its local input (they
    # are that input); under train.compile they are kept, which this does not count.
    core = e * (saved["q, k, v"] + sum(attention.values()))
    selective_drops = e * (sum(attention.values()) + saved["down input"])
    for layer, term in ((plan.qkv, "qkv input"), (None if blk.moe else plan.up, "mlp input")):
        if layer is not None and (layer.input_gather == "none" or not s.keep_gathered_inputs):
            selective_drops += e * saved[term]
    working = experts_forward = 0.0  # what a layer's backward (forward) holds beyond the saved tensors
    if blk.moe:
        # A rank's experts run as one (`parallel.tensor.experts`), so their gate/up projection holds its
        # transients for all their rows at once, beside the experts' weight blocks: stacked for the grouped
        # GEMM (bf16), a copy; else (the loop) a list of the blocks, copies only where gathered over z:
        # in forward the GEMM's output and, reduce-scattered over
        # features, its chunks (with gloo also those received) and this rank's part; in backward dY
        # gathered over its in-dim and dX before its reduction, then the weight gradients.
        in_dim, out_dim = LINEAR_KINDS[plan.up.kind]
        size_in, size_out = s.layout.sizes[in_dim], s.layout.sizes[out_dim]
        n_block, k_block = plan.up.out_features / size_out, plan.up.in_features / size_in
        stacked = (blk.experts // ep if e == 2 or s.z > 1 else 0) * n_block * k_block
        rows = routed_tokens(blk, T)
        working += e * (rows * (n_block + k_block) + stacked)
        scatter = plan.up.reduction == "scatter_features" and size_in > 1
        copies = 2 + 1 / size_in + (1 if gloo else 0) if scatter else 1
        # (at the last layer's gate/up GEMM, less that layer's tensors saved after it)
        later = sum(saved[k] for k in ("gate/up output", "activation output", "down input", "expert outputs",
                                       "weighted expert outputs"))
        experts_forward = e * (rows * n_block * copies + stacked - later)
    if s.recompute == "full":
        per_layer_kept, working = e * Ts * h / x, per_layer + working
    elif s.recompute == "selective":
        per_layer_kept = per_layer - selective_drops
        working += core
    else:
        per_layer_kept = per_layer
    # the most layers' saved tensors a pipeline rank holds at once, micro-batches in flight counted
    activations = per_layer_kept * (held_layers(L, p, s.virtual, s.microbatches, s.schedule, s.stage_layers)
                                    if p > 1 else layers_here)
    # The largest weight block of one matrix on this rank (before the z split): with z > 1 it is
    # gathered (bf16) while its layer runs, and its gradient block exists before the z reduce-scatter.
    layer_block = max(layer.in_features * layer.out_features for layer in plan.linears
                      if not (blk.mla and layer is plan.qkv)) / (x * y)  # (latent attention has no QKV projection)
    largest_block = max(layer_block, h * v / (x * y))
    head_block = h * v / (x * y)
    gathered = e * largest_block if z > 1 else 0.0
    # Forward, at the loss: every layer's saved tensors, the final norm's input and output, the head's
    # gathered weight and the larger of: the head GEMM's partial logits [T, V/y] with this x rank's
    # reduce-scattered 1/x of them, and the loss on those (kept, and one chunk of tokens in fp32:
    # its cast below fp32 and its shifted exponentials; `rules.loss_chunk_tokens`).
    scored = T / x  # the head keeps this x rank's tokens
    scatter = e * T * v / y * (1 + 1 / x + (1 if gloo else 0)) if x > 1 else 0.0
    chunk = min(scored, loss_chunk_tokens(v // y)) * v / y * (4 + (4 if e < 4 else 0))
    logits = max(scatter, scored * v / y * e + chunk) + 2 * e * Ts * h / x
    forward = activations + max(logits, experts_forward) + gathered
    # Backward, the larger of: the head's (the logits, a chunk's fp32 gradient written over them, or
    # their gradient with its gather over x for the head's GEMMs; the gathered weight and the weight-gradient
    # block) and a recomputed layer. Ring attention runs the flash kernel per block: no [T x T] scores.
    # With z > 1 the head's weight is gathered, its gradient block reduce-scattered (summed in fp32:
    # below fp32 a copy of the block and its shard in fp32), and the next layer's weight already
    # prefetched.
    reduced = (4 * head_block * (1 + 1 / z) if e < 4 else e * head_block / z)
    head_weights = e * head_block * 2 + reduced + e * layer_block if z > 1 else e * head_block
    head_backward = max(scored * v / y * e + chunk + (e * head_block if z > 1 else 0.0),  # at the loss
                        e * T * v / y * (1 + 1 / x if x > 1 else 1) + head_weights)  # at the GEMMs
    backward = activations + max(head_backward, working)
    # Optimizer step: the largest bucket's updated parameters gathered in their dtype (ZeRO-1).
    largest_bucket = max(largest_block / z, BUCKET_BYTES / 4)
    optimizer_step = e * largest_bucket * (1 + 1 / (s.dp * c)) if s.dp * c > 1 else 0.0
    dynamic = max(forward, backward, optimizer_step)
    groups = sum(1 for n in (s.dp, s.pp, s.cp, x, y, z) if n > 1) + (1 if s.dp * s.cp > max(s.dp, s.cp) else 0)
    groups += 2 if 1 < ep < replicas else 0  # expert parallelism's ep and edp groups (else one is dp*cp's)
    terms = {
        "weights": e * params,
        "gradients": 4 * params,  # fp32 accumulators, one flat buffer per bucket, reduced in place
        "optimizer": 12 * sharded,  # fp32 master + Adam m, v; ZeRO-1 over dp*cp (experts: dp*cp/ep)
        # The peak of the step is the largest phase's: the terms below add up to it.
        "activations": activations,
        "logits": logits,
        "experts_forward_extra": max(0.0, experts_forward - logits),  # a mixture's transients beyond the loss's
        "gathered_weights": gathered,
        "backward_extra": max(0.0, backward - forward),
        "optimizer_step_extra": max(0.0, optimizer_step - max(forward, backward)),
        "ring_attention": (2 * 2 * e * T * kv * d) if c > 1 else 0.0,
        "nccl": NCCL_BYTES_PER_COMMUNICATOR * groups,
        "cuda_context": CUDA_CONTEXT_BYTES,
        "fragmentation": FRAGMENTATION * dynamic,
    }
    # The trainer's checkpoint replicas (`params.Replicas`): the dp*cp ranks, an expert's its expert replicas
    return Memory(terms, memory_gib * GIB, replicas=replicas, expert_replicas=replicas // ep,
                  expert_weights=e * expert_held)

