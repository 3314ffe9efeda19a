"""Where a run starts from, decided before any process starts and agreed by every rank: its own
newest intact checkpoint, else checkpoint.load's, else model.hf's weights or none; and the files
each checkpoint keeps beside the weights (the tokenizer, generation settings)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch.distributed as dist

from fourfold import checkpoint
from fourfold.config import ConfigError, TrainConfig
from fourfold.models.config import ModelConfig


def checkpoint_source(cfg: TrainConfig) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the checkpoint this run starts from, the damaged newer ones of its own passed over with what
    is wrong in each): its own newest intact one (checkpoint.resume), else checkpoint.load (a
    step-N directory, or a run's checkpoint directory: its latest), else none. The run's own wins,
    so that running the same command again, or a torchrun restart, continues instead of going back
    to checkpoint.load. Every file is checked there with its size (`checkpoint.damage`); raises
    ConfigError, naming what is missing and the fix, where nothing intact is left to start from:
    a checkpoint.load that is damaged or does not exist, or a run whose checkpoints all are."""
    c = cfg.checkpoint
    if c.resume:
        own, skipped = checkpoint.newest_intact(cfg.checkpoint_dir)
        if own is not None:
            return own, skipped
        if skipped:
            raise ConfigError(f"every checkpoint in {cfg.checkpoint_dir} is damaged ({_damages(skipped)}): move them "
                              f"aside (out of step-*) to start anew, or give another --log.run_dir")
    if not c.load:
        return None, []
    load = Path(c.load)
    if not load.exists():
        raise ConfigError(f"checkpoint.load {load} does not exist; give a step-N directory or a run's checkpoint "
                          f"directory written by `fourfold train`")
    step = load
    if not (load / checkpoint.META).is_file() and not checkpoint.STEP.fullmatch(load.name):  # a run's directory
        steps = checkpoint.step_dirs(load)
        if not steps:
            raise ConfigError(f"checkpoint.load {load} is not a fourfold checkpoint (no {checkpoint.META}, no step-N "
                              f"directories); give a step-N directory or a run's checkpoint directory written by "
                              f"`fourfold train`")
        step = steps[-1]
    what = checkpoint.damage(step)
    if what:
        intact = checkpoint.newest_intact(step.parent)[0]
        other = f", or --checkpoint.load {intact}, the newest intact one" if intact else ""
        raise ConfigError(f"checkpoint.load: the checkpoint {step} is damaged ({what}): copy it again{other}")
    return step, []


def _damages(skipped: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{path.name}: {what}" for path, what in skipped)



# The model settings that shape its tensors: a checkpoint of other values cannot be loaded. (The
# others, RoPE's theta and scaling, the positions of a RoPE model, eps, the sliding window, may
# change between runs: a long-context extension does.)
SHAPES = ("family", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tied", "head_dim", "qkv_bias",
          "out_bias", "mlp_bias", "experts", "shared_ffn")


def check_checkpoint(cfg: TrainConfig) -> list[str]:
    """The weights the run would start from, before any process starts: its checkpoint, every file
    there with its size (`checkpoint_source`), and of the configured model's shapes; else model.hf's
    safetensors (raises ConfigError naming the fix). Returns the other settings that differ from the
    checkpoint's, as "key there -> here", for the user to see."""
    source, _ = checkpoint_source(cfg)  # (the ranks say which damaged ones they pass over)
    if source is None:
        if cfg.model.hf:  # the run starts from its weights: they must be there
            from fourfold.checkpoint.hf import check_weights

            try:
                check_weights(cfg.model.hf)
            except checkpoint.CheckpointError as e:
                raise ConfigError(f"model.hf: {e}") from None
        return []
    own = source.parent == Path(cfg.checkpoint_dir)
    saved = ModelConfig.from_dict(checkpoint.read_meta(source)["model"])
    model = cfg.model_config()
    shapes = SHAPES + (("max_positions",) if model.family_spec().learned_positions else ())
    differ = {f.name: f"{f.name} {getattr(saved, f.name)} there, {getattr(model, f.name)} here"
              for f in dataclasses.fields(model) if getattr(saved, f.name) != getattr(model, f.name)}
    refused = [text for name, text in differ.items() if name in shapes]
    if refused:
        fix = ("give another --log.run_dir, or --checkpoint.resume false, to start anew" if own else
               "give a checkpoint of this model, or the model it was trained with")
        raise ConfigError(f"the checkpoint {source} holds another model ({'; '.join(refused)}): {fix}")
    return [text for name, text in differ.items() if name not in shapes]


def agreed_source(cfg: TrainConfig, group) -> tuple[Path | None, list[tuple[Path, str]]]:
    """`checkpoint_source` as rank 0 finds it (the rule the check before launch applied), on every
    rank, its contents then verified by all of them together (`checkpoint.contents_damage`): every
    rank loads the same step, and none reads a checkpoint before it is verified. A checkpoint of
    the run's own whose contents differ from its manifest is passed over like one missing a file
    (the next older intact one is taken); checkpoint.load's is refused, naming the files."""
    source, skipped = _on_rank_0(lambda: checkpoint_source(cfg), group)
    while source is not None and (what := checkpoint.contents_damage(source, group)):
        if not (cfg.checkpoint.resume and source.parent == cfg.checkpoint_dir):  # checkpoint.load's: no other to take
            raise ConfigError(f"checkpoint.load: the checkpoint {source} is damaged ({what}): copy it again")
        skipped.append((source, what))
        source, older = _on_rank_0(lambda: checkpoint.newest_intact(cfg.checkpoint_dir, older_than=source), group)
        skipped += older
    if source is None and skipped:
        raise ConfigError(f"every checkpoint in {cfg.checkpoint_dir} is damaged ({_damages(skipped)}): move them "
                          f"aside (out of step-*) to start anew, or give another --log.run_dir")
    return source, skipped


def _on_rank_0(find, group):
    """What `find()` returns on rank 0, on every rank of `group` (a ConfigError it raises: raised on every rank)."""
    found = [None]
    if dist.get_rank() == 0:
        try:
            found = [find()]
        except ConfigError as e:  # (a file changed since the check before launch)
            found = [e]
    dist.broadcast_object_list(found, src=0, group=group)
    if isinstance(found[0], ConfigError):
        raise found[0]
    return found[0]


def generation_settings(hf: str) -> tuple[dict[str, Path], int | None]:
    """What model.hf (`hf`: a Hugging Face directory, or "") says about generating, kept with each
    checkpoint for `fourfold export`: its generation_config.json (to copy in; name -> path) and its
    config.json's pad_token_id."""
    if not hf:
        return {}, None
    folder = Path(hf).expanduser()
    generation = folder / "generation_config.json"
    pad = json.loads((folder / "config.json").read_text()).get("pad_token_id")
    return ({"generation_config.json": generation} if generation.is_file() else {}), pad
