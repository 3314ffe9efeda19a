"""What tests do with a training run in this process: prepare its corpus, train it, read a
checkpoint whole."""

import json

import torch
import torch.distributed.checkpoint as dcp

from fourfold.config import load_train_config
from fourfold.data import corpus


def prepared_corpus(folder, chars: int, vocab: int) -> list[str]:
    """The first `chars` characters of the bundled corpus in `folder`, tokenized once with a
    `vocab`-token BPE; the data options that train on it."""
    text = folder / "kjv-genesis.txt"
    text.write_text(corpus.bundled_text()[:chars])
    corpus.prepare(str(text), vocab, str(folder / "cache"))
    return ["--data.text", str(text), "--data.vocab", str(vocab), "--data.cache_dir", str(folder / "cache")]


def train_run(options: list[str]):
    """`fourfold train OPTIONS` on this rank (a rank pool's, or alone), without the launcher."""
    from fourfold.train.trainer import train

    return train(load_train_config(None, options))


def whole_checkpoint(path):
    """Every serial tensor of a checkpoint, whole, on one process (NaN where nothing was written)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.full(tuple(md.size), float("nan"), dtype=md.properties.dtype) for k, md in saved.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def step_losses(run_dir):
    """The last logged loss of each step of a run (a restarted run logs the replayed steps again)."""
    out = {}
    for record in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()):
        if "loss" in record and "event" not in record:
            out[record["step"]] = record["loss"]
    return out


def hub_model_run(folder, fields: dict, *options: str) -> list[str]:
    """A random model of config.json `fields` (vocabulary 512) saved by transformers in `folder` with
    the tokenizer of a 40k-character corpus, and the options that train it from there with
    `--model.hf` for 20 float64 steps, checkpoints at 10 and 20 (plus `options`)."""
    import shutil

    import transformers

    text = folder / "genesis.txt"
    text.write_text(corpus.bundled_text()[:40_000])
    tokenizer, tokens = corpus.prepare(str(text), 512, str(folder / "cache"))
    hf = folder / "hub-model"
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**dict(fields, vocab_size=512))
                                                  ).save_pretrained(hf)
    shutil.copy(tokenizer, hf / "tokenizer.json")
    return ["--model.hf", str(hf), "--data.tokens", str(tokens), "--data.tokenizer", str(hf / "tokenizer.json"),
            "--log.progress", "false", "--log.every", "1", "--train.steps", "20", "--batch.global_batch", "8",
            "--batch.micro_batch", "2", "--batch.seq", "32", "--optimizer.lr", "0.01", "--optimizer.warmup", "2",
            "--checkpoint.every", "10", "--train.precision", "float64", *options]


def assert_exports_the_checkpoint(step, folder):
    """`step` (a training checkpoint) exported to `folder`: transformers loads it with no missing,
    unexpected or mismatched tensor, and the files hold the checkpoint's serial tensors exactly."""
    import transformers
    from safetensors.torch import load_file

    from fourfold.checkpoint.export import export
    from fourfold.checkpoint.hf import to_hf_tensors
    from fourfold.models.config import ModelConfig

    export(step, folder)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    saved = {k.removeprefix("model/"): t for k, t in whole_checkpoint(step).items() if k.startswith("model/")}
    ours = to_hf_tensors(ModelConfig.from_hf(json.loads((folder / "config.json").read_text())), saved)
    written = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    assert ours.keys() == written.keys() and all(torch.equal(written[k], v) for k, v in ours.items())

