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

from fractions import Fraction

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
