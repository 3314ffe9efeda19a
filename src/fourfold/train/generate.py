"""`fourfold generate`: sample text on one process from a training checkpoint (written on any grid) or a
Hugging Face directory, with the tokenizer.json beside it."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold import checkpoint
from fourfold.checkpoint.hf import load_hf, model_directory
from fourfold.data import chat, corpus
from fourfold.models.config import ModelConfig, load_config
from fourfold.parallel.grid import Grid
from fourfold.parallel.transformer import Transformer
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import check


def _single_process_group() -> None:
    """A world of one gloo rank, so the parallel layers and DCP run in this process."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


@dataclass
class Opened:
    """A model opened for sampling on one process (`open_model`)."""

    model: Transformer
    tokenizer: object
    window: int  # the most tokens one forward may attend to
    stop_ids: frozenset[int]  # a sample ends with any of them (`stop_ids`)
    folder: Path  # its directory: the tokenizer's files, the chat template


def stop_ids(folder: Path, tokenizer_eos: int | None) -> frozenset[int]:
    """The ids a sample ends with, as transformers' generate ends it: generation_config.json's
    eos_token_id (an instruct model's end-of-turn ids among them), else config.json's, and the
    tokenizer's end-of-document token."""
    ids = set() if tokenizer_eos is None else {tokenizer_eos}
    for source in ("generation_config.json", "config.json"):
        path = folder / source
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.is_file() else None
        if eos is not None:
            ids |= set(eos) if isinstance(eos, list) else {eos}
            break
    return frozenset(i for i in ids if isinstance(i, int))


def open_model(path: str | Path) -> Opened:
    """The model on one process from `path`: a fourfold training checkpoint (a step-N directory, or
    a run's checkpoint directory: its latest) or a Hugging Face directory (config.json,
    safetensors, tokenizer.json, as save_pretrained writes)."""
    path, hf = model_directory(path)
    if hf:
        try:
            cfg = load_config(str(path))
        except ValueError as e:  # a model fourfold does not implement: the reason names it
            raise checkpoint.CheckpointError(f"{path}: {e}") from None
    else:
        cfg = ModelConfig.from_dict(checkpoint.read_meta(path)["model"])
        what = checkpoint.damage(path)
        if what:
            raise checkpoint.CheckpointError(f"the checkpoint {path} is damaged ({what}); give an intact one")
    window = cfg.max_positions  # (a sliding window is the attention's own: the context may be longer)
    check(cfg, Job(micro_batch=1, global_batch=1, seq=window, precision="float32"), world=1)
    if not (path / "tokenizer.json").is_file():
        raise checkpoint.CheckpointError(f"{path} has no tokenizer.json; put the model's tokenizer.json there "
                                         "(save_pretrained of its tokenizer writes it)")
    tokenizer = corpus.load_tokenizer(path / "tokenizer.json")
    try:
        eos = corpus.end_of_document(path / "tokenizer.json")
    except ValueError:  # a tokenizer without an end token
        eos = None
    _single_process_group()
    model = Transformer(Grid(Layout()), cfg)
    if hf:
        load_hf(model, path)
    else:
        checkpoint.load_checkpoint(path, model)
    return Opened(model, tokenizer, window, stop_ids(path, eos), path)


@torch.no_grad()
def continue_ids(model: Transformer, ids: list[int], window: int, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, stop_ids: Collection[int] = (), stop: Callable[[list[int]], bool] | None = None
                 ) -> list[int]:
    """`ids` and up to `max_new_tokens` more: greedy (temperature 0) or sampled at `temperature` > 0;
    a sample ends with any of `stop_ids`, as transformers' generate with those eos_token_id (the
    model's turn or text ended), or once `stop(the new ids)` is true (a stop string in them)."""
    if max(ids) >= model.cfg.vocab:
        raise ValueError(f"the prompt has token id {max(ids)}, outside the model's vocabulary of {model.cfg.vocab}; "
                         "use the model's own tokenizer.json")
    ids, first = list(ids), len(ids)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids[-window:]]))[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        ids.append(token)
        if token in stop_ids or (stop is not None and stop(ids[first:])):
            break
    return ids


def generate(path: str | Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0, *,
             chat: bool = False, system: str = "", messages: list[dict] | None = None, template: str = "default",
             stop_strings: Sequence[str] = (), special_tokens: bool = False) -> str:
    """The prompt and its continuation, from a checkpoint or Hugging Face directory (see `open_model`).
    `chat`: the prompt is a user's turn (after `system`'s, or `messages` is the conversation), rendered
    with the model's chat template `template` and its reply returned. A sample ends at the model's
    end-of-turn or end-of-document ids, or at a stop string (kept, as transformers' stop_strings
    keeps it). `special_tokens`: shown (the turns' markers), else left out as the tokenizer decodes.
    ValueError for a prompt and max_new_tokens past the model's positions (it was not trained there)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    opened = open_model(path)
    try:
        tokenizer = opened.tokenizer
        if chat or messages:
            text = _rendered(opened.folder, messages or [*([{"role": "system", "content": system}] * bool(system)),
                                                          {"role": "user", "content": prompt}], template)
            ids = tokenizer.encode(text, add_special_tokens=False).ids  # (the template writes the BOS it wants)
        else:
            ids = tokenizer.encode(prompt).ids or [0]
        positions = opened.model.cfg.max_positions
        if len(ids) + max_new_tokens > positions:
            raise ValueError(f"--max-new-tokens {max_new_tokens} after the prompt's {len(ids)} tokens passes the "
                             f"model's {positions} positions; give --max-new-tokens {max(0, positions - len(ids))} or "
                             f"less, or a shorter prompt")

        def stop(new: list[int]) -> bool:
            return bool(stop_strings) and any(s in tokenizer.decode(new, skip_special_tokens=False)
                                              for s in stop_strings)

        out = continue_ids(opened.model, ids, opened.window, max_new_tokens, temperature, seed, opened.stop_ids, stop)
        shown = out[len(ids):] if chat or messages else out
        return tokenizer.decode(shown, skip_special_tokens=not special_tokens)
    finally:
        dist.destroy_process_group()


def _rendered(folder: Path, conversation: list[dict], name: str) -> str:
    template = chat.template_of(folder, name)
    if template is None:
        where = "no chat template" if name == "default" else f"no chat template named {name!r}"
        raise ValueError(f"{folder} has {where} (chat_template.jinja, additional_chat_templates/, or "
                         f"tokenizer_config.json's chat_template); generate without --chat, or give the model's "
                         f"tokenizer files")
    return chat.render(template, conversation, add_generation_prompt=True, special=chat.special_tokens(folder))
