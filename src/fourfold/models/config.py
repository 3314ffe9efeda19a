"""Model configuration from Hugging Face config.json fields: pure data, shared with the planner."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fourfold.spec.blockspec import ROPE_SCALINGS, BlockConfig, RopeScaling

FAMILIES = ("llama", "gpt2")
# config.json model types read as the llama family (RoPE, GQA, SwiGLU, RMSNorm), with their flags.
LLAMA_TYPES = ("llama", "mistral", "qwen2")
# Their config classes' max_position_embeddings, for a config.json without it
MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}

# Fields of config.json that do not change the model's arithmetic (ids, bookkeeping, output
# options, initialisation, the transformers version); every other field is read or refused.
METADATA = {"_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
            "transformers_version", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
            "id2label", "label2id", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward",
            "initializer_range", "model_type", "tie_word_embeddings", "max_position_embeddings", "vocab_size",
            "task_specific_params", "finetuning_task", "_num_labels", "tokenizer_class", "prefix", "torchscript"}
LLAMA_FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "attention_bias",
                "mlp_bias", "hidden_act", "attention_dropout", "pretraining_tp", "sliding_window",
                "use_sliding_window", "max_window_layers", "layer_types"}
GPT2_FIELDS = {"n_embd", "n_layer", "n_head", "n_inner", "n_positions", "layer_norm_epsilon", "activation_function",
               "attn_pdrop", "embd_pdrop", "resid_pdrop", "add_cross_attention", "reorder_and_upcast_attn",
               "scale_attn_by_inverse_layer_idx", "scale_attn_weights", "summary_activation",
               "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj", "n_ctx"}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" (RoPE, GQA, SwiGLU, RMSNorm) or "gpt2" (learned positions, LayerNorm, GeLU, biases)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_positions: int
    tied: bool
    eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    head_dim: int = 0  # explicit (config.json's head_dim); 0: hidden / heads
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets it and out_bias
    out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int = 0  # Mistral's: attention within the last W tokens (0: none)
    hf_type: str = ""  # config.json's model_type when it is not the family's name (mistral, qwen2)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported; use one of {', '.join(FAMILIES)}")

    @functools.cached_property  # the planner asks for it hundreds of thousands of times
    def block(self) -> BlockConfig:
        if self.family == "llama":
            return BlockConfig(self.hidden, self.heads, self.kv_heads, self.ffn, norm="rms", activation="swiglu",
                               qkv_bias=self.qkv_bias, out_bias=self.out_bias, mlp_bias=self.mlp_bias,
                               rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, head_size=self.head_dim,
                               eps=self.eps)
        return BlockConfig(self.hidden, self.heads, self.heads, self.ffn, norm="layer", activation="gelu_tanh",
                           qkv_bias=True, out_bias=True, mlp_bias=True, rope=False, eps=self.eps)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """From the fields of a Hugging Face config.json (Llama, Mistral, Qwen2 or GPT-2): every
        field is either honoured or refused here, by name, with the reason."""
        kind = d.get("model_type")
        if kind in LLAMA_TYPES:
            _refuse_unknown(d, LLAMA_FIELDS, kind)
            return _llama_from_hf(cls, d, kind)
        if kind == "gpt2":
            _refuse_unknown(d, GPT2_FIELDS, kind)
            _require(d, kind, activation_function=("gelu_new", "gelu_pytorch_tanh"), add_cross_attention=(False,),
                     reorder_and_upcast_attn=(False,), scale_attn_by_inverse_layer_idx=(False,),
                     scale_attn_weights=(True,))
            # GPT-2's dropout (attn_pdrop, embd_pdrop, resid_pdrop) is read and not applied: fourfold
            # has no dropout (evaluation, generation and export are unaffected; training runs without).
            hidden = d["n_embd"]
            return cls("gpt2", hidden, d["n_layer"], d["n_head"], d["n_head"], d.get("n_inner") or 4 * hidden,
                       d["vocab_size"], d["n_positions"], d.get("tie_word_embeddings", True), d.get("layer_norm_epsilon", 1e-5))
        raise ValueError(f"config.json has model_type {kind!r}; fourfold reads {', '.join(LLAMA_TYPES)} and 'gpt2'")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From the form a checkpoint's meta.json keeps (`dataclasses.asdict`)."""
        scaling = d.get("rope_scaling")
        return cls(**{**d, "rope_scaling": RopeScaling(**scaling) if scaling else None})

    def to_hf(self) -> dict:
        if self.family == "llama":
            kind = self.hf_type or "llama"
            out = {"model_type": kind, "architectures": [f"{_CLASS_NAMES[kind]}ForCausalLM"],
                   "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                   "num_key_value_heads": self.kv_heads, "intermediate_size": self.ffn, "vocab_size": self.vocab,
                   "max_position_embeddings": self.max_positions, "tie_word_embeddings": self.tied,
                   "rms_norm_eps": self.eps, "rope_theta": self.rope_theta, "hidden_act": "silu"}
            if self.head_dim:
                out["head_dim"] = self.head_dim
            if kind == "llama":
                out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
            if self.rope_scaling is not None:
                out["rope_scaling"] = _rope_scaling_to_hf(self.rope_scaling)
            if kind == "mistral":  # a missing key is 4096 to transformers: none is written as null
                out["sliding_window"] = self.sliding_window or None
            return out
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": self.hidden, "n_layer": self.layers,
                "n_head": self.heads, "n_inner": self.ffn, "vocab_size": self.vocab, "n_positions": self.max_positions,
                "tie_word_embeddings": self.tied, "layer_norm_epsilon": self.eps, "activation_function": "gelu_new"}

    def parameter_count(self) -> int:
        b = self.block
        d = b.head_dim
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden
        mlp = (3 if b.gated else 2) * self.hidden * self.ffn
        norms = (2 if b.norm == "rms" else 4) * self.hidden
        biases = (((self.heads + 2 * self.kv_heads) * d if b.qkv_bias else 0) + (self.hidden if b.out_bias else 0)
                  + (((2 if b.gated else 1) * self.ffn + self.hidden) if b.mlp_bias else 0))
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        positions = self.max_positions * self.hidden if self.family == "gpt2" else 0
        final_norm = self.hidden * (1 if b.norm == "rms" else 2)
        return self.layers * (attn + mlp + norms + biases) + embed + positions + final_norm


_CLASS_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


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


def _refuse_unknown(d: dict, fields: set[str], kind: str) -> None:
    unknown = sorted(set(d) - fields - METADATA)
    if unknown:
        raise ValueError(f"config.json ({kind}) has fields fourfold does not implement: {', '.join(unknown)}; "
                         f"remove them if they are at their neutral value, or use a supported model")


def _require(d: dict, kind: str, **allowed) -> None:
    """Refuse a field whose value changes the arithmetic in a way fourfold does not implement."""
    for name, values in allowed.items():
        if name in d and d[name] not in values:
            raise ValueError(f"config.json ({kind}) has {name}={d[name]!r}; fourfold implements "
                             f"{' or '.join(repr(v) for v in values)} only")


def _llama_from_hf(cls, d: dict, kind: str) -> "ModelConfig":
    _require(d, kind, hidden_act=("silu",), attention_dropout=(0, 0.0), pretraining_tp=(1,))
    if kind != "llama":  # transformers fixes these families' biases whatever the flags say
        _require(d, kind, attention_bias=(False,), mlp_bias=(False,))
    if kind == "qwen2" and (d.get("use_sliding_window") or any(t != "full_attention" for t in d.get("layer_types") or [])):
        raise ValueError("config.json (qwen2) uses sliding-window layers (use_sliding_window / layer_types); fourfold's "
                         "attention is full causal: use a config with use_sliding_window false")
    heads = d["num_attention_heads"]
    window = 0 if kind != "mistral" else (d.get("sliding_window", 4096) or 0)  # MistralConfig's default
    bias = bool(d.get("attention_bias", False))
    positions = d.get("max_position_embeddings", MAX_POSITIONS[kind])
    return cls("llama", d["hidden_size"], d["num_hidden_layers"], heads, d.get("num_key_value_heads") or heads,
               d["intermediate_size"], d["vocab_size"], positions, d.get("tie_word_embeddings", False),
               d.get("rms_norm_eps", 1e-6), _rope_theta(d), _rope_scaling(d, positions),
               head_dim=d.get("head_dim") or 0, qkv_bias=bias or kind == "qwen2", out_bias=bias,
               mlp_bias=bool(d.get("mlp_bias", False)), sliding_window=window, hf_type="" if kind == "llama" else kind)


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


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in resources.files("fourfold.models.presets").iterdir() if p.name.endswith(".json"))


def load_config(name_or_path: str) -> ModelConfig:
    """A preset name (see `preset_names()`), a config.json, or a directory holding one."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    preset = resources.files("fourfold.models.presets") / f"{name_or_path}.json"
    if not preset.is_file():
        if "/" in name_or_path or path.parent.is_dir() and path.suffix == ".json":
            where = "does not exist" if not path.exists() else "has no config.json"
            raise ValueError(f"{name_or_path} {where}; give a Hugging Face model directory (with config.json), "
                             f"a config.json, or a preset: {', '.join(preset_names())}")
        raise ValueError(f"{name_or_path!r} is neither a config.json nor a preset; presets: {', '.join(preset_names())}")
    return ModelConfig.from_hf(json.loads(preset.read_text()))
