"""The Qwen2-MoE family: Qwen2's attention (q, k, v biases) with a mixture of SwiGLU experts in
every layer, softmax router (the top-k weights renormalised with norm_topk_prob), and a shared
expert under a sigmoid gate (Qwen2MoeSparseMoeBlock)."""

from __future__ import annotations

import dataclasses

from fourfold.models import llama
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "hidden_act", "attention_dropout",
          "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "qkv_bias",
          "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "shared_expert_intermediate_size",
          "num_experts", "num_experts_per_tok", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef"}
# Qwen2MoeConfig's defaults
MAX_POSITIONS, EXPERTS, TOP_K, AUX_LOSS_COEF = 32768, 60, 4, 0.001


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "qwen2_moe")
    require(d, "qwen2_moe", hidden_act=("silu",), attention_dropout=(0, 0.0), decoder_sparse_step=(1,),
            mlp_only_layers=([],))
    if d.get("use_sliding_window") or any(t != "full_attention" for t in d.get("layer_types") or []):
        raise ValueError("config.json (qwen2_moe) uses sliding-window layers (use_sliding_window / layer_types); "
                         "fourfold's attention is full causal: use a config with use_sliding_window false")
    if d.get("num_experts", EXPERTS) == 0:
        raise ValueError("config.json (qwen2_moe) has num_experts=0 (dense layers); give it as a qwen2 model")
    heads = d["num_attention_heads"]
    positions = d.get("max_position_embeddings", MAX_POSITIONS)
    return ModelConfig("qwen2_moe", d["hidden_size"], d["num_hidden_layers"], heads,
                       d.get("num_key_value_heads") or heads, d["moe_intermediate_size"], d["vocab_size"], positions,
                       d.get("tie_word_embeddings", False), d.get("rms_norm_eps", 1e-6), llama._rope_theta(d),
                       llama._rope_scaling(d, positions), qkv_bias=bool(d.get("qkv_bias", True)),
                       experts=d.get("num_experts", EXPERTS), top_k=d.get("num_experts_per_tok", TOP_K),
                       norm_topk=bool(d.get("norm_topk_prob", False)),
                       shared_ffn=d.get("shared_expert_intermediate_size", 0) or 0,
                       aux_loss=bool(d.get("output_router_logits", False)),
                       aux_loss_coef=float(d.get("router_aux_loss_coef", AUX_LOSS_COEF)))


def to_hf(cfg: ModelConfig) -> dict:
    out = llama.to_hf(dataclasses.replace(cfg, family="llama", hf_type="qwen2"))
    # intermediate_size is the dense layers' (none here: decoder_sparse_step 1, no mlp_only_layers)
    out.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], qkv_bias=cfg.qkv_bias,
               moe_intermediate_size=cfg.ffn, shared_expert_intermediate_size=cfg.shared_ffn, num_experts=cfg.experts,
               num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk, output_router_logits=cfg.aux_loss,
               router_aux_loss_coef=cfg.aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[],
               use_sliding_window=False)
    return out


def block(cfg: ModelConfig) -> BlockConfig:
    return dataclasses.replace(llama.block(cfg), experts=cfg.experts, top_k=cfg.top_k, norm_topk=cfg.norm_topk,
                               shared_ffn=cfg.shared_ffn)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    out = {ours: t for ours, t in llama.tensors(cfg).items() if ".mlp." not in ours}
    for i in range(cfg.layers):
        p, moe = f"layers.{i}.mlp", f"model.layers.{i}.mlp"
        out[f"{p}.router"] = HFTensor(f"{moe}.gate.weight")
        experts = [(f"{p}.experts.{e}", f"{moe}.experts.{e}") for e in range(cfg.experts)]
        if cfg.shared_ffn:
            experts.append((f"{p}.shared", f"{moe}.shared_expert"))
            out[f"{p}.shared_gate"] = HFTensor(f"{moe}.shared_expert_gate.weight")
        for ours, theirs in experts:  # transformers saves the experts one by one
            for n in ("gate", "up", "down"):
                out[f"{ours}.{n}"] = HFTensor(f"{theirs}.{n}_proj.weight")
    return out


FAMILY = Family("qwen2_moe", ("qwen2_moe",), from_hf, to_hf, block, tensors)
