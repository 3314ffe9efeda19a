"""Communication volumes: the one place where fourfold states how many bytes a collective moves.

The runtime's ledger (`fourfold.comm`), the tests and the planner all use these functions, so a
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

from fourfold.blockspec import BlockConfig, attention_chunks, mlp_chunks

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


def bytes_sent(op: str, group_size: int, message_bytes: int) -> Fraction:
    """Bytes one rank sends for `op` over a full message of `message_bytes` on `group_size` ranks."""
    g = group_size
    if g < 1:
        raise ValueError(f"group size {g} must be >= 1")
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction(g - 1, g) * message_bytes
    if op == "all_reduce":
        return Fraction(2 * (g - 1), g) * message_bytes
    if op == "send":
        return Fraction(message_bytes)
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVES)}")


# ----- the collectives of 3D tensor-parallel layers (fourfold.tensor), per rank ---------------
# Each function lists, in the order the runtime issues them, the collectives of one forward and
# backward pass: (group, op, elements of the full message). Groups of one rank are left out.

_LINEAR_DIMS = {"x-in": ("x", "y"), "y-in": ("y", "x")}


@dataclass(frozen=True)
class Collective:
    group: str
    op: str
    numel: int


def _keep(sizes: dict, items: list[Collective]) -> list[Collective]:
    return [c for c in items if sizes[c.group] > 1]


def linear_collectives(sizes: dict, kind: str, in_features: int, out_features: int, tokens: int, *,
                       reduction: str = "all_reduce", input_gather: str = "none", keep_weight: bool = False) -> list[Collective]:
    """A `ParallelLinear` on `tokens` local tokens (after any gather of its input)."""
    i, o = _LINEAR_DIMS[kind]
    k_local, n_local = in_features // sizes[i], out_features // sizes[o]
    block = -(-k_local * n_local // sizes["z"]) * sizes["z"]  # padded to equal z shards
    c = []
    if input_gather != "none":
        c.append(Collective(o, "all_gather", tokens * k_local))
    c.append(Collective("z", "all_gather", block))
    c.append(Collective(i, "all_reduce" if reduction == "all_reduce" else "reduce_scatter", tokens * n_local))
    # backward
    if reduction != "all_reduce":
        c.append(Collective(i, "all_gather", tokens * n_local))
    if not keep_weight:
        c.append(Collective("z", "all_gather", block))
    c.append(Collective(o, "all_reduce" if input_gather == "none" else "reduce_scatter", tokens * k_local))
    c.append(Collective("z", "reduce_scatter", block))
    return _keep(sizes, c)


def norm_collectives(sizes: dict, kind: str, tokens: int) -> list[Collective]:
    """Statistics all-reduced over x: RMSNorm one [tokens] sum, LayerNorm two; as many in backward."""
    per_pass = 1 if kind == "rms" else 2
    return _keep(sizes, [Collective("x", "all_reduce", tokens)] * (2 * per_pass))


def block_collectives(cfg: BlockConfig, sizes: dict, batch: int, seq: int, *, seq_parallel: bool = False,
                      keep_weights: bool = False, non_redundant: bool = True) -> list[Collective]:
    """One `ParallelBlock` forward and backward on `batch` local sequences of `seq` tokens."""
    x, y = sizes["x"], sizes["y"]
    tokens = batch * seq
    stream = tokens // y if seq_parallel else tokens  # tokens of the residual stream on this rank
    out_reduction = "scatter_tokens" if seq_parallel else "all_reduce"
    in_gather = "tokens" if seq_parallel else "none"
    own_heads = attention_chunks(cfg, x, y, non_redundant) == x * y
    own_ffn = mlp_chunks(cfg, x, y, non_redundant) == x * y
    qkv_rows = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    up_rows = 2 * cfg.ffn if cfg.gated else cfg.ffn
    kw = dict(keep_weight=keep_weights)
    return [
        *norm_collectives(sizes, cfg.norm, stream),
        *linear_collectives(sizes, "x-in", cfg.hidden, qkv_rows, tokens, input_gather=in_gather,
                            reduction="scatter_features" if own_heads else "all_reduce", **kw),
        *linear_collectives(sizes, "y-in", cfg.hidden, cfg.hidden, tokens, reduction=out_reduction,
                            input_gather="features" if own_heads else "none", **kw),
        *norm_collectives(sizes, cfg.norm, stream),
        *linear_collectives(sizes, "x-in", cfg.hidden, up_rows, tokens, input_gather=in_gather,
                            reduction="scatter_features" if own_ffn else "all_reduce", **kw),
        *linear_collectives(sizes, "y-in", cfg.ffn, cfg.hidden, tokens, reduction=out_reduction,
                            input_gather="features" if own_ffn else "none", **kw),
    ]


def ledger_bytes(collectives: list[Collective], sizes: dict, element_size: int) -> dict[tuple[str, str], Fraction]:
    """What a `Ledger` records for these collectives: bytes sent per (group, op)."""
    out: dict[tuple[str, str], Fraction] = {}
    for c in collectives:
        key = (c.group, c.op)
        out[key] = out.get(key, Fraction(0)) + bytes_sent(c.op, sizes[c.group], c.numel * element_size)
    return out
