"""Model configuration from Hugging Face config.json fields: pure data, shared with the planner."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from fourfold.spec.blockspec import BlockConfig, RopeScaling

if TYPE_CHECKING:
    from fourfold.models.family import Family

# Fields of config.json that do not change the model's arithmetic (ids, bookkeeping, output
# options, initialisation, the transformers version); every other field is read or refused.
METADATA = {"_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
            "transformers_version", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
            "id2label", "label2id", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward",
            "initializer_range", "model_type", "tie_word_embeddings", "max_position_embeddings", "vocab_size",
            "task_specific_params", "finetuning_task", "_num_labels", "tokenizer_class", "prefix", "torchscript"}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # a name of fourfold.models.registry.FAMILIES: "llama", "gpt2"
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
    # Mixture of experts (Mixtral, Qwen2-MoE): `ffn` is then each expert's FFN size
    experts: int = 0  # routed experts per layer (0: a dense MLP)
    top_k: int = 0  # experts per token
    norm_topk: bool = False  # the chosen experts' weights renormalised to sum to 1
    shared_ffn: int = 0  # a shared expert's FFN size, under a sigmoid gate (Qwen2-MoE); 0: none
    aux_loss: bool = False  # the load-balancing loss is added to the loss (config.json's output_router_logits)
    aux_loss_coef: float = 0.0  # its coefficient (router_aux_loss_coef)
    # Layers of two kinds (Gemma 3): "full_attention" ones are `block`; "sliding_attention" ones attend
    # within `sliding_window`, with RoPE's base `local_rope_theta` unscaled (0: the global layers' RoPE)
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float = 0.0
    attention_scale: float = 0.0  # the attention scores' scale (0: 1 / sqrt(head_dim))
    # Multi-head latent attention (DeepSeek-V3: `BlockConfig`'s fields of the same names; kv_lora 0: none)
    q_lora: int = 0
    kv_lora: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek-V3's mixture: the first `dense_layers` layers are dense MLPs of `dense_ffn`; routing within the
    # best `top_groups` of `groups` expert groups, the weights times `routed_scale`
    dense_layers: int = 0
    dense_ffn: int = 0
    groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0
    # The embedding row of config.json's pad_token_id where the family's transformers class passes it as
    # nn.Embedding's padding_idx: zero at initialisation, no gradient from the lookup (a tied head's
    # gradient still reaches it, as in transformers). None: every row is trained.
    pad_token: int | None = None

    def __post_init__(self) -> None:
        self.family_spec()  # an unknown family is refused here, by name
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # (a list from meta.json)
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown or self.layer_types and len(self.layer_types) != self.layers:
            raise ValueError(f"layer_types must name each of the {self.layers} layers as one of "
                             f"{', '.join(LAYER_TYPES)}; got {list(self.layer_types)}")

    def with_layers(self, n: int) -> "ModelConfig":
        """The same model with `n` layers (their kinds in the same pattern: the first n, repeated; a
        mixture's first dense layers among the first n)."""
        kinds = tuple(self.layer_types[i % len(self.layer_types)] for i in range(n)) if self.layer_types else ()
        return dataclasses.replace(self, layers=n, layer_types=kinds, dense_layers=min(self.dense_layers, n))

    def layer_block(self, i: int) -> BlockConfig:
        """Layer i's block: `block`, a sliding-window layer's (`layer_types`), or one of the first dense
        layers of a mixture (`dense_layers`)."""
        if i < self.dense_layers:
            return self._dense_block
        if not self.layer_types or self.layer_types[i] == "full_attention":
            return self.block
        return self._sliding_block

    @functools.cached_property
    def layer_kinds(self) -> tuple[tuple[BlockConfig, int], ...]:
        """Each kind of layer block and how many layers have it, the first layer's kind first (the
        planner asks for every candidate: hashing a block for each of 126 layers was half the 405B search)."""
        kinds: dict[BlockConfig, int] = {}
        for i in range(self.layers):
            kinds[self.layer_block(i)] = kinds.get(self.layer_block(i), 0) + 1
        return tuple(kinds.items())

    @functools.cached_property
    def _dense_block(self) -> BlockConfig:
        return dataclasses.replace(self.block, ffn=self.dense_ffn, experts=0, top_k=0, shared_ffn=0)

    @functools.cached_property
    def _sliding_block(self) -> BlockConfig:
        if not self.local_rope_theta:
            return dataclasses.replace(self.block, window=self.sliding_window)
        return dataclasses.replace(self.block, window=self.sliding_window, rope_theta=self.local_rope_theta,
                                   rope_scaling=None)

    def attention_share(self, seq: int) -> float:
        """The (query, key) pairs the layers attend over `seq` tokens, as a share of causal attention's
        in every layer (1 without sliding windows shorter than the sequence)."""
        from fourfold.spec.counts import attended_pairs

        window, local = self.block.window, self.layers  # (the planner asks for it on every evaluation)
        if self.layer_types:
            window, local = self.sliding_window, self.layer_types.count("sliding_attention")
        if not window or window >= seq:
            return 1.0
        return (self.layers - local + local * attended_pairs(seq, window) / attended_pairs(seq, 0)) / self.layers

    def family_spec(self) -> "Family":
        from fourfold.models.registry import family  # the families import this module

        return family(self.family)

    @functools.cached_property  # the planner asks for it hundreds of thousands of times
    def block(self) -> BlockConfig:
        return self.family_spec().block(self)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """From the fields of a Hugging Face config.json, by its model_type's family: every field is
        either honoured or refused, by name, with the reason."""
        from fourfold.models.registry import family_of_hf

        family = family_of_hf(d)
        cfg = family.from_hf(d)
        pad = d.get("pad_token_id", family.default_pad)  # (transformers' class default when it names none)
        if family.padding_idx and isinstance(pad, int) and not isinstance(pad, bool) and -cfg.vocab <= pad < cfg.vocab:
            cfg = dataclasses.replace(cfg, pad_token=pad % cfg.vocab)  # (nn.Embedding reads a negative one so)
        return cfg

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From the form a checkpoint's meta.json keeps (`dataclasses.asdict`)."""
        scaling = d.get("rope_scaling")
        return cls(**{**d, "rope_scaling": RopeScaling(**scaling) if scaling else None})

    def to_hf(self) -> dict:
        family = self.family_spec()
        out = family.to_hf(self)  # (a null pad id written too: left out, the class default would be read back)
        return {**out, "pad_token_id": self.pad_token} if family.padding_idx else out

    def parameter_count(self) -> int:
        from fourfold.spec.counts import parameter_count

        return parameter_count(self)


def refuse_unknown(d: dict, fields: set[str], kind: str) -> None:
    unknown = sorted(set(d) - fields - METADATA)
    if unknown:
        raise ValueError(f"config.json ({kind}) has fields fourfold does not implement: {', '.join(unknown)}; "
                         f"remove them if they are at their neutral value, or use a supported model")


def require(d: dict, kind: str, **allowed) -> None:
    """Refuse a field whose value changes the arithmetic in a way fourfold does not implement."""
    for name, values in allowed.items():
        if name in d and d[name] not in values:
            raise ValueError(f"config.json ({kind}) has {name}={d[name]!r}; fourfold implements "
                             f"{' or '.join(repr(v) for v in values)} only")


def preset_names() -> list[str]:
    presets = resources.files("fourfold.models.presets").iterdir()
    return sorted(p.name[: -len(".json")] for p in presets if p.name.endswith(".json"))


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
        close = [n for n in preset_names() if n.lower() == name_or_path.lower()]
        close = close or difflib.get_close_matches(name_or_path, preset_names(), n=1, cutoff=0.8)
        if close:  # (preset names are lower case: llama-3.1-8B is llama-3.1-8b)
            raise ValueError(f"{name_or_path!r} is not a preset: did you mean {close[0]}?")
        raise ValueError(f"{name_or_path!r} is neither a config.json nor a preset; "
                         f"presets: {', '.join(preset_names())}")
    return ModelConfig.from_hf(json.loads(preset.read_text()))
