"""The GPT-OSS family (GptOssForCausalLM): grouped-query attention with q, k, v and o biases and a
learned sink logit per head (`BlockConfig.sinks`), sliding-window and full layers alternating
(`layer_types`, one RoPE for both: YaRN in the published models), and a mixture of experts with a
biased router (top-k of the logits, softmax over them: the renormalised softmax of Mixtral) and
biased experts whose SwiGLU is clamped (`swiglu_clamped`). transformers keeps the experts stacked in
one tensor per layer, gate and up interleaved column by column (`HFTensor.expert`, `stride`). The
published checkpoints store the experts in MXFP4: load them into transformers dequantised and save
them (bf16) for fourfold, which reads and writes the stacked bf16 layout only."""

from __future__ import annotations

import dataclasses

from fourfold.models import llama
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
          "attention_dropout", "attention_bias", "sliding_window", "layer_types", "num_local_experts", "num_experts",
          "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "router_aux_loss_coef", "output_router_logits",
          "quantization_config"}
# GptOssConfig's defaults
DEFAULTS = dict(max_position_embeddings=131072, sliding_window=128, rope_theta=150000.0, rms_norm_eps=1e-5,
                num_local_experts=128, num_experts_per_tok=4, router_aux_loss_coef=0.001, attention_bias=True,
                rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                     original_max_position_embeddings=4096))


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "gpt_oss")
    require(d, "gpt_oss", hidden_act=("silu",), attention_dropout=(0, 0.0), swiglu_alpha=(1.702,),
            swiglu_limit=(7.0,))
    if d.get("quantization_config"):
        raise ValueError("config.json (gpt_oss) has a quantization_config (the published MXFP4 experts); load the "
                         "model in transformers with Mxfp4Config(dequantize=True), save_pretrained it, and give that")
    get = {**DEFAULTS, **d}.get
    heads = d["num_attention_heads"]
    positions = get("max_position_embeddings")
    rope = {"rope_parameters": get("rope_parameters"), "rope_scaling": d.get("rope_scaling")}
    bias = bool(get("attention_bias"))
    kinds = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                     for i in range(d["num_hidden_layers"])]
    return ModelConfig("gpt_oss", d["hidden_size"], d["num_hidden_layers"], heads,
                       d.get("num_key_value_heads") or heads, d["intermediate_size"], d["vocab_size"], positions,
                       d.get("tie_word_embeddings", False), get("rms_norm_eps"),
                       float(llama._rope_parameters(rope).get("rope_theta", get("rope_theta"))),
                       llama._rope_scaling(rope, positions), head_dim=d.get("head_dim") or 0, qkv_bias=bias,
                       out_bias=bias, mlp_bias=True, sliding_window=get("sliding_window") or 0,
                       experts=d.get("num_local_experts", d.get("num_experts", DEFAULTS["num_local_experts"])),
                       top_k=get("num_experts_per_tok"), norm_topk=True,
                       aux_loss=bool(d.get("output_router_logits", False)),
                       aux_loss_coef=float(get("router_aux_loss_coef")), layer_types=tuple(kinds))


def to_hf(cfg: ModelConfig) -> dict:
    out = llama.to_hf(dataclasses.replace(cfg, family="llama", hf_type="", layer_types=()))
    del out["mlp_bias"]
    rope = out.pop("rope_scaling", {"rope_type": "default"})
    out.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"], head_dim=cfg.block.head_dim,
               rope_parameters=dict(rope, rope_theta=out.pop("rope_theta")), sliding_window=cfg.sliding_window,
               layer_types=list(cfg.layer_types), num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
               output_router_logits=cfg.aux_loss, router_aux_loss_coef=cfg.aux_loss_coef)
    return out


def block(cfg: ModelConfig) -> BlockConfig:
    """The full layers' block (`ModelConfig.layer_block` gives the sliding ones their window)."""
    return dataclasses.replace(llama.block(cfg), window=0, activation="swiglu_clamped", experts=cfg.experts,
                               top_k=cfg.top_k, norm_topk=True, sinks=True, router_bias=True)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    out = {ours: t for ours, t in llama.tensors(cfg).items() if ".mlp." not in ours}
    for i in range(cfg.layers):
        p, h = f"layers.{i}", f"model.layers.{i}"
        out[f"{p}.attn.sinks"] = HFTensor(f"{h}.self_attn.sinks")
        out[f"{p}.mlp.router"] = HFTensor(f"{h}.mlp.router.weight")
        out[f"{p}.mlp.router.bias"] = HFTensor(f"{h}.mlp.router.bias")
        stacked = f"{h}.mlp.experts"
        # gate_up_proj [E, hidden, 2 ffn], gate and up interleaved; down_proj [E, ffn, hidden]
        for e in range(cfg.experts):
            for n, offset in (("gate", 0), ("up", 1)):
                out[f"{p}.mlp.experts.{e}.{n}"] = HFTensor(f"{stacked}.gate_up_proj", offset, True, e, 2)
                out[f"{p}.mlp.experts.{e}.{n}.bias"] = HFTensor(f"{stacked}.gate_up_proj_bias", offset, False, e, 2)
            out[f"{p}.mlp.experts.{e}.down"] = HFTensor(f"{stacked}.down_proj", 0, True, e)
            out[f"{p}.mlp.experts.{e}.down.bias"] = HFTensor(f"{stacked}.down_proj_bias", 0, False, e)
    return out


FAMILY = Family("gpt_oss", ("gpt_oss",), from_hf, to_hf, block, tensors)
