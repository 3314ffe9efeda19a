"""The pad token's embedding row as transformers trains it: `nn.Embedding(padding_idx=pad_token_id)`
gives that row no gradient from the lookup (a tied head's gradient still reaches it). With the pad
token in the data (Qwen's <|endoftext|> is both pad and document end), three AdamW steps with
clipping on 8-rank grids (dp, x/y/z, sequence parallel, the vocabulary split over y and padded, tied
and untied) give transformers' losses, gradient norms and weights in float64; with
model.train_padding_row the row is trained, and the run is no longer transformers'."""

import numpy as np
import pytest
import torch
import transformers

from fourfold.models.config import ModelConfig, load_config
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model
from fourfold.parallel.tensor.params import full_weights
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from hf_training import fourfold_steps, relative, transformers_steps
from serial_reference import rms_norm_in_input_dtype

PAD, VOCAB, BATCH, SEQ, STEPS = 5, 61, 8, 16, 3  # 61: padded to 62 rows on y=2
HF = dict(model_type="qwen3", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=PAD)


def _batch():
    ids = np.random.default_rng(2).integers(0, VOCAB, (BATCH, SEQ + 1))
    ids[:, ::4] = PAD  # the pad token as input and as target, a quarter of the tokens
    return ids


def _reference(tmp_path_factory, tied: bool):
    path = tmp_path_factory.mktemp("padded")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**HF, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    with torch.no_grad():  # the pad row too, as a checkpoint trained elsewhere holds it
        model.model.embed_tokens.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_input_dtype)
        return str(path), transformers_steps(model, _batch(), STEPS)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {tied: _reference(tmp_path_factory, tied) for tied in (False, True)}


GRIDS = {"untied-dp2x2y2": (False, dict(dp=2, x=2, y=2), False), "tied-x2y2z2-sp": (True, dict(x=2, y=2, z=2), True)}


@pytest.mark.parametrize("grid", GRIDS)
def test_training_with_the_pad_token_equals_transformers(ranks, references, grid):
    tied, sizes, seq_parallel = GRIDS[grid]
    path, (losses, norms, weights) = references[tied]
    got_losses, got_norms, got = ranks.run(fourfold_steps, 8, path, _batch(), sizes, seq_parallel, STEPS)[0]
    assert got_losses == pytest.approx(losses, rel=1e-10)
    assert got_norms == pytest.approx(norms, rel=1e-10)  # the trial's: 58.1 against transformers' 0.43
    for name, tensor in got.items():
        assert relative(tensor, weights[name]) < 1e-10, name


def test_the_padding_row_is_trained_only_when_asked(ranks, references):
    path, (_, _, weights) = references[False]
    _, _, got = ranks.run(fourfold_steps, 4, path, _batch(), dict(dp=2, y=2), False, STEPS, 2, True)[0]
    embed = "model.embed_tokens.weight"
    assert relative(got[embed][PAD], weights[embed][PAD]) > 1e-3


def test_the_pad_token_is_read_from_config_json_and_written_back():
    cfg = ModelConfig.from_hf(HF)
    assert cfg.pad_token == PAD and cfg.to_hf()["pad_token_id"] == PAD
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # GPT-2's embedding has no padding_idx: every row is trained, as transformers trains it
    gpt2 = dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=32, pad_token_id=PAD)
    assert ModelConfig.from_hf(gpt2).pad_token is None
    # a config.json naming none: its class's default, as transformers reads it (Gemma 3's 0, OLMoE's 1)
    for cls, fields in ((transformers.Gemma3TextConfig, dict(model_type="gemma3_text")),
                        (transformers.OlmoeConfig, dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2)),
                        (transformers.Qwen3Config, dict(model_type="qwen3"))):
        d = {k: v for k, v in dict(HF, **fields).items() if k not in ("pad_token_id", "head_dim")}
        assert ModelConfig.from_hf(d).pad_token == cls().pad_token_id, cls
        assert ModelConfig.from_hf(dict(d, pad_token_id=None)).pad_token is None


def _initial_table(path, sizes):
    job = Job(Layout(**sizes), global_batch=4, micro_batch=2, seq=SEQ, precision="float64")
    model = Model(Grid(job.layout), job, load_config(path), dtype=torch.float64)
    return full_weights(model.module)["embed"]


def test_a_model_started_from_scratch_has_a_zero_padding_row(ranks, references):
    """As transformers initialises nn.Embedding(padding_idx): on a grid splitting the table over y and z."""
    table = ranks.run(_initial_table, 4, references[True][0], dict(y=2, z=2))[0]
    assert table[PAD].abs().max() == 0 and table[PAD + 1].abs().max() > 0
