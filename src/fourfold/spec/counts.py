"""Parameter and FLOP counts of a model, from its block: computed once, here, for the model config,
the trainer's MFU and the planner alike."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fourfold.models.config import ModelConfig
    from fourfold.spec.blockspec import BlockConfig


def layer_params(cfg: ModelConfig, active: bool = False, block: BlockConfig | None = None) -> tuple[int, int]:
    """(matrix parameters, vector parameters) of one block (`block`, default the model's): 2h^2(1 + k/a)
    + 3hF and 2h for Llama (4h with Gemma's norms after attention and the MLP; plus Qwen3's two
    [head_dim] q/k norm weights, or OLMoE's [heads * head_dim] and [kv_heads * head_dim] ones). Latent
    attention: its two down-projections, two per-head up-projections, the output and the latents'
    norms. A mixture's MLP: every expert's 3hF (with `active`, the top_k a token runs through), the
    router's E h, and a shared expert's 3hF_s with its gate's h."""
    b = block or cfg.block
    h, d, heads, kv = b.hidden, b.head_dim, b.heads, b.kv_heads
    if b.mla:
        matrices = (h * b.q_lora + b.q_lora * heads * d + h * (b.kv_lora + b.rope_dim)
                    + b.kv_lora * heads * (b.nope_dim + b.v_dim) + heads * b.v_dim * h)
        vectors = b.q_lora + b.kv_lora + ((b.q_lora + b.kv_lora + b.rope_dim + h) if b.qkv_bias else 0)
    else:
        matrices = h * (heads + 2 * kv) * d + heads * d * h
        vectors = (heads + 2 * kv) * d if b.qkv_bias else 0
        vectors += h if b.out_bias else 0
    mlp = (3 if b.gated else 2) * h * b.ffn
    if b.moe:
        mlp = mlp * (b.top_k if active else b.experts) + b.experts * h
        mlp += (3 * h * b.shared_ffn + (h if b.shared_gate else 0)) if b.shared_ffn else 0
    matrices += mlp
    vectors += (2 if b.norm != "layer" else 4) * (2 if b.post_norms else 1) * h
    vectors += 2 * d if b.qk_norm else 0
    vectors += heads if b.sinks else 0
    vectors += (heads + kv) * d if b.qk_norm_all_heads else 0
    mlp_biases = ((2 if b.gated else 1) * b.ffn + h) if b.mlp_bias else 0
    vectors += mlp_biases * ((b.top_k if active else b.experts) if b.moe else 1)  # (GPT-OSS's experts have them)
    vectors += b.experts if b.router_bias else 0
    return matrices, vectors


def parameter_count(cfg: ModelConfig, active: bool = False) -> int:
    """Every parameter, a tied embedding once (transformers' count); with `active`, a mixture's
    parameters one token runs through (its top_k experts). Layers of several kinds each count theirs."""
    layers = sum(n * sum(layer_params(cfg, active, block)) for block, n in cfg.layer_kinds)
    embed = cfg.vocab * cfg.hidden * (1 if cfg.tied else 2)
    positions = cfg.max_positions * cfg.hidden if cfg.family_spec().learned_positions else 0
    final_norm = cfg.hidden * (2 if cfg.block.norm == "layer" else 1)
    return layers + embed + positions + final_norm


def attended_pairs(seq: int, window: int) -> int:
    """(query, key) pairs causal attention over `seq` tokens computes: seq (seq + 1) / 2, or with a
    sliding window shorter than the sequence, min(position + 1, window) keys a query."""
    if not window or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


@functools.lru_cache(maxsize=4096)  # the planner asks for it at every evaluation
def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """6 N (non-embedding parameters a token runs through: a mixture's active ones, each layer's as
    its kind) + 6 L h s for causal attention (forward and backward; 12 h FLOPs per pair of the seq/2
    keys a query sees, fewer under a sliding window)."""
    matrices = sum(n * layer_params(cfg, True, b)[0] for b, n in cfg.layer_kinds) / cfg.layers
    share = cfg.attention_share(seq)
    keys = seq / 2 if share == 1.0 else share * attended_pairs(seq, 0) / seq
    b = cfg.block  # a pair's QK^T and PV: heads * (qk + v) / 2 features for latent attention, else hidden
    width = b.heads * (b.head_dim + b.v_dim) / 2 if b.mla else cfg.hidden
    return 6 * (matrices * cfg.layers + cfg.hidden * cfg.vocab) + 12 * cfg.layers * width * keys
