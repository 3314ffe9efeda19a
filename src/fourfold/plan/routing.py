"""A mixture of experts as the planner prices it: the routing it assumes, the parameters the
runtime holds replicated, and expert parallelism's split of the experts and exchange of tokens
(`fourfold.parallel.tensor.moe`).

Each expert's weights are split over x, y and z as the dense MLP's. Without expert parallelism
(ep = 1) every rank runs every expert on its own tokens: whatever the routing, the tokens a rank's
experts see add up to top_k * T, so FLOPs, saved activations and collective volumes do not depend
on it; only the shape of each expert's GEMMs does (top_k * T / experts tokens each when balanced).

With expert parallelism (`Layout.ep`, ep consecutive ranks of the dp*cp group) a rank holds
experts/ep of the experts (`ParallelMoE.first` on): each of its T tokens' top_k choices is sent to
the rank holding its expert (an uneven all-to-all of rows of hidden/x features, after one of the
E routing counts), the experts run on every row the ep group sent them, and the outputs come back
by the reverse exchange. At a balanced routing a rank's experts receive top_k * T rows in all, as
many as it sends; a rank sends (ep - 1)/ep of its rows to the others. The runtime's fake-tensor
path routes choice i to expert i % experts on every rank (`moe.balanced_choices`), which
`local_routing` and `exchanged_rows` reproduce row for row.
"""

from __future__ import annotations

from fourfold.spec.blockspec import BlockConfig

# Tokens of each expert relative to a balanced routing. 1.0: balanced, exact for every sum above
# without expert parallelism (an assumption only for the per-expert GEMM shapes; no measurement of
# a trained router's spread is shipped). With expert parallelism it also sets the rows the busiest
# rank receives (its experts' GEMMs, their saved activations and its exchange's volume: every rank
# waits for it). Above 1, every expert is priced at the busiest one's count: an upper bound of
# compute, activations and volumes, for a pessimistic plan.
ROUTING_IMBALANCE = 1.0


def expert_tokens(block: BlockConfig, tokens: float) -> float:
    """Tokens one expert sees of `tokens` routed: top_k * tokens / experts, times the imbalance."""
    return block.top_k * tokens / block.experts * ROUTING_IMBALANCE


def routed_tokens(block: BlockConfig, tokens: float) -> float:
    """Tokens all experts see together (top_k * tokens at a balanced routing). With expert
    parallelism, of `tokens` on each of the ep ranks: the rows one rank's experts receive."""
    return expert_tokens(block, tokens) * block.experts


def balanced_routing(block: BlockConfig, tokens: int) -> tuple[int, ...]:
    """Tokens routed to each expert (`spec.volumes.block_passes`'s `routed`): top_k * tokens spread
    as evenly as whole tokens go, each times the imbalance."""
    if ROUTING_IMBALANCE == 1.0:
        q, r = divmod(block.top_k * tokens, block.experts)
        return (q + 1,) * r + (q,) * (block.experts - r)
    return (round(expert_tokens(block, tokens)),) * block.experts


def local_routing(block: BlockConfig, tokens: int, ep: int, rank: int = 0) -> tuple[int, ...]:
    """Rows each expert of expert-group rank `rank` runs when each of the ep ranks routes its
    `tokens` as `balanced_routing` does (`ParallelMoE.routed`): ep times each of its experts' count.
    Rank 0 holds the experts that get a choice more when the choices do not divide evenly: the
    busiest rank, the one the planner prices."""
    per, local = balanced_routing(block, tokens), block.experts // ep
    return tuple(ep * n for n in per[rank * local : (rank + 1) * local])


def exchanged_rows(block: BlockConfig, tokens: int, ep: int, rank: int = 0) -> tuple[int, int]:
    """(rows sent to the other ranks of the expert group, rows received from them) by rank `rank`
    at that routing (`ParallelMoE.exchanged`); (0, 0) without expert parallelism."""
    if ep == 1:
        return (0, 0)
    per, local = balanced_routing(block, tokens), block.experts // ep
    mine = sum(per[rank * local : (rank + 1) * local])  # its own choices of its own experts
    return sum(per) - mine, (ep - 1) * mine


def replicated_params(block: BlockConfig) -> int:
    """Parameters of a layer held split over x only (replicated over y and z): a mixture's router
    (experts x hidden) and shared expert's gate (hidden); latent attention's two down-projections.
    `spec.counts.layer_params` counts them among the matrices."""
    latents = block.hidden * (block.q_lora + block.kv_lora + block.rope_dim) if block.mla else 0
    if not block.moe:
        return latents
    return latents + block.experts * block.hidden + (block.hidden if block.shared_ffn and block.shared_gate else 0)


def head_params(block: BlockConfig) -> int:
    """Latent attention's per-head up-projections (q_b, kv_b): split by head group, not over z
    (`parallel.tensor.latent.HeadLinear`). `spec.counts.layer_params` counts them among the matrices."""
    if not block.mla:
        return 0
    return block.heads * (block.q_lora * block.head_dim + block.kv_lora * (block.nope_dim + block.v_dim))


def expert_params(block: BlockConfig) -> int:
    """Parameters of a mixture's layer in its routed experts (every expert's MLP matrices, split
    over x, y and z, and over the ep ranks with expert parallelism; their optimizer state over the
    dp*cp/ep expert replicas). `spec.counts.layer_params` counts them among the matrices."""
    if not block.moe:
        return 0
    return block.experts * (3 if block.gated else 2) * block.hidden * block.ffn
