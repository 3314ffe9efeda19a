"""The DeepSeek-V3 family (DeepseekV3ForCausalLM; DeepSeek-R1 and Kimi K2 share it): multi-head latent
attention (`parallel.tensor.latent`: low-rank q and kv projections with their norms, a rotary key
part shared by the heads, RoPE on interleaved pairs), the first `first_k_dense_replace` layers dense,
the others a mixture of SwiGLU experts with an ungated shared expert and DeepSeek's routing: sigmoid
scores, a balancing bias (e_score_correction_bias) added for the choice only, the best topk_group of
n_group expert groups by their two best scores, top-k within them, the chosen scores renormalised
and times routed_scaling_factor. No load-balancing loss (the bias balances). Multi-token prediction
layers (num_mtp_layers) are not part of transformers' model and not of fourfold's: they are neither
read nor trained."""

from __future__ import annotations

import dataclasses
import math

from fourfold.models import llama
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "num_local_experts", "routed_scaling_factor",
          "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
          "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "hidden_act",
          "rms_norm_eps", "pretraining_tp", "rope_parameters", "rope_scaling", "rope_theta", "rope_interleave",
          "attention_bias", "attention_dropout", "num_mtp_layers", "output_router_logits", "head_dim",
          "qk_head_dim", "aux_loss_alpha", "seq_aux", "topk_method", "scoring_func", "ep_size", "moe_layer_freq",
          "num_nextn_predict_layers"}
# DeepseekV3Config's defaults
DEFAULTS = dict(max_position_embeddings=4096, rms_norm_eps=1e-6, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                norm_topk_prob=True, rope_interleave=True, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                v_head_dim=128, qk_nope_head_dim=128)


def _scale(rope: dict, qk_head_dim: int) -> float:
    """transformers' DeepseekV3Attention.scaling: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)
    squared under a scaled RoPE."""
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0
        scale *= mscale * mscale
    return scale


def notes(d: dict) -> list[str]:
    """What a run of this config.json should be told once (the training header): the multi-token
    prediction layers the published checkpoints have, which are not trained (refusing them would
    refuse DeepSeek-V3 itself)."""
    mtp = d.get("num_nextn_predict_layers") or d.get("num_mtp_layers") or 0
    return [f"config.json has {mtp} multi-token prediction layer(s); fourfold trains the main model only, as "
            f"transformers' DeepseekV3ForCausalLM does: their weights are left out of import, training and export"
            ] if mtp else []


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "deepseek_v3")
    require(d, "deepseek_v3", hidden_act=("silu",), attention_dropout=(0, 0.0), pretraining_tp=(1, None),
            output_router_logits=(False,), topk_method=("noaux_tc",), scoring_func=("sigmoid",), moe_layer_freq=(1,))
    get = {**DEFAULTS, **d}.get
    if not get("q_lora_rank"):
        raise ValueError("config.json (deepseek_v3) has no q_lora_rank (queries projected directly, DeepSeek-V2-Lite's "
                         "way); fourfold's latent attention takes the query latent: use a model with q_lora_rank")
    heads = d["num_attention_heads"]
    positions = get("max_position_embeddings")
    nope, rope_dim = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    rope = llama._rope_parameters(d)
    return ModelConfig("deepseek_v3", d["hidden_size"], d["num_hidden_layers"], heads,
                       d.get("num_key_value_heads") or heads, get("moe_intermediate_size"), d["vocab_size"], positions,
                       d.get("tie_word_embeddings", False), get("rms_norm_eps"), llama._rope_theta(d),
                       llama._rope_scaling(d, positions), head_dim=nope + rope_dim,
                       qkv_bias=bool(d.get("attention_bias", False)), out_bias=bool(d.get("attention_bias", False)),
                       experts=d.get("n_routed_experts", d.get("num_local_experts", DEFAULTS["n_routed_experts"])),
                       top_k=get("num_experts_per_tok"), norm_topk=bool(get("norm_topk_prob")),
                       shared_ffn=get("moe_intermediate_size") * get("n_shared_experts"),
                       attention_scale=_scale(rope, nope + rope_dim), q_lora=get("q_lora_rank"),
                       kv_lora=get("kv_lora_rank"), nope_dim=nope, rope_dim=rope_dim, v_dim=get("v_head_dim"),
                       dense_layers=get("first_k_dense_replace"), dense_ffn=d["intermediate_size"],
                       groups=get("n_group"), top_groups=get("topk_group"),
                       routed_scale=float(get("routed_scaling_factor")), rope_interleave=bool(get("rope_interleave")))


def to_hf(cfg: ModelConfig) -> dict:
    out = llama.to_hf(dataclasses.replace(cfg, family="llama", hf_type="", dense_layers=0))
    for k in ("mlp_bias", "head_dim"):
        out.pop(k, None)
    out.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], intermediate_size=cfg.dense_ffn,
               moe_intermediate_size=cfg.ffn, n_shared_experts=cfg.shared_ffn // cfg.ffn, n_routed_experts=cfg.experts,
               routed_scaling_factor=cfg.routed_scale, kv_lora_rank=cfg.kv_lora, q_lora_rank=cfg.q_lora,
               qk_rope_head_dim=cfg.rope_dim, v_head_dim=cfg.v_dim, qk_nope_head_dim=cfg.nope_dim, n_group=cfg.groups,
               topk_group=cfg.top_groups, num_experts_per_tok=cfg.top_k, first_k_dense_replace=cfg.dense_layers,
               norm_topk_prob=cfg.norm_topk, rope_interleave=cfg.rope_interleave, num_mtp_layers=0)
    return out


def block(cfg: ModelConfig) -> BlockConfig:
    """The mixture layers' block (`ModelConfig.layer_block` gives the first dense ones theirs)."""
    return dataclasses.replace(llama.block(cfg), window=0, head_size=cfg.nope_dim + cfg.rope_dim,
                               experts=cfg.experts, top_k=cfg.top_k, norm_topk=cfg.norm_topk, shared_ffn=cfg.shared_ffn,
                               shared_gate=False, routing="sigmoid_grouped", groups=cfg.groups,
                               top_groups=cfg.top_groups, routed_scale=cfg.routed_scale, q_lora=cfg.q_lora,
                               kv_lora=cfg.kv_lora, nope_dim=cfg.nope_dim, rope_dim=cfg.rope_dim, v_dim=cfg.v_dim,
                               rope_interleave=cfg.rope_interleave, attention_scale=cfg.attention_scale)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    names = {"embed": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tied:
        names["lm_head"] = "lm_head.weight"
    for i in range(cfg.layers):
        p, h = f"layers.{i}", f"model.layers.{i}"
        names[f"{p}.attn_norm.weight"] = f"{h}.input_layernorm.weight"
        names[f"{p}.mlp_norm.weight"] = f"{h}.post_attention_layernorm.weight"
        for ours, theirs in (("q_a", "q_a_proj"), ("q_b", "q_b_proj"), ("kv_a", "kv_a_proj_with_mqa"),
                             ("kv_b", "kv_b_proj"), ("o", "o_proj")):
            names[f"{p}.attn.{ours}"] = f"{h}.self_attn.{theirs}.weight"
        if cfg.qkv_bias:  # attention_bias: on the down-projections and o (transformers' DeepseekV3Attention)
            for ours, theirs in (("q_a", "q_a_proj"), ("kv_a", "kv_a_proj_with_mqa"), ("o", "o_proj")):
                names[f"{p}.attn.{ours}.bias"] = f"{h}.self_attn.{theirs}.bias"
        for n in ("q_a_norm", "kv_a_norm"):
            names[f"{p}.attn.{n}.weight"] = f"{h}.self_attn.{n.replace('_norm', '_layernorm')}.weight"
        mlps = [(f"{p}.mlp", f"{h}.mlp")]
        if i >= cfg.dense_layers:
            names[f"{p}.mlp.router"] = f"{h}.mlp.gate.weight"
            names[f"{p}.mlp.router.balance_bias"] = f"{h}.mlp.gate.e_score_correction_bias"
            # transformers saves the experts one by one
            mlps = [(f"{p}.mlp.experts.{e}", f"{h}.mlp.experts.{e}") for e in range(cfg.experts)]
            mlps.append((f"{p}.mlp.shared", f"{h}.mlp.shared_experts"))
        for ours, theirs in mlps:
            for n in ("gate", "up", "down"):
                names[f"{ours}.{n}"] = f"{theirs}.{n}_proj.weight"
    return {ours: HFTensor(theirs) for ours, theirs in names.items()}


FAMILY = Family("deepseek_v3", ("deepseek_v3",), from_hf, to_hf, block, tensors, notes=notes)
