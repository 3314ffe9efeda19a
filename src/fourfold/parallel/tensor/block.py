"""Attention, MLP and the pre-norm transformer block on the 3D grid (tensor3d.md).

Residual stream: [batch/z, seq/cp, hidden/x], replicated over y; with sequence parallelism
[batch/z, seq/(cp*y), hidden/x]. Non-redundant path (heads and kv heads divisible by x*y): the QKV
output is reduce-scattered over x along whole heads, each rank attends with heads/(x*y) heads,
and the result is all-gathered over x into the output projection; the MLP likewise with FFN
features. Otherwise the published path: all-reduce over x, attention replicated over x. Which
path, and every linear layer's shape and collectives, come from the block plan
(`fourfold.spec.blockspec.block_plan`), the same data the volume functions and the planner read.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fourfold.parallel import comm, context
from fourfold.parallel.context import Documents, ring_attention
from fourfold.parallel.grid import Grid
from fourfold.parallel.overlap import OverlapOptions, Overlapper
from fourfold.parallel.tensor import init
from fourfold.parallel.tensor.latent import LatentAttention
from fourfold.parallel.tensor.linear import ParallelLinear, RowSource
from fourfold.parallel.tensor.moe import ParallelMoE
from fourfold.parallel.tensor.norm import AllHeadsNorm, HeadNorm, ParallelNorm, compiled
from fourfold.parallel.tensor.params import ParallelModule, ParamLayout, vector_piece
from fourfold.spec.blockspec import BlockConfig, BlockPlan, LinearPlan, RopeScaling, block_plan


@dataclass(frozen=True)
class TensorOptions:
    seq_parallel: bool = False  # residual stream, norms on seq/y tokens (Megatron-SP generalised)
    keep_weights: bool = False  # keep each gathered weight from forward to backward
    keep_gathered_inputs: bool = False  # keep each linear's gathered input (else gather it again in backward)
    non_redundant: bool = True  # False: the published all-reduce path, attention/MLP replicated over x
    overlap: OverlapOptions = OverlapOptions()
    dtype: torch.dtype = torch.float32
    # train.compile: each block one torch.compile graph where it traces whole (`traces_whole`), else its
    # norms, RoPE and activations compiled between its collectives
    compile: bool = False
    capacity_factor: float = 0.0  # a mixture's expert capacity (`moe.within_capacity`); 0: dropless
    fp8: str = ""  # the linears' GEMMs in FP8 (`tensor.fp8`, train.fp8): "tensorwise" or "rowwise"; "": off
    # model.train_padding_row: the pad token's embedding row trained too (transformers never does: `pad_token`)
    train_padding_row: bool = False


def torch_dtype(precision: str, device: torch.device) -> torch.dtype:
    """Parameters' and activations' dtype for a job's precision. "auto": bf16 on GPUs (fp32
    gradient accumulators and master weights, fp32 loss, as Megatron trains), float32 on CPU."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "float32"
    return {"bf16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}[precision]


def rope_frequencies(d: int, theta: float, scaling: RopeScaling | None, seq: int = 0, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies [d/2], float32, for a sequence of `seq` tokens (dynamic scaling
    depends on it), with transformers' arithmetic step for step (its _compute_*_parameters), so
    that runs match it to rounding."""
    if scaling is not None and scaling.kind == "dynamic":
        # The base grows with the sequence beyond the trained context. transformers keeps the
        # frequencies of its init (Python-float arithmetic) up to that context and recomputes
        # them from the length as a tensor (float32 arithmetic) beyond it: both kept, to rounding.
        # (A transformers module that has seen a longer sequence keeps its frequencies until a
        # sequence within the trained context comes; fourfold's depend on this sequence only.)
        trained = scaling.original_max_positions
        length = torch.tensor(seq, device=device) if seq > trained else trained
        theta = theta * ((scaling.factor * length / trained) - (scaling.factor - 1)) ** (d / (d - 2))
    pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    inv_freq = 1.0 / pos_freqs
    if scaling is None or scaling.kind == "dynamic":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_frequencies(d, theta, scaling, pos_freqs)
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    low_freq_wavelen = scaling.original_max_positions / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_positions / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_positions / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(d: int, theta: float, scaling: RopeScaling, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies making fewer than beta_slow rotations over the pretrained context are
    interpolated (divided by `factor`), those making more than beta_fast are kept, a linear ramp
    over the dims between."""
    def correction_dim(rotations: float) -> float:  # the dim whose frequency makes `rotations` turns
        return (d * math.log(scaling.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp.to(pos_freqs.device)
    return 1.0 / (scaling.factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated


def rope_tables(positions: torch.Tensor, seq: int, d: int, theta: float, scaling: RopeScaling | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), d] of RoPE at the given positions of a `seq`-token sequence.

    The angles are computed in float32 whatever the model's dtype, exactly as Hugging Face does,
    so that float64 runs match transformers to rounding."""
    angles = positions.float()[:, None] * rope_frequencies(d, theta, scaling, seq, positions.device)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    scale = scaling.attention_factor if scaling is not None else 1.0  # yarn's; transformers multiplies in float32
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half RoPE on [batch, heads, seq, head_dim] with the tables of `rope_tables`."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


def document_ids(ids: torch.Tensor, end_of_document: int) -> torch.Tensor:
    """[b, s] token ids -> [b, s] document ids (0, 1, ... along each sequence): an end-of-document
    token belongs to the document it ends, the token after it starts the next. Computed on whole
    sequences (before the cp split), so the ids are the global sequence's."""
    ends = (ids == end_of_document).long()
    return ends.cumsum(-1) - ends


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | Documents | None,
                     window: int = 0, *, enable_gqa: bool, scale: float | None = None,
                     expand_heads: bool | None = None, varlen: bool | None = None) -> torch.Tensor:
    """Causal attention within each document (`documents`: [b, s] ids, or None: one a sequence) and
    within a sliding `window` (0: none). Ids must not decrease (checked); what is planned from them
    is made once per `Documents` (at most one host read a forward, not a layer).

    `varlen` (default: on CUDA from Ampere on, in bf16 or fp16, with one head size): flash's variable-length kernel
    (`varlen_kernel`), every document a sequence of its own (`Documents.varlen`) and the window its
    left window, GQA native: no mask at all. Else the rows in bands (`context.Documents.whole`), each
    band's SDPA over only the keys its documents and window reach, with the mask of that part
    materialised ([b, 1, band, keys]): any device, and on CPU with the mask nearer plain causal
    attention's cost than one [s, s] mask.

    `expand_heads` (banded, default: on CUDA): GQA's K/V repeated to the query heads for each band.
    CUDA's memory-efficient kernel takes a mask but not GQA, so SDPA given both takes the math path
    (its scores kept for backward); repeated, the band runs on the efficient kernel. CPU's flash
    kernel takes both."""
    documents = context.as_documents(documents)
    if varlen is None:  # (flash: Ampere on, 16-bit, one head size)
        varlen = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == v.shape[-1]
                  and torch.cuda.get_device_capability(q.device) >= (8, 0))
    if varlen:
        return _varlen_attention(q, k, v, documents, window, enable_gqa, scale)
    plan = documents.whole(q.shape[2], window, q.device)
    if enable_gqa and (q.is_cuda if expand_heads is None else expand_heads):
        group = q.shape[1] // k.shape[1]
        k, v, enable_gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    out = [F.scaled_dot_product_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                          attn_mask=plan.mask(rows, keys)[:, None], enable_gqa=enable_gqa,
                                          scale=scale)
           for rows, keys in plan.cut]  # (keys never empty: each row sees itself)
    return torch.cat(out, dim=2)


def varlen_kernel(q, k, v, starts: torch.Tensor, longest: int, window: int, enable_gqa: bool, scale: float | None):
    """torch's flash varlen attention on packed [tokens, heads, d] rows: each span of `starts` one
    sequence, causal, and with `window` > 0 only the window - 1 keys before a query and itself."""
    from torch.nn.attention.varlen import varlen_attn  # (CUDA only)

    return varlen_attn(q, k, v, starts, starts, longest, longest, scale=scale, enable_gqa=enable_gqa,
                       window_size=(window - 1 if window else -1, 0))


def _varlen_attention(q, k, v, documents: Documents, window: int, enable_gqa: bool, scale: float | None):
    """`masked_attention` on `varlen_kernel`: [b, heads, s, d] in and out, packed [b*s, heads, d] between
    (views where the heads' rows are already token-major, as qkv's are)."""
    b, heads, s, _ = q.shape
    starts, longest = documents.varlen(b, s, q.device)
    packed = [t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3]) for t in (q, k, v)]
    out = varlen_kernel(*packed, starts, longest, window, enable_gqa, scale)
    return out.view(b, s, heads, -1).transpose(1, 2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up (views of the up-projection's output, kept anyway)
    for backward: autograd's product would also keep silu(gate), [tokens, ffn/y] a layer, which
    backward rebuilds here (one elementwise op). The gradients are autograd's, operation for operation."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def gelu(u: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(u, approximate=approximate)


def _linear(grid: Grid, layer: LinearPlan, prefix: str, opts: TensorOptions, *, seed: int, std: float,
            overlap: Overlapper) -> ParallelLinear:
    """The runtime layer of one linear of the block plan; serial names under `prefix` (layers.{i})."""
    rows = [RowSource(f"{prefix}.{r.name}", r.start, r.count) for r in layer.rows]
    return ParallelLinear(grid, layer.in_features, rows, layer.kind, seed=seed, std=std, bias=layer.bias,
                          reduction=layer.reduction, input_gather=layer.input_gather, keep_weight=opts.keep_weights,
                          keep_gathered_input=opts.keep_gathered_inputs,
                          dtype=opts.dtype, name=f"{prefix}.{layer.name}", overlap=overlap, fp8=opts.fp8)


class HeadSinks(ParallelModule):
    """GPT-OSS's attention sinks: a logit per query head (serial `layers.{i}.attn.sinks`, [heads]) that
    every row's softmax also takes. A rank holds its heads' slice (chunk `c["y"] * x + c["x"]` of the
    heads on the non-redundant path, `c["y"]` on the published one, where the x ranks compute the same
    heads: replicated over x); the gradient is summed over z (other tokens; dp and cp by the sync)."""

    def __init__(self, grid: Grid, plan: BlockPlan, *, own_heads: bool, dtype: torch.dtype, name: str, seed: int,
                 std: float):
        super().__init__()
        c, self.grid, self.name, self.seed, self.std, self.own_heads = grid.coords, grid, name, seed, std, own_heads
        self.heads, self.local = plan.cfg.heads, plan.local_heads
        self.offset = (c["y"] * grid.size("x") + c["x"] if own_heads else c["y"]) * self.local
        self.weight = nn.Parameter(torch.empty(self.local, dtype=dtype))
        self.initialise()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.copy_(init.normal(self.seed, self.name, torch.arange(self.local) + self.offset, self.std,
                                      self.weight.dtype))

    def load(self, read, put) -> None:
        put(self.weight, read(self.name, slice(self.offset, self.offset + self.local), None))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        piece = vector_piece(self.name, self.heads, self.offset, self.local)
        return {self.weight: ParamLayout(("z",), ("z",) if self.own_heads else ("x", "z"), (piece,))}

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        t = pick(self.weight).detach()
        if self.own_heads:  # chunk y * x_size + x: over x within a y block, then the y blocks
            t = comm.all_gather(t, self.grid.group("x"))
        return {self.name: comm.all_gather(t, self.grid.group("y"))}


class ParallelAttention(nn.Module):
    def __init__(self, grid: Grid, plan: BlockPlan, opts: TensorOptions, *, seed: int, std: float, out_std: float,
                 prefix: str, overlap: Overlapper, recompute_core: bool = False):
        super().__init__()
        self.cfg, self.recompute_core = plan.cfg, recompute_core
        self.cp = grid.group("cp")
        self.heads, self.kv_heads = plan.local_heads, plan.local_kv_heads
        self.own_heads = plan.attention_chunks == grid.size("x") * grid.size("y")  # the non-redundant path
        self.rotate = compiled(rotate) if opts.compile else rotate
        self.qkv = _linear(grid, plan.qkv, prefix, opts, seed=seed, std=std, overlap=overlap)
        self.out = _linear(grid, plan.out, prefix, opts, seed=seed, std=out_std, overlap=overlap)
        if self.cfg.qk_norm:  # Qwen3's: each head's queries and keys RMS-normalised before RoPE
            self.q_norm, self.k_norm = (
                HeadNorm(grid, self.cfg.head_dim, self.cfg.eps, own_heads=self.own_heads, dtype=opts.dtype,
                         name=f"{prefix}.attn.{n}", compile=opts.compile, plus_one=self.cfg.norm == "rms_plus_one")
                for n in ("q_norm", "k_norm"))
        self.sinks = HeadSinks(grid, plan, own_heads=self.own_heads, dtype=opts.dtype, name=f"{prefix}.attn.sinks",
                               seed=seed, std=std) if self.cfg.sinks else None
        if self.cfg.qk_norm_all_heads:  # OLMoE's: over all heads' features, statistics summed over the head group
            self.q_norm, self.k_norm = (
                AllHeadsNorm(grid, heads * self.cfg.head_dim, plan.attention_chunks, self.cfg.eps,
                             own_heads=self.own_heads, dtype=opts.dtype, name=f"{prefix}.attn.{n}",
                             compile=opts.compile) for n, heads in (("q_norm", self.cfg.heads),
                                                                    ("k_norm", self.cfg.kv_heads)))

    def core(self, qkv: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of this rank's heads: [b, s, (q+k+v) features] -> [b, s, q features]. With
        `documents` ([b, s] document ids, `document_ids`) each token attends causally within its
        own document only; with the block's sliding window, to the keys less than it before."""
        b, s, _ = qkv.shape
        d = self.cfg.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        if self.cfg.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, s, self.heads, d), k.view(b, s, self.kv_heads, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2)
        if self.cfg.rope:
            # dynamic scaling depends on the whole sequence's length, of which this cp rank holds a part
            cos, sin = rope_tables(positions, positions.numel() * self.cp.size, d, self.cfg.rope_theta,
                                   self.cfg.rope_scaling, q.dtype)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            # A view of qkv saved for backward would keep all of qkv alive beside the rotated q, k.
            v = v.contiguous()
        window = self.cfg.window if self.cfg.window < s * self.cp.size else 0  # (a longer one masks nothing)
        if self.cp.size > 1 or self.sinks is not None:  # the other chunks' keys and values come round the cp ring
            # (sinks need the log-sum-exp: on one rank, the ring of its own block)
            o = ring_attention(q, k, v, self.cp, documents, window, scale=self.cfg.scale,
                               sinks=None if self.sinks is None else self.sinks.weight)
        elif context.as_documents(documents).ids is not None or window:
            o = masked_attention(q, k, v, documents, window, enable_gqa=self.heads != self.kv_heads,
                                 scale=self.cfg.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads,
                                               scale=self.cfg.scale)
        return o.transpose(1, 2).reshape(b, s, self.heads * d)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(h)
        if self.recompute_core:  # selective recompute: keep only qkv, redo attention in backward
            return self.out(checkpoint(self.core, qkv, positions, documents, use_reentrant=False))
        return self.out(self.core(qkv, positions, documents))


class ParallelMLP(nn.Module):
    def __init__(self, grid: Grid, plan: BlockPlan, opts: TensorOptions, *, seed: int, std: float, out_std: float,
                 prefix: str, overlap: Overlapper, rebuild_activation: bool = False):
        super().__init__()
        self.cfg, self.rebuild_activation = plan.cfg, rebuild_activation
        # (compiled, the partitioner chooses what to keep; eager, _SwiGLU keeps gate and up alone)
        self.swiglu, self.gelu = (compiled(swiglu), compiled(gelu)) if opts.compile else (_SwiGLU.apply, gelu)
        self.up = _linear(grid, plan.up, prefix, opts, seed=seed, std=std, overlap=overlap)
        self.down = _linear(grid, plan.down, prefix, opts, seed=seed, std=out_std, overlap=overlap)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.run(h, self.up, self.down)

    def run(self, h: torch.Tensor, up, down) -> torch.Tensor:
        """down(activation(up(h))) with this MLP's activation and recompute (`up`, `down`: its linears,
        or all of a rank's experts' at once, `tensor.experts`)."""
        u = up(h)
        a = self._activation(u)
        if not self.rebuild_activation:
            return down(a)
        # selective recompute: the down projection's input, [tokens, ffn/y], is not kept but rebuilt in
        # backward from u, which the activation keeps anyway (one elementwise op; no GEMM redone)
        with rebuilt_in_backward(a, lambda: self._activation(u)):
            return down(a)

    def _activation(self, u: torch.Tensor) -> torch.Tensor:
        if self.cfg.activation == "geglu_tanh":  # Gemma's
            gate, up = u.chunk(2, dim=-1)
            return self.gelu(gate, "tanh") * up
        if self.cfg.activation == "swiglu_clamped":  # GPT-OSS's
            gate, up = u.chunk(2, dim=-1)
            gate, up = gate.clamp(max=self.cfg.glu_limit), up.clamp(-self.cfg.glu_limit, self.cfg.glu_limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.cfg.glu_alpha))
        if self.cfg.gated:
            return self.swiglu(*u.chunk(2, dim=-1))
        return self.gelu(u, "tanh" if self.cfg.activation == "gelu_tanh" else "none")


def traces_whole(grid: Grid, cfg: BlockConfig) -> bool:
    """Whether a block compiles as one graph: without collectives in it (x, y, z and cp of one rank:
    `comm`'s ledger and process-group calls break a graph), without a mixture (its routing reads
    counts on the host and counts its load outside the graph) and without a sliding window (its bands
    are planned on the host, `spec.ring`). Other blocks keep train.compile's pieces (norms, RoPE,
    activations), compiled between their collectives."""
    return grid.size(("x", "y", "z", "cp")) == 1 and not cfg.moe and not cfg.window


class rebuilt_in_backward(torch.autograd.graph.saved_tensors_hooks):
    """Within it, what autograd saves is kept as usual, except the tensor `dropped`: backward gets
    `rebuild()` in its place, computed then (the same operations on the same inputs: the same values)."""

    def __init__(self, dropped: torch.Tensor, rebuild):
        dropped = weakref.ref(dropped)  # (autograd keeps both hooks with each saved tensor: no strong one here)

        def pack(t: torch.Tensor):
            return _REBUILD if t is dropped() else t

        def unpack(packed):
            if packed is not _REBUILD:
                return packed
            with torch.no_grad():
                return rebuild()

        super().__init__(pack, unpack)


_REBUILD = object()  # what the hooks keep in place of the dropped tensor


class ParallelBlock(nn.Module):
    """h + attn(norm(h)), then + mlp(norm(h)): a pre-norm Llama/GPT block (the MLP a mixture of experts
    when the block config has experts); with `post_norms` (Gemma's), h + norm(attn(norm(h))), then
    + norm(mlp(norm(h)))."""

    def __init__(self, grid: Grid, cfg: BlockConfig, opts: TensorOptions, *, seed: int, std: float = 0.02,
                 out_std: float | None = None, prefix: str = "block", selective_recompute: bool = False,
                 overlap: Overlapper | None = None):
        super().__init__()
        self._whole = None  # the compiled forward (`compile_whole`)
        self.reads_all_parameters = False  # compiled whole: for ZeRO-1's waits (`data.GradientSync`)
        out_std = std if out_std is None else out_std
        overlap = overlap or Overlapper(opts.overlap, grid.group("z"))
        plan = block_plan(cfg, grid.size("x"), grid.size("y"), seq_parallel=opts.seq_parallel,
                          non_redundant=opts.non_redundant)
        norm = dict(seq_parallel=opts.seq_parallel, dtype=opts.dtype, compile=opts.compile)
        self.attn_norm = ParallelNorm(grid, cfg.hidden, cfg.norm, cfg.eps, name=f"{prefix}.attn_norm", **norm)
        # Selective recompute rebuilds the norms' outputs and the MLP activation in backward, eager only
        # (compiled, a rebuilt tensor could round otherwise than the fused forward did).
        self.rebuild_norms = rebuild = selective_recompute and not opts.compile
        if cfg.mla:
            out = _linear(grid, plan.out, prefix, opts, seed=seed, std=out_std, overlap=overlap)
            self.attn = LatentAttention(grid, plan, out, opts, seed=seed, std=std, prefix=prefix,
                                        recompute_core=selective_recompute)
        else:
            self.attn = ParallelAttention(grid, plan, opts, seed=seed, std=std, out_std=out_std, prefix=prefix,
                                          overlap=overlap, recompute_core=selective_recompute)
        self.mlp_norm = ParallelNorm(grid, cfg.hidden, cfg.norm, cfg.eps, name=f"{prefix}.mlp_norm", **norm)
        self.attn_post_norm = self.mlp_post_norm = None
        if cfg.post_norms:
            self.attn_post_norm, self.mlp_post_norm = (
                ParallelNorm(grid, cfg.hidden, cfg.norm, cfg.eps, name=f"{prefix}.{n}", **norm)
                for n in ("attn_post_norm", "mlp_post_norm"))
        def mlp(plan: BlockPlan) -> ParallelMLP:
            return ParallelMLP(grid, plan, opts, seed=seed, std=std, out_std=out_std, prefix=prefix, overlap=overlap,
                               rebuild_activation=rebuild)

        self.mlp = (ParallelMoE(grid, plan, mlp, seed=seed, std=std, prefix=prefix, dtype=opts.dtype,
                                seq_parallel=opts.seq_parallel, capacity_factor=opts.capacity_factor)
                    if cfg.moe else mlp(plan))

    def compile_whole(self, backend: str = "inductor") -> None:
        """Run this block's forward (and so its backward) as one torch.compile graph (train.compile, per
        block as torchtitan compiles): where `traces_whole`, with no graph break
        (tests/parallel/test_compiled_block.py). The block's own forward pre-hooks stay outside the
        graph (ZeRO-1's wait for the block's parameter gathers: `data.GradientSync`). A micro-batch with
        document ids runs eagerly: its masks are planned on the host, which would break the graph and
        compile it again for every batch."""
        self._whole = torch.compile(self._layers, backend=backend, dynamic=False)
        self.reads_all_parameters = True

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | Documents | None = None) -> torch.Tensor:
        documents = context.as_documents(documents)
        if self._whole is not None and documents.ids is None:
            return self._whole(h, positions, documents)
        return self._layers(h, positions, documents)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, documents: Documents) -> torch.Tensor:
        a = self._normed(self.attn_norm, h, lambda n: self.attn(n, positions, documents))
        h = h + (a if self.attn_post_norm is None else self.attn_post_norm(a))
        m = self._normed(self.mlp_norm, h, self.mlp)
        return h + (m if self.mlp_post_norm is None else self.mlp_post_norm(m))

    def _normed(self, norm: ParallelNorm, h: torch.Tensor, then) -> torch.Tensor:
        """then(norm(h)); with selective recompute (eager) the norm's output, the next GEMM's input, is
        not kept but rebuilt in backward from h and its statistics, which the norm keeps anyway."""
        if not self.rebuild_norms:
            return then(norm(h))
        stats = []
        n = norm(h, stats)
        (mean, rstd), = stats
        with rebuilt_in_backward(n, lambda: norm.rebuilt(h, mean, rstd)):
            return then(n)
