"""A transformer block's shape and how fourfold lays it over the tensor grid: pure arithmetic.

Shared by the runtime layers (`fourfold.parallel.tensor.block`) and the volume functions
(`fourfold.spec.volumes`), so that the choice between the non-redundant and the fallback path is
made in one place.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from fourfold.spec.layout import GridError

NORMS = ("rms", "rms_plus_one", "layer")  # rms_plus_one: Gemma's, x / rms * (1 + weight)
# A linear layer's kind -> (grid dim splitting its input features K, dim splitting its outputs N).
LINEAR_KINDS = {"x-in": ("x", "y"), "y-in": ("y", "x")}
# geglu_tanh: gelu_tanh(gate) * up (Gemma's); swiglu_clamped: GPT-OSS's (BlockConfig.glu_limit, glu_alpha)
ACTIVATIONS = ("swiglu", "swiglu_clamped", "geglu_tanh", "gelu", "gelu_tanh")


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
    window: int = 0  # a sliding window: each query sees the keys less than `window` positions before it (0: all)
    attention_scale: float = 0.0  # the scores' scale (Gemma's query_pre_attn_scalar ** -0.5); 0: 1 / sqrt(head_dim)
    post_norms: bool = False  # Gemma's: the attention's and the MLP's outputs normed before the residual add
    sinks: bool = False  # GPT-OSS's: a learned logit per head in every row's softmax (attn.sinks, [heads])
    router_bias: bool = False  # GPT-OSS's router has a bias
    # swiglu_clamped: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)
    glu_limit: float = 7.0
    glu_alpha: float = 1.702
    # Multi-head latent attention (DeepSeek-V2/V3, kv_lora > 0: `parallel.tensor.latent`): q from a latent of
    # q_lora features, k's per-head part and v from one of kv_lora, one rotary key part of rope_dim for all heads;
    # head_size is then nope_dim + rope_dim (q's and k's), v_dim the values'
    q_lora: int = 0
    kv_lora: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    rope_interleave: bool = False  # RoPE on interleaved pairs (DeepSeek's)
    # Routing: "softmax" (top-k of the softmax), or "sigmoid_grouped" (DeepSeek-V3: sigmoid scores, plus a
    # balancing bias for the choice only, the top `top_groups` of `groups` expert groups by their two best
    # scores, top-k within them); the weights times `routed_scale`. `shared_gate`: a shared expert's sigmoid gate.
    routing: str = "softmax"
    groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0
    shared_gate: bool = True
    # Qwen3: queries and keys RMS-normalised over each head's features before RoPE, by a [head_dim]
    # weight each (attn.q_norm, attn.k_norm), held whole wherever heads are
    qk_norm: bool = False
    # OLMoE: queries and keys RMS-normalised over all heads' features (q: heads * head_dim, k: kv_heads *
    # head_dim) before the split into heads and RoPE, by a weight of that size each (attn.q_norm, attn.k_norm);
    # a rank holds its heads' slice, and the per-token statistics are all-reduced over the ranks holding the
    # other heads (`BlockPlan.head_group`)
    qk_norm_all_heads: bool = False
    # Mixture of experts (experts > 0): each token's MLP is the weighted sum of its top_k experts,
    # SwiGLU MLPs of `ffn` features; the router's softmax weights of the chosen ones, renormalised
    # to sum to 1 with `norm_topk`; plus a shared expert of `shared_ffn` features under a sigmoid gate.
    experts: int = 0
    top_k: int = 0
    norm_topk: bool = False
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        if not self.head_size and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads} (or give head_dim)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} must be one of {', '.join(NORMS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
        if self.qk_norm and self.qk_norm_all_heads:
            raise ValueError("qk_norm (per head) and qk_norm_all_heads (over all heads) exclude each other")
        if self.experts and not (0 < self.top_k <= self.experts and self.gated):
            raise ValueError(f"a mixture of {self.experts} gated experts needs 0 < top_k <= experts "
                             f"(top_k={self.top_k}, activation {self.activation!r})")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "swiglu_clamped", "geglu_tanh")

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.attention_scale or self.head_dim ** -0.5

    @property
    def moe(self) -> bool:
        return self.experts > 0


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


def mlp_chunks(cfg: BlockConfig, x: int, y: int, non_redundant: bool = True, ffn: int = 0) -> int:
    """FFN feature groups (of `ffn`, else cfg.ffn): x*y when they divide the FFN size, else y
    (activation replicated over x)."""
    ffn = ffn or cfg.ffn
    if non_redundant and ffn % (x * y) == 0:
        return x * y
    if ffn % y == 0:
        return y
    raise GridError(f"y={y} must divide ffn={ffn}; choose y dividing {ffn}")


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

    def renamed(self, old: str, new: str) -> "LinearPlan":
        """The same layer under other serial names (an expert's copy of the MLP: mlp. -> mlp.experts.3.)."""
        rows = tuple(dataclasses.replace(r, name=r.name.replace(old, new, 1)) for r in self.rows)
        return dataclasses.replace(self, name=self.name.replace(old, new, 1), rows=rows)

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
    up: LinearPlan  # a mixture's: one expert's, named mlp.gate, mlp.up, mlp.down (`expert` renames it)
    down: LinearPlan
    shared_up: LinearPlan | None = None  # a mixture's shared expert: mlp.shared.{gate,up,down}
    shared_down: LinearPlan | None = None
    # the ranks holding the other heads of a token, over which statistics spanning every head (OLMoE's q/k
    # norms) are summed: "x_y" on the non-redundant path (each rank its own heads), "y" on the published one
    head_group: str = "y"

    @property
    def linears(self) -> tuple[LinearPlan, ...]:
        """In the order a forward runs them (a mixture's expert once: how many tokens each
        expert gets is known only at run time)."""
        shared = (self.shared_up, self.shared_down) if self.shared_up else ()
        return (self.qkv, self.out) + shared + (self.up, self.down)

    def expert(self, e: int) -> tuple[LinearPlan, LinearPlan]:
        """Expert e's up (gate and up rows) and down projections, under its serial names."""
        return self.up.renamed("mlp.", f"mlp.experts.{e}."), self.down.renamed("mlp.", f"mlp.experts.{e}.")

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
    own_heads = heads_chunks == x * y
    d, h_local, kv_local = cfg.head_dim, cfg.heads // heads_chunks, cfg.kv_heads // heads_chunks
    # Fused rows chunk by chunk: each chunk holds whole heads with their q, k and v.
    qkv_rows = tuple(r for c in range(heads_chunks) for r in (
        RowSource("attn.q", c * h_local * d, h_local * d), RowSource("attn.k", c * kv_local * d, kv_local * d),
        RowSource("attn.v", c * kv_local * d, kv_local * d)))
    # A mixture gathers the residual stream's tokens over y itself (each expert gets some of them)
    gather_in = "tokens" if seq_parallel and not cfg.moe else "none"  # the residual stream's tokens over y
    scatter_out = "scatter_tokens" if seq_parallel and not cfg.moe else "all_reduce"

    def mlp(name: str, ffn: int) -> tuple[LinearPlan, LinearPlan]:
        chunks = mlp_chunks(cfg, x, y, non_redundant, ffn)
        f, own = ffn // chunks, chunks == x * y
        rows = (tuple(RowSource(f"{name}.{n}", c * f, f) for c in range(chunks) for n in ("gate", "up"))
                if cfg.gated else (RowSource(f"{name}.fc", 0, ffn),))
        return (LinearPlan(f"{name}.up", "x-in", cfg.hidden, rows, "scatter_features" if own else "all_reduce",
                           gather_in, cfg.mlp_bias),
                LinearPlan(f"{name}.down", "y-in", ffn, (RowSource(f"{name}.down", 0, cfg.hidden),), scatter_out,
                           "features" if own else "none", cfg.mlp_bias))

    up, down = mlp("mlp", cfg.ffn)
    shared_up, shared_down = mlp("mlp.shared", cfg.shared_ffn) if cfg.shared_ffn else (None, None)
    return BlockPlan(
        cfg, heads_chunks, ffn_chunks,
        qkv=LinearPlan("attn.qkv", "x-in", cfg.hidden, qkv_rows, "scatter_features" if own_heads else "all_reduce",
                       "tokens" if seq_parallel else "none", cfg.qkv_bias),
        out=LinearPlan("attn.o", "y-in", cfg.heads * (cfg.v_dim if cfg.mla else d),
                       (RowSource("attn.o", 0, cfg.hidden),),
                       "scatter_tokens" if seq_parallel else "all_reduce", "features" if own_heads else "none",
                       cfg.out_bias),
        up=up, down=down, shared_up=shared_up, shared_down=shared_down, head_group="x_y" if own_heads else "y",
    )
