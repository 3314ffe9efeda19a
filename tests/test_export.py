"""`fourfold export`: a sharded training checkpoint as a Hugging Face directory, tensor by tensor,
in several safetensors shards with an index; transformers loads it with the same weights."""

import dataclasses

import pytest
import torch

from fourfold import checkpoint
from fourfold.export import export
from fourfold.grid import Grid
from fourfold.layout import Layout
from fourfold.models.config import ModelConfig
from fourfold.models.hf import to_hf_tensors
from fourfold.models.transformer import Transformer
from fourfold.tensor.params import full_weights

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
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    state = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_export_never_deletes_a_directory_that_is_not_a_model(tmp_path):
    from fourfold.checkpoint import CheckpointError

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not a model directory"):
        export(tmp_path / "run", tmp_path / "notes")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
