"""A mixture of experts as the planner prices it: the routing it assumes, and the parameters the
runtime holds replicated (`fourfold.parallel.tensor.moe`).

fourfold has no expert parallelism: every rank runs every expert on its own tokens, each expert's
weights split over x, y and z as the dense MLP's. Whatever the routing, the tokens a rank's
experts see add up to top_k * T, so FLOPs, saved activations and collective volumes do not depend
on it; only the shape of each expert's GEMMs does (top_k * T / experts tokens each when balanced).
"""

from __future__ import annotations

from fourfold.spec.blockspec import BlockConfig

# Tokens of each expert relative to a balanced routing. 1.0: balanced, exact for every sum above
# without expert parallelism (an assumption only for the per-expert GEMM shapes; no measurement of
# a trained router's spread is shipped). Above 1, every expert is priced at the busiest one's count:
# an upper bound of compute, activations and volumes, for a pessimistic plan.
ROUTING_IMBALANCE = 1.0


def expert_tokens(block: BlockConfig, tokens: float) -> float:
    """Tokens one expert sees of `tokens` routed: top_k * tokens / experts, times the imbalance."""
    return block.top_k * tokens / block.experts * ROUTING_IMBALANCE


def routed_tokens(block: BlockConfig, tokens: float) -> float:
    """Tokens all experts see together (top_k * tokens at a balanced routing)."""
    return expert_tokens(block, tokens) * block.experts


def balanced_routing(block: BlockConfig, tokens: int) -> tuple[int, ...]:
    """Tokens routed to each expert (`spec.volumes.block_passes`'s `routed`): top_k * tokens spread
    as evenly as whole tokens go, each times the imbalance."""
    if ROUTING_IMBALANCE == 1.0:
        q, r = divmod(block.top_k * tokens, block.experts)
        return (q + 1,) * r + (q,) * (block.experts - r)
    return (round(expert_tokens(block, tokens)),) * block.experts


def replicated_params(block: BlockConfig) -> int:
    """Parameters of a mixture's layer held split over x only (replicated over y and z): the router
    (experts x hidden) and the shared expert's gate (hidden). `spec.counts.layer_params` counts them
    among the matrices."""
    if not block.moe:
        return 0
    return block.experts * block.hidden + (block.hidden if block.shared_ffn else 0)
