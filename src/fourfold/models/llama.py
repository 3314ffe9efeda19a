"""The Llama family (RoPE, grouped-query attention, SwiGLU, RMSNorm), and the config.json types read
as it: Mistral (a sliding window) and Qwen2 (q/k/v biases, sliding-window layers from
max_window_layers on when use_sliding_window)."""

from __future__ import annotations

import math

from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import ROPE_SCALINGS, BlockConfig, RopeScaling

HF_TYPES = ("llama", "mistral", "qwen2")
# Their config classes' max_position_embeddings, for a config.json without it
MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}
FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "attention_bias",
          "mlp_bias", "hidden_act", "attention_dropout", "pretraining_tp", "sliding_window",
          "use_sliding_window", "max_window_layers", "layer_types"}
_CLASS_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def from_hf(d: dict) -> ModelConfig:
    kind = d["model_type"]
    refuse_unknown(d, FIELDS, kind)
    require(d, kind, hidden_act=("silu",), attention_dropout=(0, 0.0), pretraining_tp=(1,))
    if kind != "llama":  # transformers fixes these families' biases whatever the flags say
        require(d, kind, attention_bias=(False,), mlp_bias=(False,))
    heads = d["num_attention_heads"]
    kinds, window = qwen_sliding_layers(d) if kind == "qwen2" else ((), 0)
    if kind == "mistral":
        window = d.get("sliding_window", 4096) or 0  # MistralConfig's default
    bias = bool(d.get("attention_bias", False))
    positions = d.get("max_position_embeddings", MAX_POSITIONS[kind])
    return ModelConfig("llama", d["hidden_size"], d["num_hidden_layers"], heads, d.get("num_key_value_heads") or heads,
                       d["intermediate_size"], d["vocab_size"], positions, d.get("tie_word_embeddings", False),
                       d.get("rms_norm_eps", 1e-6), _rope_theta(d), _rope_scaling(d, positions),
                       head_dim=d.get("head_dim") or 0, qkv_bias=bias or kind == "qwen2", out_bias=bias,
                       mlp_bias=bool(d.get("mlp_bias", False)), sliding_window=window, layer_types=kinds,
                       hf_type="" if kind == "llama" else kind)


def qwen_sliding_layers(d: dict) -> tuple[tuple[str, ...], int]:
    """(layer_types, window) of Qwen2's and Qwen3's sliding-window layers as their config classes resolve
    them: none unless use_sliding_window (a null sliding_window: none either); then layer_types as
    given, or every layer from max_window_layers on (the config classes' default: 28)."""
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window") else None
    if window is None:
        return (), 0
    first = d.get("max_window_layers", 28)
    kinds = tuple(d.get("layer_types") or ("sliding_attention" if i >= first else "full_attention"
                                           for i in range(d["num_hidden_layers"])))
    return (kinds, window) if "sliding_attention" in kinds else ((), 0)


def qwen_sliding_to_hf(cfg: ModelConfig) -> dict:
    """config.json's fields for `qwen_sliding_layers`."""
    if not cfg.layer_types:
        return {"use_sliding_window": False}
    return {"use_sliding_window": True, "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types)}


def to_hf(cfg: ModelConfig) -> dict:
    kind = cfg.hf_type or "llama"
    out = {"model_type": kind, "architectures": [f"{_CLASS_NAMES[kind]}ForCausalLM"],
           "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
           "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.ffn, "vocab_size": cfg.vocab,
           "max_position_embeddings": cfg.max_positions, "tie_word_embeddings": cfg.tied,
           "rms_norm_eps": cfg.eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu"}
    if cfg.head_dim:
        out["head_dim"] = cfg.head_dim
    if kind == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = _rope_scaling_to_hf(cfg.rope_scaling)
    if kind == "mistral":  # a missing key is 4096 to transformers: none is written as null
        out["sliding_window"] = cfg.sliding_window or None
    if kind == "qwen2":
        out.update(qwen_sliding_to_hf(cfg))
    return out


def block(cfg: ModelConfig) -> BlockConfig:
    return BlockConfig(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn, norm="rms", activation="swiglu",
                       qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias, mlp_bias=cfg.mlp_bias,
                       rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, head_size=cfg.head_dim, eps=cfg.eps,
                       window=0 if cfg.layer_types else cfg.sliding_window)  # (layers of two kinds: `layer_block`)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    names = {"embed": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tied:
        names["lm_head"] = "lm_head.weight"
    b = cfg.block
    for i in range(cfg.layers):
        p, h = f"layers.{i}", f"model.layers.{i}"
        for n in "qkvo":
            names[f"{p}.attn.{n}"] = f"{h}.self_attn.{n}_proj.weight"
            if b.out_bias if n == "o" else b.qkv_bias:
                names[f"{p}.attn.{n}.bias"] = f"{h}.self_attn.{n}_proj.bias"
        for n in ("gate", "up", "down"):
            names[f"{p}.mlp.{n}"] = f"{h}.mlp.{n}_proj.weight"
            if b.mlp_bias:
                names[f"{p}.mlp.{n}.bias"] = f"{h}.mlp.{n}_proj.bias"
        names[f"{p}.attn_norm.weight"] = f"{h}.input_layernorm.weight"
        names[f"{p}.mlp_norm.weight"] = f"{h}.post_attention_layernorm.weight"
    return {ours: HFTensor(theirs) for ours, theirs in names.items()}


FAMILY = Family("llama", HF_TYPES, from_hf, to_hf, block, tensors)


def _rope_scaling_to_hf(r: RopeScaling) -> dict:
    """The keys transformers reads for the scaling's kind (dynamic's context is max_position_embeddings)."""
    out = {"rope_type": r.kind, "factor": r.factor}
    if r.kind in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = r.original_max_positions
    if r.kind == "llama3":
        out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.kind == "yarn":
        out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate,
                   attention_factor=r.attention_factor)
    return out


def _rope_parameters(d: dict) -> dict:
    # transformers 5 keeps them under rope_parameters; older config.json files use rope_scaling
    # (and rope_theta at the top level).
    return dict(d.get("rope_scaling") or {}, **(d.get("rope_parameters") or {}))


def _rope_theta(d: dict) -> float:
    return float(_rope_parameters(d).get("rope_theta", d.get("rope_theta", 10000.0)))


def _rope_scaling(d: dict, max_positions: int) -> RopeScaling | None:
    p = _rope_parameters(d)
    kind = p.get("rope_type", p.get("type", "default"))
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json's partial_rotary_factor is not 1; fourfold rotates whole heads")
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"config.json's rope scaling {kind!r} is not implemented (fourfold computes "
                         f"{', '.join(ROPE_SCALINGS)} and the default); use a model without it")
    if "factor" not in p or p["factor"] is None and kind != "yarn":  # (a null yarn factor is the contexts' ratio)
        raise ValueError(f"config.json's rope scaling {kind!r} has no factor; give rope_scaling's factor")
    # transformers' defaults, resolved here so that the model and to_hf see the values it uses
    original = int(p.get("original_max_position_embeddings", max_positions))
    if kind == "dynamic":  # scales beyond max_position_embeddings, whatever the rope parameters say
        return RopeScaling(kind, float(p["factor"]), original_max_positions=max_positions)
    if kind == "yarn":
        factor = float(p["factor"] if p["factor"] is not None else max_positions / original)
        return RopeScaling(kind, factor, original_max_positions=original, beta_fast=float(p.get("beta_fast") or 32),
                           beta_slow=float(p.get("beta_slow") or 1), truncate=bool(p.get("truncate", True)),
                           attention_factor=_yarn_attention_factor(p, factor))
    return RopeScaling(kind, float(p["factor"]), float(p.get("low_freq_factor", 1.0)),
                       float(p.get("high_freq_factor", 4.0)), original)


def _yarn_attention_factor(p: dict, factor: float) -> float:
    """transformers' _compute_yarn_parameters: given, or 0.1 ln(factor) + 1 (its mscale ratio
    when both mscale and mscale_all_dim are set)."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
    return mscale(factor)
