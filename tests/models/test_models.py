"""Llama and GPT-2 on the 3D grid against Hugging Face transformers, with import and export."""

import dataclasses
import json

import pytest
import torch

from fourfold import checkpoint as fourfold_checkpoint
from fourfold.checkpoint import CheckpointError
from fourfold.checkpoint.export import export
from fourfold.checkpoint.hf import load_hf
from fourfold.models.config import ModelConfig, load_config, preset_names
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import Replicas
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import GridError, Layout
from hf_on_grids import compare_with_hf
from serial_reference import rms_norm_in_input_dtype

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 8, 16
HF_CONFIGS = {
    "llama-gqa": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=128, vocab_size=128, tie_word_embeddings=False),
    "llama-mha-tied": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=8, intermediate_size=96, vocab_size=128, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=8, vocab_size=128, n_positions=32),
}
GRIDS_8 = [dict(x=x, y=y, z=8 // (x * y)) for x in (1, 2, 4, 8) for y in (1, 2, 4, 8) if 8 % (x * y) == 0]
GRIDS_DP = [dict(dp=2, x=2, y=2), dict(dp=2, y=2, z=2), dict(dp=2, x=4)]


def _hf_model(name, dtype):
    cfg = transformers.AutoConfig.for_model(**HF_CONFIGS[name])
    torch.manual_seed(0)
    # sdpa: the eager path takes the softmax in float32, which would cap a float64 reference
    # eval(): no dropout
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype).eval()
    with torch.no_grad():  # make every parameter (norms and biases too) non-trivial
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    """A saved random model and transformers' loss, logits and gradients on a fixed batch (float64)."""
    name = request.param
    model = _hf_model(name, torch.float64)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    ids = torch.randint(0, 128, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
        logits = model(input_ids=ids[:, :-1]).logits
    # every position scored (transformers' own loss would drop the last one)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    return name, str(path), ids, loss.item(), logits.detach(), grads


def _allowed(name, sizes):
    hf = HF_CONFIGS[name]
    heads = hf.get("num_attention_heads", hf.get("n_head"))
    kv = hf.get("num_key_value_heads", heads)
    return kv % sizes.get("y", 1) == 0 and heads % sizes.get("y", 1) == 0


def test_llama_and_gpt2_equal_transformers_on_every_8_rank_grid(ranks, checkpoint):
    name, path, ids, loss, logits, grads = checkpoint
    checked = 0
    for sizes in GRIDS_8 + GRIDS_DP:
        n = Layout(**sizes).world_size
        if not _allowed(name, sizes):
            continue
        ranks.run(compare_with_hf, n, path, sizes, ids, loss, logits, grads, torch.float64, 1e-10)
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_and_sequence_parallel_change_nothing(ranks, checkpoint, recompute):
    name, path, ids, loss, logits, grads = checkpoint
    ranks.run(compare_with_hf, 8, path, dict(x=2, y=2, z=2), ids, loss, logits, grads, torch.float64, 1e-10,
              recompute, True)


def test_float32_within_1e5(ranks, checkpoint):
    name, path, ids, loss, logits, grads = checkpoint
    ranks.run(compare_with_hf, 8, path, dict(x=2, y=2, z=2), ids, loss, logits, grads, torch.float32, 1e-5)


def _import_and_save(src, root, sizes):
    grid = Grid(Layout(**sizes))
    model = Transformer(grid, load_config(src), TensorOptions(dtype=torch.float64))
    load_hf(model, src)
    fourfold_checkpoint.save(root, 1, model, None, {"model": dataclasses.asdict(model.cfg)}, keep=1)
    return True


def _load_shared(path, sizes):
    """Loaded as the trainer loads (the dp*cp replicas share the reading), against a plain load;
    returns the elements this rank read, and what a plain load reads."""
    import fourfold.checkpoint.hf as hf

    grid = Grid(Layout(**sizes))
    counted = []

    def counting(*args):
        read = reader(*args)

        def counted_read(*where):
            t = read(*where)
            counted.append(t.numel())
            return t
        return counted_read

    reader, hf.checkpoint_reader = hf.checkpoint_reader, counting
    try:
        shared = Transformer(grid, load_config(path), TensorOptions(dtype=torch.float64))
        load_hf(shared, path, replicas=Replicas.of_grid(grid))
        read_shared = sum(counted)
        counted.clear()
        plain = Transformer(grid, load_config(path), TensorOptions(dtype=torch.float64), seed=1)
        load_hf(plain, path)
    finally:
        hf.checkpoint_reader = reader
    for p, q in zip(shared.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    return read_shared, sum(counted), sum(p.numel() for p in plain.parameters())


@pytest.mark.parametrize("sizes", [dict(dp=2, cp=2, x=2), dict(dp=2, x=2, z=2)])
def test_replicas_share_the_reading_of_a_hugging_face_directory(ranks, checkpoint, sizes):
    name, path, *_ = checkpoint
    reads = ranks.run(_load_shared, 8, path, sizes)
    assert all(shared < plain for shared, plain, _ in reads)  # each read a part; together, all of it
    replicas = sizes["dp"] * sizes.get("cp", 1)
    assert sum(shared for shared, *_ in reads) == sum(plain for _, plain, _ in reads) / replicas
    if sizes.get("z", 1) > 1:  # a z shard reads the rows it overlaps, not its whole (x, y) block (z times more)
        assert all(plain < 1.5 * local for _, plain, local in reads), reads


@pytest.mark.parametrize("sizes", [dict(x=2, y=2, z=2), dict(y=2, z=4)])
def test_round_trip_gives_identical_tensors(ranks, checkpoint, tmp_path, sizes):
    """Imported on a grid, checkpointed, exported (the users' route): transformers' tensors again."""
    name, path, *_ = checkpoint
    ranks.run(_import_and_save, 8, path, str(tmp_path / "run"), sizes)
    export(tmp_path / "run", tmp_path / "out")
    original = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float64)
    a, b = original.state_dict(), exported.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _mismatch(path):
    grid = Grid(Layout(x=2))
    cfg = load_config(path)
    wrong = ModelConfig(**{**cfg.__dict__, "layers": cfg.layers + 1})
    with pytest.raises(CheckpointError, match=r"does not match the model config: layers: checkpoint 2 vs model 3"):
        load_hf(Transformer(grid, wrong), path)
    return True


def test_config_mismatch_is_a_clear_error(ranks, checkpoint):
    assert ranks.run(_mismatch, 2, checkpoint[1]) == [True, True]


def _missing(path, victim):
    import re

    grid = Grid(Layout(dp=2))
    with pytest.raises(CheckpointError, match=rf"has no tensor '{re.escape(victim)}' \(1 missing\)"):
        load_hf(Transformer(grid, load_config(path)), path, replicas=Replicas.one_group(grid.group("dp")))
    return True


def test_a_missing_tensor_is_named_on_every_rank_before_any_is_read(ranks, checkpoint, tmp_path):
    """With shared reading a rank reads only some layers: the check comes first, on every rank."""
    import shutil

    from safetensors.torch import load_file, save_file

    name, path, *_ = checkpoint
    shutil.copytree(path, tmp_path / "cut")
    tensors = load_file(tmp_path / "cut" / "model.safetensors")
    victim = sorted(name for name in tensors if "layers.1." in name or ".h.1." in name)[-1]
    del tensors[victim]
    save_file(tensors, tmp_path / "cut" / "model.safetensors", metadata={"format": "pt"})
    assert ranks.run(_missing, 2, str(tmp_path / "cut"), victim) == [True, True]


def test_presets_read_as_hf_configs():
    names = preset_names()
    for n in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "llama-2-7b", "llama-2-13b", "llama-2-70b",
              "gpt-5b", "gpt-80b", "gpt-640b", "gpt-3-175b", "tiny-llama", "tiny-gpt", "gemma-3-27b",
              "gpt-oss-120b", "gpt-oss-20b", "deepseek-v3"):
        assert n in names
    assert round(load_config("llama-3.1-8b").parameter_count() / 1e9, 2) == 8.03
    assert round(load_config("llama-3.1-405b").parameter_count() / 1e9, 1) == 405.9
    assert round(load_config("gpt-3-175b").parameter_count() / 1e9, 1) == 174.6
    assert round(load_config("gemma-3-27b").parameter_count() / 1e9, 2) == 27.01
    assert round(load_config("deepseek-v3").parameter_count() / 1e9) == 671
    assert round(load_config("gpt-oss-120b").parameter_count() / 1e9, 1) == 116.8
    with pytest.raises(ValueError, match="neither a config.json nor a preset; presets: deepseek-v3, gemma-3-27b, gpt"):
        load_config("no-such-model")


def test_parameter_count_matches_transformers():
    for name in HF_CONFIGS:
        model = _hf_model(name, torch.float32)
        cfg = ModelConfig.from_hf(json.loads(model.config.to_json_string()))
        assert cfg.parameter_count() == sum(p.numel() for p in model.parameters())


def _indivisible_heads():
    grid = Grid(Layout(y=8))
    with pytest.raises(GridError, match="y=8 must divide heads=8 and kv_heads=4"):
        Transformer(grid, ModelConfig.from_hf(HF_CONFIGS["llama-gqa"]))
    return True


def test_indivisible_heads_name_the_fix(ranks):
    assert all(ranks.run(_indivisible_heads, 8))


def test_eval_command_gives_transformers_loss(ranks, checkpoint, tmp_path):
    """`fourfold eval` on 4 CPU ranks (the pool's; tests/train/test_trainer.py launches it through
    torchrun), against transformers on the same windows."""
    import numpy as np

    from fourfold.testing import eval_command

    name, path, *_ = checkpoint
    tokens = np.random.default_rng(0).integers(0, 128, size=16 * 10 + 5).astype(np.int32)  # 10 windows, 1 padded
    np.save(tmp_path / "tokens.npy", tokens)
    result = ranks.run(eval_command, 4, ["--hf", path, "--tokens", str(tmp_path / "tokens.npy"), "--seq", "16",
                                         "--grid", "x=2,z=2", "--precision", "float64"])[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64,
                                                              attn_implementation="sdpa")
    ids = torch.from_numpy(tokens.astype(np.int64))[torch.arange(10)[:, None] * 16 + torch.arange(17)]
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
        logits = model(input_ids=ids[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1)).item()
    assert result["tokens"] == 160
    assert abs(result["loss"] - expected) < 1e-10 * expected
