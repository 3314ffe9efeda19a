"""Every model family fourfold implements: adding one is its module and a line here."""

from __future__ import annotations

from fourfold.models import deepseek_v3, gemma3, gpt2, gpt_oss, llama, mixtral, olmoe, qwen2_moe, qwen3, qwen3_moe
from fourfold.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, gpt2.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY,
                                                   qwen3.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY,
                                                   gemma3.FAMILY, gpt_oss.FAMILY,
                                                   deepseek_v3.FAMILY)}
HF_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_types}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not supported; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_hf(d: dict) -> Family:
    kind = d.get("model_type")
    if kind not in HF_TYPES:
        raise ValueError(f"config.json has model_type {kind!r}; fourfold reads {', '.join(map(repr, HF_TYPES))}")
    return HF_TYPES[kind]
