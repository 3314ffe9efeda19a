"""The GPT-2 family: learned positions, LayerNorm, GeLU (tanh), biases everywhere, Conv1D weights
([in, out]) and one fused c_attn in its checkpoints."""

from __future__ import annotations

from fourfold.models.config import ModelConfig, refuse_unknown, require
from fourfold.models.family import Family, HFTensor
from fourfold.spec.blockspec import BlockConfig

FIELDS = {"n_embd", "n_layer", "n_head", "n_inner", "n_positions", "layer_norm_epsilon", "activation_function",
          "attn_pdrop", "embd_pdrop", "resid_pdrop", "add_cross_attention", "reorder_and_upcast_attn",
          "scale_attn_by_inverse_layer_idx", "scale_attn_weights", "summary_activation",
          "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj", "n_ctx"}


def from_hf(d: dict) -> ModelConfig:
    refuse_unknown(d, FIELDS, "gpt2")
    require(d, "gpt2", activation_function=("gelu_new", "gelu_pytorch_tanh"), add_cross_attention=(False,),
            reorder_and_upcast_attn=(False,), scale_attn_by_inverse_layer_idx=(False,), scale_attn_weights=(True,))
    # GPT-2's dropout (attn_pdrop, embd_pdrop, resid_pdrop) is read and not applied: fourfold has no
    # dropout (evaluation, generation and export are unaffected; training runs without).
    hidden = d["n_embd"]
    return ModelConfig("gpt2", hidden, d["n_layer"], d["n_head"], d["n_head"], d.get("n_inner") or 4 * hidden,
                       d["vocab_size"], d["n_positions"], d.get("tie_word_embeddings", True),
                       d.get("layer_norm_epsilon", 1e-5))


def to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": cfg.hidden, "n_layer": cfg.layers,
            "n_head": cfg.heads, "n_inner": cfg.ffn, "vocab_size": cfg.vocab, "n_positions": cfg.max_positions,
            "tie_word_embeddings": cfg.tied, "layer_norm_epsilon": cfg.eps, "activation_function": "gelu_new"}


def block(cfg: ModelConfig) -> BlockConfig:
    return BlockConfig(cfg.hidden, cfg.heads, cfg.heads, cfg.ffn, norm="layer", activation="gelu_tanh",
                       qkv_bias=True, out_bias=True, mlp_bias=True, rope=False, eps=cfg.eps)


def tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    out = {"embed": HFTensor("transformer.wte.weight"), "positions": HFTensor("transformer.wpe.weight")}
    if not cfg.tied:
        out["lm_head"] = HFTensor("lm_head.weight")
    for suffix in ("weight", "bias"):
        out[f"norm.{suffix}"] = HFTensor(f"transformer.ln_f.{suffix}")
    for i in range(cfg.layers):
        p, h = f"layers.{i}", f"transformer.h.{i}"
        for j, n in enumerate("qkv"):
            out[f"{p}.attn.{n}"] = HFTensor(f"{h}.attn.c_attn.weight", j * cfg.hidden, True)
            out[f"{p}.attn.{n}.bias"] = HFTensor(f"{h}.attn.c_attn.bias", j * cfg.hidden, True)
        for ours, theirs in (("attn.o", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
            out[f"{p}.{ours}"] = HFTensor(f"{h}.{theirs}.weight", 0, True)
            out[f"{p}.{ours}.bias"] = HFTensor(f"{h}.{theirs}.bias", 0, True)
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for suffix in ("weight", "bias"):
                out[f"{p}.{ours}.{suffix}"] = HFTensor(f"{h}.{theirs}.{suffix}")
    return out


FAMILY = Family("gpt2", ("gpt2",), from_hf, to_hf, block, tensors, learned_positions=True, bos_is_eos=True,
                padding_idx=False)
