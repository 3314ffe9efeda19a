"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) on the 3D grid.

The queries come from a latent of q_lora features, the keys' and values' per-head parts from a latent
of kv_lora features, and one rotary key part of rope features shared by every head:
    q = q_b(norm(q_a(h)))                    [heads, nope + rope]
    kv_latent, k_rot = kv_a(h)               [kv_lora], [rope]
    k_nope, v = kv_b(norm(kv_latent))        [heads, nope], [heads, v]
    k = (k_nope, rope(k_rot)), q = (q_nope, rope(q_rot)); o = out(attention(q, k, v))

How the grid holds it (docs/architecture.md, "Multi-head latent attention"):
- q_a and kv_a are small ([q_lora, hidden] and [kv_lora + rope, hidden]: 15M of V3's 187M attention
  parameters a layer): `moe.ReplicatedLinear`, columns split over x as the stream's features, the
  products all-reduced over x, replicated over y and z. Every rank of a tensor group then holds the
  whole latents of its tokens (gathered over y first with sequence parallelism), and their norms
  (whole weights, no collective).
- q_b and kv_b are per head (`HeadLinear`): each rank keeps its heads' rows, as the QKV projection's
  (x*y head groups on the non-redundant path, y on the published one), no collective forward. Each
  rank's heads give part of the latents' gradient: it is all-reduced over the head group once
  (`regions.sum_gradients`, on q's latent, kv's latent and the rotary key), after which every rank's
  gradient into q_a, kv_a, their norms and the stream is whole. Their weights are not split over z
  (the weights z-shards are the linears' own machinery): replicated over z.
- The output projection is the block plan's, on heads * v features.
Flash kernels (torch's CPU one, FlashAttention on CUDA, the ring's) take one head size: v is padded
with zeros to nope + rope features (exact; 1.5x the PV product and V's bytes on the ring for V3), and
the output cut back. A kernel that takes a smaller V head (cuDNN's, TE's) would save that: a GPU lever.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.parallel import comm
from fourfold.parallel.comm import Group
from fourfold.parallel.context import as_documents, ring_attention
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor import init, regions
from fourfold.parallel.tensor.moe import ReplicatedLinear
from fourfold.parallel.tensor.norm import _QKNorm
from fourfold.parallel.tensor.params import ParallelModule, ParamLayout, Piece
from fourfold.spec.blockspec import BlockPlan


def head_chunk(grid: Grid, own_heads: bool) -> int:
    """The chunk of the heads this rank holds: y * x_size + x on the non-redundant path, y on the published one."""
    c = grid.coords
    return c["y"] * grid.size("x") + c["x"] if own_heads else c["y"]


def head_group(grid: Grid, own_heads: bool) -> Group:
    """The ranks holding the other heads of this rank's tokens, named as the volumes name it."""
    group = grid.group(("x", "y")) if own_heads else grid.group("y")
    return Group("x_y" if own_heads else "y", group.process_group, group.ranks, group.rank, grid.ledger, grid.clock)


class HeadLinear(ParallelModule):
    """[..., in] (held whole) -> [..., local heads * per_head]: this rank's heads' rows of the serial
    [heads * per_head, in] weight, no collective. Its gradient is summed over z (other tokens); the
    x ranks of the published path compute the same heads (replicated over x)."""

    def __init__(self, grid: Grid, heads: int, local: int, per_head: int, in_features: int, *, own_heads: bool,
                 name: str, seed: int, std: float, dtype: torch.dtype):
        super().__init__()
        self.grid, self.name, self.seed, self.std, self.own_heads = grid, name, seed, std, own_heads
        self.rows, self.local_rows, self.cols = heads * per_head, local * per_head, in_features
        self.row0 = head_chunk(grid, own_heads) * self.local_rows
        self.weight = nn.Parameter(torch.empty(self.local_rows * in_features, dtype=dtype))
        self.initialise()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        rows, cols = torch.arange(self.local_rows)[:, None] + self.row0, torch.arange(self.cols)[None, :]
        self.weight.copy_(init.normal(self.seed, self.name, rows * self.cols + cols, self.std,
                                      self.weight.dtype).reshape(-1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.view(self.local_rows, self.cols).t()

    def load(self, read, put) -> None:
        put(self.weight, read(self.name, slice(self.row0, self.row0 + self.local_rows),
                              slice(0, self.cols)).reshape(-1))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        piece = Piece(self.name, (self.rows, self.cols), (self.row0, 0), (self.local_rows, self.cols),
                      (0, self.local_rows * self.cols), 0)
        return {self.weight: ParamLayout(("z",), ("z",) if self.own_heads else ("x", "z"), (piece,))}

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        t = pick(self.weight).detach().view(self.local_rows, self.cols)
        if self.own_heads:  # chunk y * x_size + x: over x within a y block, then the y blocks
            t = comm.all_gather(t, self.grid.group("x"))
        return {self.name: comm.all_gather(t, self.grid.group("y"))}


class LatentNorm(_QKNorm):
    """RMSNorm of a latent every rank of the tensor group holds whole (its weight whole, no collective;
    its gradient, whole on every rank once the latent's is summed over the head group, summed over z)."""

    def __init__(self, grid: Grid, features: int, eps: float, *, dtype: torch.dtype, name: str):
        alone = Group(f"{name}.alone", None, (grid.rank,), 0, grid.ledger)
        super().__init__(grid, name, eps, False, dtype, features=features, group=alone, offset=0, local=features,
                         grad_sum=("z",), replicated=("x", "y", "z"))

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        return {f"{self.name}.weight": pick(self.weight).detach()}


def rotate_interleaved(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on interleaved pairs (x0, x1), (x2, x3), ... (transformers'
    apply_rotary_pos_emb_interleave: the rotated pairs' first elements, then their seconds)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = t[..., 0::2], t[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, grid: Grid, plan: BlockPlan, out: nn.Module, opts, *, seed: int, std: float, prefix: str,
                 recompute_core: bool = False):
        """`out`: the output projection (the block plan's, on heads * v features)."""
        super().__init__()
        from fourfold.parallel.tensor.block import rope_tables, rotate  # (block imports this module)

        cfg = self.cfg = plan.cfg
        self.grid, self.cp, self.seq_parallel, self.recompute_core = grid, grid.group("cp"), opts.seq_parallel, \
            recompute_core
        self.rope_tables, self.rotate = rope_tables, rotate
        self.heads, own = plan.local_heads, plan.attention_chunks == grid.size("x") * grid.size("y")
        self.group = head_group(grid, own)
        qk = cfg.nope_dim + cfg.rope_dim
        linear = dict(seed=seed, std=std, dtype=opts.dtype)
        self.q_a = ReplicatedLinear(grid, cfg.hidden, cfg.q_lora, name=f"{prefix}.attn.q_a", bias=cfg.qkv_bias,
                                    **linear)
        self.q_a_norm = LatentNorm(grid, cfg.q_lora, cfg.eps, dtype=opts.dtype, name=f"{prefix}.attn.q_a_norm")
        self.q_b = HeadLinear(grid, cfg.heads, self.heads, qk, cfg.q_lora, own_heads=own, name=f"{prefix}.attn.q_b",
                              **linear)
        self.kv_a = ReplicatedLinear(grid, cfg.hidden, cfg.kv_lora + cfg.rope_dim, name=f"{prefix}.attn.kv_a",
                                     bias=cfg.qkv_bias, **linear)
        self.kv_a_norm = LatentNorm(grid, cfg.kv_lora, cfg.eps, dtype=opts.dtype, name=f"{prefix}.attn.kv_a_norm")
        self.kv_b = HeadLinear(grid, cfg.heads, self.heads, cfg.nope_dim + cfg.v_dim, cfg.kv_lora, own_heads=own,
                               name=f"{prefix}.attn.kv_b", **linear)
        self.out = out

    def forward(self, h: torch.Tensor, positions: torch.Tensor, documents=None) -> torch.Tensor:
        if self.seq_parallel:  # every y rank projects the whole sequence's latents (its heads differ)
            h = regions.gather_tokens_replicated(h, self.grid.group("y"))
        q = self.q_b(regions.sum_gradients(self.q_a_norm(self.q_a(h)), self.group))
        latent, k_rot = self.kv_a(h).split([self.cfg.kv_lora, self.cfg.rope_dim], dim=-1)
        kv = self.kv_b(regions.sum_gradients(self.kv_a_norm(latent), self.group))
        k_rot = regions.sum_gradients(k_rot, self.group)
        if self.recompute_core:  # selective recompute: keep q, kv and k_rot, redo RoPE and attention in backward
            o = torch.utils.checkpoint.checkpoint(self.core, q, kv, k_rot, positions, documents, use_reentrant=False)
        else:
            o = self.core(q, kv, k_rot, positions, documents)
        return self.out(o)

    def core(self, q, kv, k_rot, positions, documents) -> torch.Tensor:
        """[b, s, local heads * v] from the per-head q [b, s, heads * (nope + rope)], kv [b, s, heads *
        (nope + v)] and the shared rotary key [b, s, rope]."""
        cfg, b, s = self.cfg, q.shape[0], q.shape[1]
        q = q.view(b, s, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.view(b, s, self.heads, -1).transpose(1, 2).split([cfg.nope_dim, cfg.v_dim], dim=-1)
        q_nope, q_rot = q.split([cfg.nope_dim, cfg.rope_dim], dim=-1)
        cos, sin = self.rope_tables(positions, positions.numel() * self.cp.size, cfg.rope_dim, cfg.rope_theta,
                                    cfg.rope_scaling, q.dtype)
        rotate = rotate_interleaved if cfg.rope_interleave else self.rotate
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[:, None], cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.heads, -1, -1)], dim=-1)
        # flash kernels take one head size: V padded with zeros to q's and k's, the output cut back
        v = F.pad(v, (0, q.shape[-1] - cfg.v_dim))
        if self.cp.size > 1:
            o = ring_attention(q, k, v, self.cp, documents, scale=cfg.scale)
        elif as_documents(documents).ids is not None:
            from fourfold.parallel.tensor.block import masked_attention  # (block imports this module)

            o = masked_attention(q, k, v, documents, enable_gqa=False, scale=cfg.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.scale)
        o = o[..., : cfg.v_dim]
        return o.transpose(1, 2).reshape(b, s, self.heads * cfg.v_dim)

