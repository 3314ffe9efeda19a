"""Communication volumes: the one place where fourfold states how many bytes a collective moves.

The runtime's ledger (`fourfold.parallel.comm`), the tests and the planner all use these functions, so a
measured byte count and a predicted one can be compared for equality.

A collective is priced by the ring algorithm, per rank, for a full message of M bytes on a
group of g ranks (the message is the all-gather's output, the reduce-scatter's input, the
all-reduce's buffer, the all-to-all's input):

    all-gather, reduce-scatter, all-to-all:  (g - 1) / g * M
    all-reduce:                          2 * (g - 1) / g * M
    send (point to point):                               M

Figures are exact fractions so that sums of many collectives compare exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from fourfold.spec.blockspec import LINEAR_KINDS, BlockConfig, LinearPlan, attention_chunks, block_plan
from fourfold.spec.ring import fetches_windows, window_reach
from fourfold.spec.rules import padded_vocab

if TYPE_CHECKING:  # comm imports this module for `bytes_sent`: it needs no model config
    from fourfold.models.config import ModelConfig

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_to_all_v", "send")


def bytes_sent(op: str, group_size: int, message_bytes: int) -> Fraction:
    """Bytes one rank sends for `op` over a full message of `message_bytes` on `group_size` ranks."""
    g = group_size
    if g < 1:
        raise ValueError(f"group size {g} must be >= 1")
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction(g - 1, g) * message_bytes
    if op == "all_reduce":
        return Fraction(2 * (g - 1), g) * message_bytes
    if op in ("send", "all_to_all_v"):  # an uneven all-to-all's message: the bytes sent to the others
        return Fraction(message_bytes)
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVES)}")


# ----- the collectives of 3D tensor-parallel layers (fourfold.parallel.tensor), per rank ---------------
# Each function gives the collectives of one forward pass and of one backward pass, as
# (group, op, elements of the full message), groups of one rank left out.


@dataclass(frozen=True)
class Collective:
    group: str
    op: str
    numel: int
    wide: bool = False  # sent in fp32 at least whatever the dtype (gradient sums: z's dW, ring attention's dK, dV)
    integer: bool = False  # int64 whatever the dtype (a mixture's routing counts)

    def element_bytes(self, element_size: int) -> int:
        return 8 if self.integer else max(element_size, 4) if self.wide else element_size


@dataclass(frozen=True)
class Passes:
    forward: list[Collective]
    backward: list[Collective]

    def __add__(self, other: "Passes") -> "Passes":
        return Passes(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, times: int) -> "Passes":
        return Passes(self.forward * times, self.backward * times)

    def all(self) -> list[Collective]:
        return self.forward + self.backward


def group_size(sizes: dict, group: str) -> int:
    """Ranks of a group named like a ledger entry: one dim ("x") or several ("x_y": the product)."""
    n = 1
    for dim in group.split("_"):
        n *= sizes.get(dim, 1)
    return n


def _passes(sizes: dict, forward: list[Collective], backward: list[Collective]) -> Passes:
    return Passes([c for c in forward if group_size(sizes, c.group) > 1],
                  [c for c in backward if group_size(sizes, c.group) > 1])


def padded_block(sizes: dict, rows: int, cols: int) -> int:
    """Elements of a weight block once padded to equal z shards (what the z collectives move)."""
    return -(-rows * cols // sizes["z"]) * sizes["z"]


# A linear's forward GEMM runs in this many chunks, each chunk's collectives in flight behind another
# chunk's GEMM (`parallel.overlap.OverlapOptions.forward_chunks`; the planner prices it so)
FORWARD_CHUNKS = 2


def linear_passes(sizes: dict, kind: str, in_features: int, out_features: int, tokens: int, *,
                  reduction: str = "all_reduce", input_gather: str = "none", keep_weight: bool = False,
                  keep_input: bool = False) -> Passes:
    """A `ParallelLinear` on `tokens` local tokens (after any gather of its input); a gathered
    input is gathered again in backward unless `keep_input`."""
    i, o = LINEAR_KINDS[kind]
    k_local, n_local = in_features // sizes[i], out_features // sizes[o]
    block = padded_block(sizes, n_local, k_local)
    scatter = reduction != "all_reduce"
    forward = [Collective(o, "all_gather", tokens * k_local)] if input_gather != "none" else []
    forward += [Collective("z", "all_gather", block),
                Collective(i, "reduce_scatter" if scatter else "all_reduce", tokens * n_local)]
    backward = [Collective(o, "all_gather", tokens * k_local)] if input_gather != "none" and not keep_input else []
    backward += [Collective(i, "all_gather", tokens * n_local)] if scatter else []
    backward += [] if keep_weight else [Collective("z", "all_gather", block)]
    backward += [Collective(o, "all_reduce" if input_gather == "none" else "reduce_scatter", tokens * k_local),
                 Collective("z", "reduce_scatter", block, wide=True)]
    return _passes(sizes, forward, backward)


def norm_passes(sizes: dict, kind: str, tokens: int) -> Passes:
    """Statistics all-reduced over x: RMSNorm one [tokens] sum, LayerNorm two; as many in backward
    (in fp32 at least, as `tensor.norm` computes them)."""
    stats = [Collective("x", "all_reduce", tokens, wide=True)] * (2 if kind == "layer" else 1)
    return _passes(sizes, stats, stats)


def head_norm_passes(cfg: BlockConfig, sizes: dict, tokens: int, *, non_redundant: bool = True) -> Passes:
    """OLMoE's q and k norms over all heads' features (`BlockConfig.qk_norm_all_heads`, `tensor.norm.AllHeadsNorm`)
    on the attention's `tokens` (all of this cp rank's, gathered over y with sequence parallelism): each
    all-reduces one per-token sum over the ranks holding the other heads (`BlockPlan.head_group`) in forward
    and one in backward, in fp32 at least. Part of the attention core (selective recompute runs it again)."""
    if not cfg.qk_norm_all_heads:
        return Passes([], [])
    group = block_plan(cfg, sizes["x"], sizes["y"], seq_parallel=False, non_redundant=non_redundant).head_group
    stats = [Collective(group, "all_reduce", tokens, wide=True)] * 2  # q's and k's
    return _passes(sizes, stats, stats)


def ring_attention_passes(cfg: BlockConfig, sizes: dict, batch: int, seq: int, *, non_redundant: bool = True,
                          cp_rank: int | None = None) -> Passes:
    """Ring attention over cp (`fourfold.parallel.context`) on `batch` sequences of `seq` local tokens:
    keys and values go round the ring in forward and again in backward, and the dK, dV
    accumulators (fp32 at least) make the whole round back to their owner. Under a sliding window
    that some rank's queries reach only part of the ring with (`ring.fetches_windows`), each rank
    sends its K and V to the ranks that reach it, and in backward the dK, dV of each block it fetched
    back to its owner: cp rank `cp_rank`'s, or the busiest rank's (None)."""
    cp = sizes["cp"]
    kv_heads = cfg.kv_heads // attention_chunks(cfg, sizes["x"], sizes["y"], non_redundant)
    block = Collective("cp", "send", batch * kv_heads * seq * cfg.head_dim)
    accumulator = Collective("cp", "send", block.numel, wide=True)
    if fetches_windows(cp, seq, cfg.window):
        reach = window_reach(cp, seq, cfg.window)

        def sends(r: int) -> tuple[int, int]:  # (blocks given to the ranks reaching r, blocks r fetched)
            return sum(r in reach[o] for o in range(cp) if o != r), len(reach[r]) - 1

        given, fetched = sends(cp_rank) if cp_rank is not None else max(map(sends, range(cp)), key=sum)
        return _passes(sizes, [block] * 2 * given, [accumulator] * 2 * fetched)
    return _passes(sizes, [block] * 2 * (cp - 1), [block] * 2 * (cp - 1) + [accumulator] * 2 * cp if cp > 1 else [])


def block_passes(cfg: BlockConfig, sizes: dict, batch: int, seq: int, *, seq_parallel: bool = False,
                 keep_weights: bool = False, keep_inputs: bool = False, non_redundant: bool = True,
                 routed: tuple[int, ...] = (), exchanged: tuple[int, int] = (0, 0),
                 cp_rank: int | None = None) -> Passes:
    """One `ParallelBlock` on `batch` local sequences of `seq` tokens (this cp rank's): its block plan's
    layers; a mixture's at a given routing, `routed` tokens to each of this rank's experts
    (`ParallelMoE.routed`) and, with expert parallelism (`sizes["ep"]` > 1), the rows it sent to and
    received from the other ranks of its expert group (`ParallelMoE.exchanged`)."""
    plan = block_plan(cfg, sizes["x"], sizes["y"], seq_parallel=seq_parallel, non_redundant=non_redundant)
    tokens = batch * seq
    stream = tokens // sizes["y"] if seq_parallel else tokens  # tokens of the residual stream on this rank

    def linear(layer: LinearPlan, n: int = tokens) -> Passes:
        return linear_passes(sizes, layer.kind, layer.in_features, layer.out_features, n,
                             reduction=layer.reduction, input_gather=layer.input_gather, keep_weight=keep_weights,
                             keep_input=keep_inputs)

    if not cfg.moe:
        mlp = linear(plan.up) + linear(plan.down)
    elif len(routed) != cfg.experts // sizes.get("ep", 1):
        raise ValueError(f"a mixture's collectives depend on its routing: give the tokens routed to each of its "
                         f"{cfg.experts // sizes.get('ep', 1)} experts on a rank (ParallelMoE.routed), not {routed}")
    else:  # `fourfold.parallel.tensor.moe`
        features = tokens * (cfg.hidden // sizes["x"])
        mlp = _passes(sizes, [Collective("y", "all_gather", features)] if seq_parallel else [], [])  # the tokens
        # router logits (DeepSeek-V3's in fp32 at least)
        mlp += _passes(sizes, [Collective("x", "all_reduce", tokens * cfg.experts, wide=cfg.routing != "softmax")],
                       [Collective("x", "all_reduce", tokens * cfg.top_k)])  # the weights' gradient
        sent, received = (n * (cfg.hidden // sizes["x"]) for n in exchanged)
        # expert parallelism: the counts, the rows out to the experts' ranks and back (their gradients reversed)
        mlp += _passes(sizes, [Collective("ep", "all_to_all", cfg.experts, integer=True),
                               Collective("ep", "all_to_all_v", sent), Collective("ep", "all_to_all_v", received)],
                       [Collective("ep", "all_to_all_v", received), Collective("ep", "all_to_all_v", sent)])
        for n in routed:
            mlp += linear(plan.up, n) + linear(plan.down, n)
        if plan.shared_up is not None:  # its gate's logit and gradient, as the router's (DeepSeek-V3's: no gate)
            if cfg.shared_gate:
                mlp += _passes(sizes, [Collective("x", "all_reduce", tokens)], [Collective("x", "all_reduce", tokens)])
            mlp += linear(plan.shared_up) + linear(plan.shared_down)
        mlp += _passes(sizes, [], [Collective("y", "all_gather", features)] if seq_parallel else [])  # own tokens
    norms = norm_passes(sizes, cfg.norm, stream) * (2 if cfg.post_norms else 1)  # (before and after: Gemma's)
    if cfg.mla:
        attention = latent_attention_passes(cfg, plan, sizes, tokens, seq_parallel=seq_parallel)
    else:
        attention = linear(plan.qkv) + head_norm_passes(cfg, sizes, tokens, non_redundant=non_redundant)
    return (norms + attention + ring_attention_passes(cfg, sizes, batch, seq, non_redundant=non_redundant,
                                                      cp_rank=cp_rank)
            + linear(plan.out) + norms + mlp)


def latent_attention_passes(cfg: BlockConfig, plan, sizes: dict, tokens: int, *, seq_parallel: bool) -> Passes:
    """Multi-head latent attention's own collectives (`parallel.tensor.latent`) on `tokens` (this cp
    rank's): with sequence parallelism the stream's tokens gathered over y (each rank keeps its part
    of the gradient: none back); the two latents' products all-reduced over x; in backward the
    gradients of the query latent, the kv latent and the rotary key all-reduced over the head group."""
    gather = [Collective("y", "all_gather", tokens * (cfg.hidden // sizes["x"]))] if seq_parallel else []
    latents = [Collective("x", "all_reduce", tokens * cfg.q_lora),
               Collective("x", "all_reduce", tokens * (cfg.kv_lora + cfg.rope_dim))]
    grads = [Collective(plan.head_group, "all_reduce", tokens * n) for n in (cfg.q_lora, cfg.kv_lora, cfg.rope_dim)]
    return _passes(sizes, gather + latents, grads)


def block_collectives(cfg: BlockConfig, sizes: dict, batch: int, seq: int, **options) -> list[Collective]:
    """One `ParallelBlock` forward and backward (see `block_passes`)."""
    return block_passes(cfg, sizes, batch, seq, **options).all()


def embedding_passes(sizes: dict, vocab: int, hidden: int, tokens: int, *, seq_parallel: bool = False) -> Passes:
    """A `ParallelEmbedding` on `tokens` local tokens (full sequences), its table padded to `padded_vocab` rows."""
    table = padded_block(sizes, padded_vocab(vocab, sizes["y"]) // sizes["y"], hidden // sizes["x"])
    out = tokens * (hidden // sizes["x"])
    if seq_parallel:
        forward, backward = [Collective("y", "reduce_scatter", out)], [Collective("y", "all_gather", out)]
    else:
        forward, backward = [Collective("y", "all_reduce", out)], []
    return _passes(sizes, [Collective("z", "all_gather", table)] + forward,
                   backward + [Collective("z", "reduce_scatter", table, wide=True)])


def head_passes(sizes: dict, hidden: int, vocab: int, tokens: int, *, seq_parallel: bool = False,
                keep_weight: bool = False, keep_input: bool = False) -> Passes:
    """The LM head and the loss on `tokens` local tokens: logits reduce-scattered over x by tokens,
    the cross-entropy's three all-reduces over y on this x rank's tokens (max, sum of exponentials,
    target logit), and the per-token losses gathered over x. The head has `padded_vocab` rows."""
    scored = tokens // sizes["x"]
    loss = _passes(sizes, [Collective("y", "all_reduce", scored)] * 3 + [Collective("x", "all_gather", tokens)], [])
    return linear_passes(sizes, "x-in", hidden, padded_vocab(vocab, sizes["y"]), tokens, reduction="scatter_tokens",
                         keep_weight=keep_weight, keep_input=keep_input,
                         input_gather="tokens" if seq_parallel else "none") + loss


def model_collectives(cfg: ModelConfig, sizes: dict, batch: int, seq: int, *, seq_parallel: bool = False,
                      keep_weights: bool = False, keep_inputs: bool = False, non_redundant: bool = True,
                      recompute: str = "none", layers: int | None = None, first: bool = True,
                      last: bool = True, routing: list[tuple[int, ...]] | None = None,
                      exchanged: list[tuple[int, int]] | None = None, cp_rank: int | None = None) -> list[Collective]:
    """A `Transformer` forward and backward, loss included, on `batch` local sequences of `seq`
    tokens (this cp rank's); for a pipeline stage, its number of `layers` and whether it is the
    `first` (embedding) or `last` (head and loss); a mixture's at the `routing` of each layer (the
    tokens routed to each of a rank's experts) and, with expert parallelism, the rows each layer
    `exchanged` (sent, received) with the other ranks of its expert group. Gradient synchronisation
    is not included, nor a mixture's sum of its routing counts over the ranks holding other tokens
    (E numbers, as the reported loss's sum). `cp_rank`: whose windowed attention's sends (they differ
    at the ring's ends; None: the busiest rank's)."""
    tokens = batch * seq
    stream = tokens // sizes["y"] if seq_parallel else tokens

    def block(b: BlockConfig, routed: tuple[int, ...] = (), exchanged: tuple[int, int] = (0, 0)) -> Passes:
        passes = block_passes(b, sizes, batch, seq, seq_parallel=seq_parallel, keep_weights=keep_weights,
                              keep_inputs=keep_inputs, non_redundant=non_redundant, routed=routed,
                              exchanged=exchanged, cp_rank=cp_rank)
        if recompute == "full":  # the block's forward runs again during backward, its collectives too
            return Passes(passes.forward, passes.forward + passes.backward)
        if recompute == "selective":  # the attention core, q/k norms and ring included, runs again in backward
            core = (head_norm_passes(b, sizes, batch * seq, non_redundant=non_redundant)
                    + ring_attention_passes(b, sizes, batch, seq, non_redundant=non_redundant, cp_rank=cp_rank))
            return Passes(passes.forward, core.forward + passes.backward)
        return passes

    n = cfg.layers if layers is None else layers
    blocks = [cfg.layer_block(i) for i in range(n)]  # (a pipeline stage's: priced as the first n layers)
    if routing is not None:
        total = sum(map(block, blocks, routing, exchanged or [(0, 0)] * len(routing)), Passes([], []))
    else:
        total = Passes([], [])
        for b in dict.fromkeys(blocks):  # each kind of layer once, times its count
            total = total + block(b) * blocks.count(b)
    if first:
        total = embedding_passes(sizes, cfg.vocab, cfg.hidden, tokens, seq_parallel=seq_parallel) + total
    if last:
        total = (total + norm_passes(sizes, cfg.block.norm, stream)
                 + head_passes(sizes, cfg.hidden, cfg.vocab, tokens, seq_parallel=seq_parallel,
                               keep_weight=keep_weights, keep_input=keep_inputs))
    return total.all()


def pipeline_sends(cfg: ModelConfig, sizes: dict, micro_batch: int, seq: int, microbatches: int, stages: list[int],
                   n_stages: int, *, seq_parallel: bool = False) -> list[Collective]:
    """The activations (forward) and their gradients (backward) one pp rank holding `stages` of
    `n_stages` sends per step: its residual-stream shard [micro_batch, seq(/y), hidden/x] (and a
    mixture's load-balancing sums, `pipeline._RoutingStage`); and a tied embedding's (`tied_copy_sends`)."""
    shard = micro_batch * (seq // sizes["y"] if seq_parallel else seq) * (cfg.hidden // sizes["x"])
    sends = sum((s < n_stages - 1) + (s > 0) for s in stages) * microbatches
    out = [Collective("pp", "send", shard)] * sends
    if cfg.experts and cfg.aux_loss:  # a mixture's load-balancing sums [counts; probabilities] travel beside it
        out += [Collective("pp", "send", 2 * cfg.experts, wide=True)] * sends
    return out + tied_copy_sends(cfg, sizes, stages, n_stages)


def tied_copy_sends(cfg: ModelConfig, sizes: dict, stages: list[int], n_stages: int) -> list[Collective]:
    """Tied embeddings over pipeline stages (`fourfold.parallel.pipeline`), per step: the rank of
    the first stage sends its table shard to the last stage's copy, and the last stage sends the
    copy's gradient back (fp32 at least). Megatron's all-reduce of the two gradients over the
    first and last stages sends as many elements from each; the copy holds no optimizer state."""
    if not cfg.tied or n_stages == 1:
        return []
    rows = padded_vocab(cfg.vocab, sizes["y"]) // sizes["y"]
    table = padded_block(sizes, rows, cfg.hidden // sizes["x"]) // sizes["z"]  # this rank's z shard
    return ([Collective("pp", "send", table)] if 0 in stages else []) + (
        [Collective("pp", "send", table, wide=True)] if n_stages - 1 in stages else [])


def ledger_bytes(collectives: list[Collective], sizes: dict, element_size: int) -> dict[tuple[str, str], Fraction]:
    """What a `Ledger` records for these collectives: bytes sent per (group, op)."""
    out: dict[tuple[str, str], Fraction] = {}
    for c in collectives:
        key = (c.group, c.op)
        out[key] = out.get(key, Fraction(0)) + bytes_sent(c.op, group_size(sizes, c.group),
                                                          c.numel * c.element_bytes(element_size))
    return out
