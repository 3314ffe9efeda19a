"""Parameter and FLOP counts of a model, from its block: computed once, here, for the model config,
the trainer's MFU and the planner alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fourfold.models.config import ModelConfig


def layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matrix parameters, vector parameters) of one block: 2h^2(1 + k/a) + 3hF and 2h for Llama."""
    b = cfg.block
    d = b.head_dim
    matrices = cfg.hidden * (cfg.heads + 2 * cfg.kv_heads) * d + cfg.heads * d * cfg.hidden
    matrices += (3 if b.gated else 2) * cfg.hidden * cfg.ffn
    vectors = (2 if b.norm == "rms" else 4) * cfg.hidden
    vectors += (cfg.heads + 2 * cfg.kv_heads) * d if b.qkv_bias else 0
    vectors += cfg.hidden if b.out_bias else 0
    vectors += ((2 if b.gated else 1) * cfg.ffn + cfg.hidden) if b.mlp_bias else 0
    return matrices, vectors


def parameter_count(cfg: ModelConfig) -> int:
    """Every parameter, a tied embedding once (transformers' count)."""
    matrices, vectors = layer_params(cfg)
    embed = cfg.vocab * cfg.hidden * (1 if cfg.tied else 2)
    positions = cfg.max_positions * cfg.hidden if cfg.family_spec().learned_positions else 0
    final_norm = cfg.hidden * (1 if cfg.block.norm == "rms" else 2)
    return cfg.layers * (matrices + vectors) + embed + positions + final_norm


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """6 N (non-embedding parameters) + 6 L h s for causal attention (forward and backward)."""
    matrices, _ = layer_params(cfg)
    return 6 * (matrices * cfg.layers + cfg.hidden * cfg.vocab) + 6 * cfg.layers * cfg.hidden * seq
