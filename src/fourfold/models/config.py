"""Model configuration from Hugging Face config.json fields: pure data, shared with the planner."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fourfold.blockspec import BlockConfig

FAMILIES = ("llama", "gpt2")


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

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported; use one of {', '.join(FAMILIES)}")

    @functools.cached_property  # the planner asks for it hundreds of thousands of times
    def block(self) -> BlockConfig:
        if self.family == "llama":
            return BlockConfig(self.hidden, self.heads, self.kv_heads, self.ffn, norm="rms", activation="swiglu",
                               rope_theta=self.rope_theta, eps=self.eps)
        return BlockConfig(self.hidden, self.heads, self.heads, self.ffn, norm="layer", activation="gelu_tanh",
                           bias=True, rope=False, eps=self.eps)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """From the fields of a Hugging Face config.json (LlamaConfig or GPT2Config)."""
        kind = d.get("model_type")
        if kind == "llama":
            heads = d["num_attention_heads"]
            return cls("llama", d["hidden_size"], d["num_hidden_layers"], heads, d.get("num_key_value_heads") or heads,
                       d["intermediate_size"], d["vocab_size"], d.get("max_position_embeddings", 4096),
                       d.get("tie_word_embeddings", False), d.get("rms_norm_eps", 1e-6), _rope_theta(d))
        if kind == "gpt2":
            hidden = d["n_embd"]
            return cls("gpt2", hidden, d["n_layer"], d["n_head"], d["n_head"], d.get("n_inner") or 4 * hidden,
                       d["vocab_size"], d["n_positions"], d.get("tie_word_embeddings", True), d.get("layer_norm_epsilon", 1e-5))
        raise ValueError(f"config.json has model_type {kind!r}; fourfold reads 'llama' and 'gpt2'")

    def to_hf(self) -> dict:
        if self.family == "llama":
            return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": self.hidden,
                    "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                    "num_key_value_heads": self.kv_heads, "intermediate_size": self.ffn, "vocab_size": self.vocab,
                    "max_position_embeddings": self.max_positions, "tie_word_embeddings": self.tied,
                    "rms_norm_eps": self.eps, "rope_theta": self.rope_theta, "hidden_act": "silu"}
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": self.hidden, "n_layer": self.layers,
                "n_head": self.heads, "n_inner": self.ffn, "vocab_size": self.vocab, "n_positions": self.max_positions,
                "tie_word_embeddings": self.tied, "layer_norm_epsilon": self.eps, "activation_function": "gelu_new"}

    def parameter_count(self) -> int:
        b = self.block
        d = b.head_dim
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * d + self.hidden * self.hidden
        mlp = (3 if b.gated else 2) * self.hidden * self.ffn
        norms = (2 if b.norm == "rms" else 4) * self.hidden
        biases = ((self.heads + 2 * self.kv_heads) * d + 2 * self.hidden + self.ffn) if b.bias else 0
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        positions = self.max_positions * self.hidden if self.family == "gpt2" else 0
        final_norm = self.hidden * (1 if b.norm == "rms" else 2)
        return self.layers * (attn + mlp + norms + biases) + embed + positions + final_norm


def _rope_theta(d: dict) -> float:
    # transformers 5 keeps it under rope_parameters; older config.json files at the top level.
    params = d.get("rope_parameters") or {}
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


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
