"""The model-family seam: what one family of Hugging Face models is to fourfold.

A family is data, not code paths: how its config.json reads into a `ModelConfig` (and back), the
block its layers are (`BlockConfig`: norm, activation, biases, RoPE), its extras (learned
positions), and where each of fourfold's serial tensors lives in its checkpoint. The runtime,
import, export, the rules and the planner read only this, so a new family is one module beside
llama.py and gpt2.py and one line in `fourfold.models.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from fourfold.models.config import ModelConfig
    from fourfold.spec.blockspec import BlockConfig


class HFTensor(NamedTuple):
    """Where a fourfold serial tensor lives in a Hugging Face checkpoint."""

    name: str  # the checkpoint's tensor
    offset: int = 0  # first row of ours within it (GPT-2's fused c_attn: q, k, v side by side)
    conv1d: bool = False  # stored transposed ([in, out], GPT-2's Conv1D)
    expert: int | None = None  # its index along the first dim of experts stacked in one tensor (GPT-OSS)
    stride: int = 1  # our rows are every stride-th of the tensor's from offset (GPT-OSS's interleaved gate, up)


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    hf_types: tuple[str, ...]  # config.json model_type values read as this family
    from_hf: Callable[[dict], "ModelConfig"]  # every field honoured or refused, by name
    to_hf: Callable[["ModelConfig"], dict]  # config.json fields transformers reads back as the same model
    block: Callable[["ModelConfig"], "BlockConfig"]
    tensors: Callable[["ModelConfig"], dict[str, HFTensor]]  # fourfold serial name -> its checkpoint tensor
    learned_positions: bool = False  # a [max_positions, hidden] table added to the embeddings (GPT-2)
    bos_is_eos: bool = False  # its tokenizers' convention when none names a beginning token (GPT-2)
    scaled_embedding: bool = False  # the embeddings multiplied by sqrt(hidden), in the model's dtype (Gemma)
    # transformers builds its embedding as nn.Embedding(..., padding_idx=config.pad_token_id): that row
    # starts at zero and gets no gradient from the lookup (every family but GPT-2)
    padding_idx: bool = True
    default_pad: int | None = None  # its config class's pad_token_id, when config.json names none
    # what a run of a config.json should be told once, in the training header (config.json fields -> lines)
    notes: Callable[[dict], list[str]] = lambda d: []
