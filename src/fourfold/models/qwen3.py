"""The Qwen3 family: Llama's block (RoPE, grouped-query attention, SwiGLU, RMSNorm) with an RMSNorm over
each head's features of the queries and of the keys (q_norm, k_norm: a [head_dim] weight each, before
RoPE), an explicit head_dim, and attention_bias on q, k, v and o together (Qwen3Attention)."""

from __future__ import annotations

import dataclasses

from fourfold.models import llama
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
          "hidden_act", "attention_dropout", "sliding_window", "use_sliding_window", "max_window_layers",
          "layer_types"}
# Qwen3Config's defaults
MAX_POSITIONS, HEAD_DIM = 32768, 128


def attention_fields(d: dict, kind: str, head_dim: int) -> dict:
    """ModelConfig's fields but the MLP's, from a Qwen3 config.json: the head size (`head_dim` when
    config.json has none: Qwen3Config's 128, Qwen3MoeConfig's hidden / heads; kept as 0 when it is
    hidden / heads), the four biases under attention_bias, RoPE."""
    require(d, kind, hidden_act=("silu",), attention_dropout=(0, 0.0))
    if kind != "qwen3" and d.get("use_sliding_window"):  # (Qwen3-MoE's window is every layer's: not read)
        raise ValueError(f"config.json ({kind}) uses sliding-window layers (use_sliding_window); fourfold reads "
                         "Qwen2's and Qwen3's: use a config with use_sliding_window false")
    kinds, window = llama.qwen_sliding_layers(d)
    hidden, heads, bias = d["hidden_size"], d["num_attention_heads"], bool(d.get("attention_bias", False))
    positions = d.get("max_position_embeddings", MAX_POSITIONS)
    size = d.get("head_dim") or head_dim
    return dict(hidden=hidden, layers=d["num_hidden_layers"], heads=heads,
                kv_heads=d.get("num_key_value_heads") or heads, vocab=d["vocab_size"], max_positions=positions,
                tied=d.get("tie_word_embeddings", False), eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=llama._rope_theta(d), rope_scaling=llama._rope_scaling(d, positions),
                head_dim=0 if size * heads == hidden else size, qkv_bias=bias, out_bias=bias, sliding_window=window,
                layer_types=kinds)


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "qwen3")
    return ModelConfig("qwen3", ffn=d["intermediate_size"], **attention_fields(d, "qwen3", HEAD_DIM))


def attention_to_hf(cfg: ModelConfig) -> dict:
    out = llama.to_hf(dataclasses.replace(cfg, family="llama", hf_type=""))
    del out["mlp_bias"]
    out.update(attention_bias=cfg.qkv_bias, head_dim=cfg.block.head_dim, **llama.qwen_sliding_to_hf(cfg))
    return out


def to_hf(cfg: ModelConfig) -> dict:
    return dict(attention_to_hf(cfg), model_type="qwen3", architectures=["Qwen3ForCausalLM"])


def block(cfg: ModelConfig) -> BlockConfig:
    return dataclasses.replace(llama.block(cfg), qk_norm=True)


def attention_tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    """llama's names, with each layer's q_norm and k_norm weights."""
    out = llama.tensors(cfg)
    for i in range(cfg.layers):
        for n in ("q_norm", "k_norm"):
            out[f"layers.{i}.attn.{n}.weight"] = HFTensor(f"model.layers.{i}.self_attn.{n}.weight")
    return out


FAMILY = Family("qwen3", ("qwen3",), from_hf, to_hf, block, attention_tensors)
