"""`fourfold export`: a sharded training checkpoint as a Hugging Face directory, tensor by tensor,
in several safetensors shards with an index; transformers loads it with the same weights."""

import dataclasses
import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from fourfold import checkpoint
from fourfold.checkpoint.export import export
from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.data import corpus
from fourfold.data.corpus import tokenizer_files
from fourfold.models.config import ModelConfig
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.params import full_weights
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout

transformers = pytest.importorskip("transformers")

MODELS = {
    "llama": ModelConfig("llama", hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=64, max_positions=32,
                         tied=False, eps=1e-5),
    "gpt2": ModelConfig("gpt2", hidden=32, layers=2, heads=4, kv_heads=4, ffn=64, vocab=64, max_positions=32,
                        tied=True, eps=1e-5),
    # GPT-2's vocabulary is odd (50,257): saved on y=2, whose tables are padded to an even row count
    "gpt2-odd-vocab": ModelConfig("gpt2", hidden=32, layers=2, heads=4, kv_heads=4, ffn=64, vocab=61,
                                  max_positions=32, tied=True, eps=1e-5),
}
GRIDS = {"llama": dict(x=2, z=2), "gpt2": dict(x=2, z=2), "gpt2-odd-vocab": dict(y=2, z=2)}


def _save(name, root):
    grid = Grid(Layout(**GRIDS[name]))
    model = Transformer(grid, MODELS[name], seed=7)
    checkpoint.save(root, 1, model, None, {"model": dataclasses.asdict(MODELS[name])}, keep=1)
    return to_hf_tensors(MODELS[name], full_weights(model))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", list(MODELS))
def test_export_writes_shards_transformers_loads(ranks, tmp_path, name, monkeypatch):
    expected = ranks.run(_save, 4, name, tmp_path / "run")[0]
    reads = []
    read_metadata = torch.distributed.checkpoint.FileSystemReader.read_metadata
    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemReader, "read_metadata",
                        lambda self: reads.append(1) or read_metadata(self))
    export(tmp_path / "run", tmp_path / "hf", shard_bytes=20_000)  # several shards
    assert len(reads) == 1  # the metadata file is read once, not once per tensor
    umask = os.umask(0)
    os.umask(umask)
    for file in (tmp_path / "hf").iterdir():  # readable by others as the umask allows, the weights too
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    state = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("holding", [["keep.txt"], ["config.json", "NOTES.md", "generation_config.json"]])
def test_export_never_replaces_an_existing_directory(tmp_path, holding):
    """Not even a model directory: a typo naming the source model must not delete it."""
    out = tmp_path / "out"
    out.mkdir()
    for name in holding:
        (out / name).write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match=f"{out} exists and is not empty; .* give a new directory "
                                                          f"or remove {out} first"):
        export(tmp_path / "run", out)
    assert sorted(p.name for p in out.iterdir()) == sorted(holding)
    assert all((out / name).read_text() == "mine" for name in holding)


def _tokenizer(path, eos="<|endoftext|>", bos=None):
    """A word-level tokenizer of the models' vocabulary: [UNK], its end token (id 1), a BOS its
    post-processor puts before each text (id 2), w3 w4 ..."""
    vocab = {"[UNK]": 0, eos: 1, bos or "unused": 2, **{f"w{i}": i for i in range(3, 40)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([eos] + [bos] * bool(bos))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 2)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def _save_with(name, root, tokenizer):
    """A checkpoint with the tokenizer files the trainer gives it."""
    model = Transformer(Grid(Layout()), MODELS[name], seed=7)
    checkpoint.save(root, 1, model, None, {"model": dataclasses.asdict(MODELS[name])}, keep=1,
                    files=tokenizer_files(tokenizer))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name,bos", [("llama", "<s>"), ("gpt2", None)])
def test_transformers_reads_the_end_token_of_the_export(ranks, tmp_path, name, bos):
    """AutoTokenizer's eos_token is the end-of-document token training put after each document,
    bos the one the tokenizer prepends (GPT-2: its <|endoftext|>), and config.json's ids match."""
    ranks.run(_save_with, 1, name, tmp_path / "run", _tokenizer(tmp_path / "tok" / "tokenizer.json", bos=bos))
    (tmp_path / "hf").mkdir()  # an empty directory is fine
    export(tmp_path / "run", tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    bos_id = 2 if bos else 1
    assert (tokenizer.eos_token, tokenizer.eos_token_id, config.eos_token_id) == ("<|endoftext|>", 1, 1)
    assert tokenizer.bos_token == (bos or "<|endoftext|>") and tokenizer.bos_token_id == config.bos_token_id == bos_id
    assert tokenizer.encode("w5 w6") == ([2, 5, 6] if bos else [5, 6])  # tokenizer.json as training used it
    assert corpus.end_of_document(tmp_path / "hf" / "tokenizer.json") == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_end_token_named_by_the_source_tokenizer_config_survives_export(ranks, tmp_path):
    """Fine-tuning a Hugging Face directory whose eos_token (<|im_end|>) only its
    tokenizer_config.json names: the checkpoint keeps that file too, and the export names that end
    token, or `--model.hf EXPORT` would find no end of document."""
    source = _tokenizer(tmp_path / "base" / "tokenizer.json", eos="<|im_end|>")
    (tmp_path / "base" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    ranks.run(_save_with, 1, "llama", tmp_path / "run", source)
    export(tmp_path / "run", tmp_path / "hf")
    assert corpus.end_of_document(tmp_path / "hf" / "tokenizer.json") == 1
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (tokenizer.eos_token, tokenizer.eos_token_id, config.eos_token_id) == ("<|im_end|>", 1, 1)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_keeps_every_tokenizer_file_and_the_chat_template(ranks, tmp_path):
    """A tokenizer saved by transformers 5 keeps its chat template in chat_template.jinja (named ones in
    additional_chat_templates/), beside special_tokens_map.json: the checkpoint copies them all and the
    export carries them over, so the fine-tuned model renders conversations as its base did."""
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|endoftext|>{% endfor %}"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(_tokenizer(tmp_path / "tok" / "tokenizer.json")),
                                                eos_token="<|endoftext|>")
    fast.chat_template = {"default": template, "tool_use": template + "{{ tools }}"}
    fast.save_pretrained(tmp_path / "base")
    source = sorted(p.relative_to(tmp_path / "base").as_posix() for p in (tmp_path / "base").rglob("*") if p.is_file())
    assert "chat_template.jinja" in source and "additional_chat_templates/tool_use.jinja" in source
    ranks.run(_save_with, 1, "llama", tmp_path / "run", tmp_path / "base" / "tokenizer.json")
    export(tmp_path / "run", tmp_path / "hf")
    exported = {p.relative_to(tmp_path / "hf").as_posix() for p in (tmp_path / "hf").rglob("*") if p.is_file()}
    assert set(source) <= exported, set(source) - exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.chat_template == {"default": template, "tool_use": template + "{{ tools }}"}
    conversation = [{"role": "user", "content": "w3 w4"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == "<|im_start|>w3 w4<|endoftext|>"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_failed_export_leaves_no_directory(ranks, tmp_path, monkeypatch):
    ranks.run(_save_with, 1, "llama", tmp_path / "run", _tokenizer(tmp_path / "tok" / "tokenizer.json"))

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr("fourfold.checkpoint.export._write", fail)  # the first shard
    with pytest.raises(OSError, match="disk full"):
        export(tmp_path / "run", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "tok"]


def _save_fine_tuned(root, tokenizer, generation):
    """A checkpoint as fine-tuning a Hugging Face model leaves it: its generation_config.json copied
    in, its config.json's pad_token_id in the meta."""
    model = Transformer(Grid(Layout()), MODELS["llama"], seed=7)
    checkpoint.save(root, 1, model, None, {"model": dataclasses.asdict(MODELS["llama"]), "pad_token_id": 5}, keep=1,
                    files=tokenizer_files(tokenizer) | {"generation_config.json": generation})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_keeps_the_pad_token_and_the_generation_settings(ranks, tmp_path):
    """The pad id of the model fine-tuned (or the one its tokenizer_config.json names) and its
    generation_config.json reach the export; transformers reads both."""
    generation = tmp_path / "generation_config.json"
    generation.write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    ranks.run(_save_fine_tuned, 1, tmp_path / "run", _tokenizer(tmp_path / "tok" / "tokenizer.json"), generation)
    export(tmp_path / "run", tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    settings = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert config.pad_token_id == settings.pad_token_id == 5 and settings.eos_token_id == config.eos_token_id == 1
    assert settings.do_sample and settings.temperature == 0.6
    tokenizer = _tokenizer(tmp_path / "named" / "tokenizer.json")  # a pad token named by the tokenizer wins
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps({"pad_token": "w3"}))
    ranks.run(_save_fine_tuned, 1, tmp_path / "run2", tokenizer, generation)
    export(tmp_path / "run2", tmp_path / "hf2")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf2").pad_token_id == 3
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf2").pad_token_id == 3


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_damaged_checkpoint_is_not_exported(ranks, tmp_path):
    ranks.run(_save_with, 1, "llama", tmp_path / "run", _tokenizer(tmp_path / "tok" / "tokenizer.json"))
    (checkpoint.latest(tmp_path / "run") / "__0_0.distcp").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"step-00000001 is damaged \(__0_0.distcp is missing\); "
                                                          r"export an intact one"):
        export(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
