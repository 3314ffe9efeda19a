"""The OLMoE family: Llama's attention with RMSNorms over all heads' features of the queries and of the keys
(q_norm: [heads * head_dim], k_norm: [kv_heads * head_dim], applied to the whole projections before the
split into heads and RoPE, unlike Qwen3's per-head norms), and a mixture of SwiGLU experts in every layer:
softmax router, the top-k weights renormalised with norm_topk_prob (off by default), no shared expert
(OlmoeSparseMoeBlock). attention_bias puts biases on q, k, v and o (before the norms)."""

from __future__ import annotations

import dataclasses

from fourfold.models import llama, qwen3_moe
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family
from fourfold.spec.blockspec import BlockConfig

# (num_local_experts: the name OlmoeConfig maps to num_experts)
FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
          "attention_dropout", "clip_qkv", "num_experts", "num_local_experts", "num_experts_per_tok",
          "output_router_logits", "router_aux_loss_coef", "norm_topk_prob"}
# OlmoeConfig's defaults
MAX_POSITIONS, EXPERTS, TOP_K, AUX_LOSS_COEF = 4096, 64, 8, 0.01


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "olmoe")
    require(d, "olmoe", hidden_act=("silu",), attention_dropout=(0, 0.0), clip_qkv=(None,))
    experts = {d[k] for k in ("num_experts", "num_local_experts") if k in d}
    if len(experts) > 1:
        raise ValueError(f"config.json (olmoe) has num_experts={d['num_experts']!r} and num_local_experts="
                         f"{d['num_local_experts']!r} (the same field to transformers); give one")
    experts = experts.pop() if experts else EXPERTS
    heads, bias = d["num_attention_heads"], bool(d.get("attention_bias", False))
    positions = d.get("max_position_embeddings", MAX_POSITIONS)
    return ModelConfig("olmoe", d["hidden_size"], d["num_hidden_layers"], heads, d.get("num_key_value_heads") or heads,
                       d["intermediate_size"], d["vocab_size"], positions, d.get("tie_word_embeddings", False),
                       d.get("rms_norm_eps", 1e-5), llama._rope_theta(d), llama._rope_scaling(d, positions),
                       qkv_bias=bias, out_bias=bias, experts=experts, top_k=d.get("num_experts_per_tok", TOP_K),
                       norm_topk=bool(d.get("norm_topk_prob", False)),
                       aux_loss=bool(d.get("output_router_logits", False)),
                       aux_loss_coef=float(d.get("router_aux_loss_coef", AUX_LOSS_COEF)))


def to_hf(cfg: ModelConfig) -> dict:
    out = llama.to_hf(dataclasses.replace(cfg, family="llama", hf_type=""))
    del out["mlp_bias"]
    out.update(model_type="olmoe", architectures=["OlmoeForCausalLM"], attention_bias=cfg.qkv_bias, clip_qkv=None,
               num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk,
               output_router_logits=cfg.aux_loss, router_aux_loss_coef=cfg.aux_loss_coef)
    return out


def block(cfg: ModelConfig) -> BlockConfig:
    return dataclasses.replace(llama.block(cfg), qk_norm_all_heads=True, experts=cfg.experts, top_k=cfg.top_k,
                               norm_topk=cfg.norm_topk)


# Qwen3-MoE's checkpoint names (self_attn.q_norm, k_norm; the experts one by one, mlp.gate the router)
FAMILY = Family("olmoe", ("olmoe",), from_hf, to_hf, block, qwen3_moe.tensors, default_pad=1)
