"""The Mixtral family: Mistral's attention (a sliding window) with a mixture of SwiGLU experts in
place of the MLP; softmax router, the top-k weights renormalised (MixtralTopKRouter)."""

from __future__ import annotations

import dataclasses

from fourfold.models import llama
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "hidden_act",
          "attention_dropout", "sliding_window", "num_local_experts", "num_experts_per_tok", "output_router_logits",
          "router_aux_loss_coef", "router_jitter_noise"}
MAX_POSITIONS = 131072  # MixtralConfig's max_position_embeddings
# MixtralConfig's num_local_experts, num_experts_per_tok, router_aux_loss_coef
EXPERTS, TOP_K, AUX_LOSS_COEF = 8, 2, 0.001


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "mixtral")
    require(d, "mixtral", hidden_act=("silu",), attention_dropout=(0, 0.0), router_jitter_noise=(0, 0.0))
    heads = d["num_attention_heads"]
    positions = d.get("max_position_embeddings", MAX_POSITIONS)
    return ModelConfig("mixtral", d["hidden_size"], d["num_hidden_layers"], heads,
                       d.get("num_key_value_heads") or heads, d["intermediate_size"], d["vocab_size"], positions,
                       d.get("tie_word_embeddings", False), d.get("rms_norm_eps", 1e-5), llama._rope_theta(d),
                       llama._rope_scaling(d, positions), head_dim=d.get("head_dim") or 0,
                       sliding_window=d.get("sliding_window") or 0, experts=d.get("num_local_experts", EXPERTS),
                       top_k=d.get("num_experts_per_tok", TOP_K), norm_topk=True,
                       aux_loss=bool(d.get("output_router_logits", False)),
                       aux_loss_coef=float(d.get("router_aux_loss_coef", AUX_LOSS_COEF)))


def to_hf(cfg: ModelConfig) -> dict:
    out = {k: v for k, v in llama.to_hf(dataclasses.replace(cfg, family="llama", hf_type="mistral")).items()}
    out.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=cfg.experts,
               num_experts_per_tok=cfg.top_k, output_router_logits=cfg.aux_loss,
               router_aux_loss_coef=cfg.aux_loss_coef)
    return out


def block(cfg: ModelConfig) -> BlockConfig:
    return dataclasses.replace(llama.block(cfg), experts=cfg.experts, top_k=cfg.top_k, norm_topk=cfg.norm_topk)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    out = {ours: t for ours, t in llama.tensors(cfg).items() if ".mlp." not in ours}
    for i in range(cfg.layers):
        moe = f"model.layers.{i}.block_sparse_moe"
        out[f"layers.{i}.mlp.router"] = HFTensor(f"{moe}.gate.weight")
        for e in range(cfg.experts):  # transformers saves the experts one by one (w1 gate, w3 up, w2 down)
            for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                out[f"layers.{i}.mlp.experts.{e}.{ours}"] = HFTensor(f"{moe}.experts.{e}.{theirs}.weight")
    return out


FAMILY = Family("mixtral", ("mixtral",), from_hf, to_hf, block, tensors)
