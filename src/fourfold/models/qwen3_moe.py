"""The Qwen3-MoE family: Qwen3's attention (per-head q/k norms) with a mixture of SwiGLU experts in
every layer, softmax router, the top-k weights renormalised with norm_topk_prob, no shared expert
(Qwen3MoeSparseMoeBlock)."""

from __future__ import annotations

import dataclasses

from fourfold.models import qwen2_moe, qwen3
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

# (num_local_experts: the name Qwen3MoeConfig writes num_experts under; published config.json files use num_experts)
FIELDS = qwen3.FIELDS | {"decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "num_experts",
                         "num_local_experts", "num_experts_per_tok", "norm_topk_prob", "output_router_logits",
                         "router_aux_loss_coef"}
# Qwen3MoeConfig's defaults
EXPERTS, TOP_K, AUX_LOSS_COEF = 128, 8, 0.001


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "qwen3_moe")
    # intermediate_size is the dense layers' MLP, which these two would place
    require(d, "qwen3_moe", decoder_sparse_step=(1,), mlp_only_layers=([], None))
    experts = {d[k] for k in ("num_experts", "num_local_experts") if k in d}
    if len(experts) > 1:
        raise ValueError(f"config.json (qwen3_moe) has num_experts={d['num_experts']!r} and num_local_experts="
                         f"{d['num_local_experts']!r} (the same field to transformers); give one")
    experts = experts.pop() if experts else EXPERTS
    if experts == 0:
        raise ValueError("config.json (qwen3_moe) has num_experts=0 (dense layers); give it as a qwen3 model")
    fields = qwen3.attention_fields(d, "qwen3_moe", d["hidden_size"] // d["num_attention_heads"])
    return ModelConfig("qwen3_moe", ffn=d["moe_intermediate_size"], experts=experts,
                       top_k=d.get("num_experts_per_tok", TOP_K), norm_topk=bool(d.get("norm_topk_prob", False)),
                       aux_loss=bool(d.get("output_router_logits", False)),
                       aux_loss_coef=float(d.get("router_aux_loss_coef", AUX_LOSS_COEF)), **fields)


def to_hf(cfg: ModelConfig) -> dict:
    out = qwen3.attention_to_hf(cfg)
    out.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=cfg.ffn,
               num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk,
               output_router_logits=cfg.aux_loss, router_aux_loss_coef=cfg.aux_loss_coef, decoder_sparse_step=1,
               mlp_only_layers=[])
    return out


def block(cfg: ModelConfig) -> BlockConfig:
    return dataclasses.replace(qwen3.block(cfg), experts=cfg.experts, top_k=cfg.top_k, norm_topk=cfg.norm_topk)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Qwen3's attention names, Qwen2-MoE's experts (transformers saves them one by one)."""
    mlp = {ours: t for ours, t in qwen2_moe.tensors(cfg).items() if ".mlp." in ours}
    return {**{ours: t for ours, t in qwen3.attention_tensors(cfg).items() if ".mlp." not in ours}, **mlp}


FAMILY = Family("qwen3_moe", ("qwen3_moe",), from_hf, to_hf, block, tensors)
