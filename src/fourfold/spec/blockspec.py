"""A transformer block's shape and how fourfold lays it over the tensor grid: pure arithmetic.

Shared by the runtime layers (`fourfold.parallel.tensor.block`) and the volume functions
(`fourfold.spec.volumes`), so that the choice between the non-redundant and the fallback path is
made in one place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fourfold.spec.layout import GridError

NORMS = ("rms", "layer")
# A linear layer's kind -> (grid dim splitting its input features K, dim splitting its outputs N).
LINEAR_KINDS = {"x-in": ("x", "y"), "y-in": ("y", "x")}
ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh")


ROPE_SCALINGS = ("linear", "llama3", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """transformers' rope_scaling / rope_parameters beyond the default frequencies:
    "linear": every frequency divided by `factor`;
    "llama3" (Llama 3.1's): low frequencies divided by `factor`, high ones kept, a smooth blend
      between, set by the two freq factors and the context the model was pretrained on;
    "dynamic" (NTK): the base grows with the sequence once it is longer than
      `original_max_positions` (config.json's max_position_embeddings);
    "yarn": interpolated low and extrapolated high frequencies with a ramp between, set by the
      betas (in rotations over the pretrained context), and cos/sin scaled by `attention_factor`.
    Every value is the one transformers uses, defaults resolved when config.json is read."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole dims
    attention_factor: float = 1.0  # cos and sin are multiplied by it

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.kind!r} is not supported; fourfold computes "
                             f"{', '.join(ROPE_SCALINGS)} (and the default)")


@dataclass(frozen=True)
class BlockConfig:
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    norm: str = "rms"
    activation: str = "swiglu"
    qkv_bias: bool = False  # q, k, v projections (GPT-2, Qwen2, Llama with attention_bias)
    out_bias: bool = False  # the output projection (GPT-2, Llama with attention_bias)
    mlp_bias: bool = False  # the MLP's projections (GPT-2, Llama with mlp_bias)
    rope: bool = True
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    head_size: int = 0  # an explicit head dim (config.json's head_dim); 0: hidden / heads
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if not self.head_size and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads} (or give head_dim)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} must be one of {', '.join(NORMS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} must be one of {', '.join(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

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


# ----- the block plan: one block's layers over the tensor grid, as data ----------------------
# The runtime builds its layers from it (fourfold.parallel.tensor.block), the volume functions count its
# collectives (fourfold.spec.volumes), the performance model its GEMMs and the memory estimator the
# tensors its layers save (fourfold.plan). A new model family or way of saving activations
# changes `block_plan` and nothing else.


@dataclass(frozen=True)
class RowSource:
    """Rows [start, start + count) of the serial parameter `name` (fused layers: QKV, gate+up)."""

    name: str
    start: int
    count: int


@dataclass(frozen=True)
class LinearPlan:
    name: str  # within the block: "attn.qkv", "attn.o", "mlp.up", "mlp.down"
    kind: str  # "x-in" (K over x, N over y) or "y-in" (K over y, N over x)
    in_features: int
    rows: tuple[RowSource, ...]  # the serial rows of the outputs, in the fused order (names within the block)
    reduction: str  # over the in-dim: "all_reduce", "scatter_tokens" or "scatter_features"
    input_gather: str  # over the out-dim, before the GEMM: "none", "tokens" or "features"
    bias: bool

    @functools.cached_property  # (a fused QKV has three rows per head group: the planner asks often)
    def out_features(self) -> int:
        return sum(r.count for r in self.rows)

    @property
    def in_dim(self) -> str:
        return LINEAR_KINDS[self.kind][0]

    @property
    def out_dim(self) -> str:
        return LINEAR_KINDS[self.kind][1]


@dataclass(frozen=True)
class BlockPlan:
    cfg: BlockConfig
    attention_chunks: int  # head groups over (x, y): x*y (non-redundant) or y
    mlp_chunks: int  # FFN feature groups: x*y or y
    qkv: LinearPlan
    out: LinearPlan
    up: LinearPlan
    down: LinearPlan

    @property
    def linears(self) -> tuple[LinearPlan, ...]:
        """In the order a forward runs them."""
        return self.qkv, self.out, self.up, self.down

    @property
    def local_heads(self) -> int:
        return self.cfg.heads // self.attention_chunks

    @property
    def local_kv_heads(self) -> int:
        return self.cfg.kv_heads // self.attention_chunks

    @property
    def local_ffn(self) -> int:
        return self.cfg.ffn // self.mlp_chunks


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few plans for every candidate
def block_plan(cfg: BlockConfig, x: int, y: int, *, seq_parallel: bool, non_redundant: bool = True) -> BlockPlan:
    """The layers of one block on an (x, y) grid (z splits every weight block evenly, padded)."""
    heads_chunks = attention_chunks(cfg, x, y, non_redundant)
    ffn_chunks = mlp_chunks(cfg, x, y, non_redundant)
    own_heads, own_ffn = heads_chunks == x * y, ffn_chunks == x * y
    d, h_local, kv_local = cfg.head_dim, cfg.heads // heads_chunks, cfg.kv_heads // heads_chunks
    # Fused rows chunk by chunk: each chunk holds whole heads with their q, k and v.
    qkv_rows = tuple(r for c in range(heads_chunks) for r in (
        RowSource("attn.q", c * h_local * d, h_local * d), RowSource("attn.k", c * kv_local * d, kv_local * d),
        RowSource("attn.v", c * kv_local * d, kv_local * d)))
    f = cfg.ffn // ffn_chunks
    up_rows = (tuple(RowSource(f"mlp.{n}", c * f, f) for c in range(ffn_chunks) for n in ("gate", "up"))
               if cfg.gated else (RowSource("mlp.fc", 0, cfg.ffn),))
    gather_in = "tokens" if seq_parallel else "none"  # the residual stream's tokens over y
    scatter_out = "scatter_tokens" if seq_parallel else "all_reduce"
    return BlockPlan(
        cfg, heads_chunks, ffn_chunks,
        qkv=LinearPlan("attn.qkv", "x-in", cfg.hidden, qkv_rows, "scatter_features" if own_heads else "all_reduce",
                       gather_in, cfg.qkv_bias),
        out=LinearPlan("attn.o", "y-in", cfg.heads * d, (RowSource("attn.o", 0, cfg.hidden),), scatter_out,
                       "features" if own_heads else "none", cfg.out_bias),
        up=LinearPlan("mlp.up", "x-in", cfg.hidden, up_rows, "scatter_features" if own_ffn else "all_reduce",
                      gather_in, cfg.mlp_bias),
        down=LinearPlan("mlp.down", "y-in", cfg.ffn, (RowSource("mlp.down", 0, cfg.hidden),), scatter_out,
                        "features" if own_ffn else "none", cfg.mlp_bias),
    )
