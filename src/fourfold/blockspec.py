"""A transformer block's shape and how fourfold lays it over the tensor grid: pure arithmetic.

Shared by the runtime layers (`fourfold.tensor.block`) and the volume functions
(`fourfold.volumes`), so that the choice between the non-redundant and the fallback path is
made in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from fourfold.layout import GridError

NORMS = ("rms", "layer")
# A linear layer's kind -> (grid dim splitting its input features K, dim splitting its outputs N).
LINEAR_KINDS = {"x-in": ("x", "y"), "y-in": ("y", "x")}
ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh")
RECOMPUTE = ("none", "selective", "full")  # activation checkpointing per block


@dataclass(frozen=True)
class BlockConfig:
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    norm: str = "rms"
    activation: str = "swiglu"
    bias: bool = False
    rope: bool = True
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} must be one of {', '.join(NORMS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} must be one of {', '.join(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"


def attention_chunks(cfg: BlockConfig, x: int, y: int, non_redundant: bool = True) -> int:
    """Head groups over the (x, y) grid: x*y (each rank owns its heads: the non-redundant path)
    or y (the published path: attention replicated over x)."""
    if non_redundant and cfg.heads % (x * y) == 0 and cfg.kv_heads % (x * y) == 0:
        return x * y
    if cfg.heads % y == 0 and cfg.kv_heads % y == 0:
        return y
    raise GridError(
        f"y={y} must divide heads={cfg.heads} and kv_heads={cfg.kv_heads} "
        f"(x*y={x * y} dividing both avoids redundant attention); choose y dividing {cfg.kv_heads}"
    )


def mlp_chunks(cfg: BlockConfig, x: int, y: int, non_redundant: bool = True) -> int:
    """FFN feature groups: x*y when they divide the FFN size, else y (activation replicated over x)."""
    if non_redundant and cfg.ffn % (x * y) == 0:
        return x * y
    if cfg.ffn % y == 0:
        return y
    raise GridError(f"y={y} must divide ffn={cfg.ffn}; choose y dividing {cfg.ffn}")
