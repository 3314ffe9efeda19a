"""The Gemma 3 family, text model (Gemma3ForCausalLM, model_type gemma3_text): grouped-query attention
with an RMSNorm over each head's queries and keys, local sliding-window layers and global ones in
`layer_types` (five local to one global in the published models), each kind with its own RoPE (local:
base 10,000 unscaled; global: base 1,000,000, linearly scaled by 8 from 4B up), scores scaled by
query_pre_attn_scalar ** -0.5, four norms a block (before and after attention and the MLP), a GELU-
tanh gated MLP, embeddings multiplied by sqrt(hidden) and tied to the head. Gemma's RMSNorm scales
by 1 + weight (`rms_plus_one`). The multimodal Gemma3ForConditionalGeneration's config.json
(model_type gemma3) holds this under text_config: give that part."""

from __future__ import annotations

from fourfold.models import llama
from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "head_dim", "hidden_activation", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
          "rope_local_base_freq", "attention_bias", "attention_dropout", "query_pre_attn_scalar", "sliding_window",
          "sliding_window_pattern", "_sliding_window_pattern", "layer_types", "final_logit_softcapping",
          "attn_logit_softcapping", "use_bidirectional_attention", "cache_implementation"}
# Gemma3TextConfig's defaults
DEFAULTS = dict(max_position_embeddings=131072, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                tie_word_embeddings=True, rms_norm_eps=1e-6)


def _layer_types(d: dict) -> tuple[str, ...]:
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", DEFAULTS["sliding_window_pattern"]))
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(d["num_hidden_layers"]))


def _rope(d: dict) -> tuple[dict, dict]:
    """(the global layers' rope parameters, the local layers'), as Gemma3TextConfig resolves them from
    rope_parameters by layer kind, or from the older rope_theta, rope_local_base_freq and rope_scaling."""
    p = d.get("rope_parameters") or {}
    full = dict(p.get("full_attention") or {"rope_type": "default"})
    local = dict(p.get("sliding_attention") or {"rope_type": "default"})
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta", DEFAULTS["rope_theta"]))
    local.setdefault("rope_theta", d.get("rope_local_base_freq", DEFAULTS["rope_local_base_freq"]))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError("config.json (gemma3_text) scales the sliding-window layers' RoPE; fourfold runs them "
                         "with the default frequencies: use rope_type default for sliding_attention")
    return full, local


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "gemma3_text")
    require(d, "gemma3_text", hidden_activation=("gelu_pytorch_tanh",), attention_dropout=(0, 0.0),
            final_logit_softcapping=(None,), attn_logit_softcapping=(None,),
            use_bidirectional_attention=(False, None))
    get = {**DEFAULTS, **d}.get
    full, local = _rope(d)
    positions = get("max_position_embeddings")
    bias = bool(d.get("attention_bias", False))
    return ModelConfig("gemma3", d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"],
                       d.get("num_key_value_heads") or d["num_attention_heads"], d["intermediate_size"],
                       d["vocab_size"], positions, get("tie_word_embeddings"), get("rms_norm_eps"),
                       rope_theta=float(full["rope_theta"]),
                       rope_scaling=llama._rope_scaling({"rope_parameters": full}, positions),
                       head_dim=get("head_dim"), qkv_bias=bias, out_bias=bias, sliding_window=get("sliding_window"),
                       layer_types=_layer_types(d), local_rope_theta=float(local["rope_theta"]),
                       attention_scale=float(get("query_pre_attn_scalar")) ** -0.5)


def to_hf(cfg: ModelConfig) -> dict:
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        full.update(llama._rope_scaling_to_hf(cfg.rope_scaling))
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": cfg.hidden,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "intermediate_size": cfg.ffn, "vocab_size": cfg.vocab, "max_position_embeddings": cfg.max_positions,
            "tie_word_embeddings": cfg.tied, "rms_norm_eps": cfg.eps, "head_dim": cfg.block.head_dim,
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": cfg.qkv_bias,
            "query_pre_attn_scalar": round(cfg.attention_scale ** -2), "sliding_window": cfg.sliding_window,
            "layer_types": list(cfg.layer_types),
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}}}


def block(cfg: ModelConfig) -> BlockConfig:
    """The global layers' block (`ModelConfig.layer_block` gives the local ones theirs)."""
    return BlockConfig(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn, norm="rms_plus_one", activation="geglu_tanh",
                       qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias, rope_theta=cfg.rope_theta,
                       rope_scaling=cfg.rope_scaling, head_size=cfg.head_dim, eps=cfg.eps, qk_norm=True,
                       attention_scale=cfg.attention_scale, post_norms=True)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Llama's names (with the q and k norms), and the norms after attention and the MLP; Gemma's
    pre_feedforward_layernorm is Llama's post_attention_layernorm's place."""
    out = llama.tensors(cfg)
    for i in range(cfg.layers):
        p, h = f"layers.{i}", f"model.layers.{i}"
        for n in ("q_norm", "k_norm"):
            out[f"{p}.attn.{n}.weight"] = HFTensor(f"{h}.self_attn.{n}.weight")
        out[f"{p}.attn_post_norm.weight"] = HFTensor(f"{h}.post_attention_layernorm.weight")
        out[f"{p}.mlp_norm.weight"] = HFTensor(f"{h}.pre_feedforward_layernorm.weight")
        out[f"{p}.mlp_post_norm.weight"] = HFTensor(f"{h}.post_feedforward_layernorm.weight")
    return out


FAMILY = Family("gemma3", ("gemma3_text",), from_hf, to_hf, block, tensors, scaled_embedding=True,
                default_pad=0)
