"""Pipelines against transformers, in float64: tied input and output embeddings (Llama 3.2-style
tie_word_embeddings, GPT-2) split over pipeline stages, and evaluation through the stages.

Tied, one training step (loss and every gradient): pp2 cp2 x2 on 1F1B, pp4 cp2 interleaved, pp2
dp2 z2 GPipe and pp4 y2 GPipe with sequence parallelism (with the tied cases of
test_pipeline_context.py, which hold two optimizer steps to the serial model on pp2 GPipe, pp4 1F1B
and pp2 interleaved, every schedule runs on pp2 and pp4). Evaluation: `evaluate` through the stages
on pp2 cp2 x2, pp4 cp2 (interleaved layout) and pp2 dp2 z2, `fourfold eval` launched once (pp2 cp2
x2), and `train.eval_every` on pp2 dp2 against the same checkpoint scored on dp alone (with the
checkpoint holding the tied table once and a resumed run repeating a step bit for bit)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

from families_on_grids import evaluate_families, run_families
from fourfold import checkpoint
from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.config import load_train_config
from fourfold.data import corpus
from fourfold.models.config import ModelConfig
from fourfold.spec.layout import Layout
from runs import whole_checkpoint
from serial_reference import relative_error, rms_norm_in_input_dtype, saved_random_model

BATCH, SEQ, VOCAB, LAYERS = 8, 16, 128, 8  # 8 layers: 8 stages on pp4 interleaved
FAMILIES = {
    "llama-tied": dict(model_type="llama", hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                       tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, n_positions=32,
                 tie_word_embeddings=True),
}
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
TOKENS = torch.randint(0, VOCAB, (12 * SEQ + 1,), generator=torch.Generator().manual_seed(2)).numpy()  # 12 windows
GRIDS = {  # name: (sizes, sequence parallel, micro-batches, schedule, virtual stages)
    "pp2cp2x2-1f1b": (dict(pp=2, cp=2, x=2), False, 2, "1f1b", 1),
    "pp4cp2-interleaved": (dict(pp=4, cp=2), False, 4, "interleaved-1f1b", 2),
    "pp2dp2z2-gpipe": (dict(pp=2, dp=2, z=2), False, 2, "gpipe", 1),
    "pp4y2-gpipe-sp": (dict(pp=4, y=2), True, 2, "gpipe", 1),
}


def _reference(name, path):
    """A saved random model, and transformers' loss and gradients on IDS and mean loss on TOKENS' windows."""
    _, model = saved_random_model(FAMILIES[name], path)
    windows = torch.stack([torch.from_numpy(TOKENS[i * SEQ : (i + 1) * SEQ + 1]) for i in range(12)])
    with pytest.MonkeyPatch.context() as patch:  # transformers' RMSNorm is float32 whatever the input
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
        with torch.no_grad():
            held_out = model(input_ids=windows[:, :-1]).logits
        logits = model(input_ids=IDS[:, :-1]).logits
    eval_loss = torch.nn.functional.cross_entropy(held_out.reshape(-1, VOCAB), windows[:, 1:].reshape(-1)).item()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), eval_loss=eval_loss,
                           grads={k: p.grad for k, p in model.named_parameters()})


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return {name: _reference(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


@pytest.mark.parametrize("grid", GRIDS)
def test_tied_embeddings_over_stages_equal_transformers(ranks, families, grid):
    """Loss and every gradient (the tied table's: the first stage's and the last stage's copy's, summed)."""
    sizes, seq_parallel, microbatches, schedule, virtual = GRIDS[grid]
    paths = {name: ref.path for name, ref in families.items()}
    results = ranks.run(run_families, Layout(**sizes).world_size, paths, IDS, sizes, seq_parallel, microbatches,
                        schedule, virtual)
    for name, ref in families.items():
        grads = {}
        for _, out in results:
            loss, _, stage_grads = out[name]
            assert loss == pytest.approx(ref.loss, rel=1e-10), name
            grads.update(stage_grads or {})
        hf_grads = to_hf_tensors(ModelConfig.from_hf(FAMILIES[name]), grads)
        assert hf_grads.keys() == ref.grads.keys()
        bad = {k: e for k, g in ref.grads.items() if not (e := relative_error(hf_grads[k], g)) < 1e-10}
        assert not bad, (name, bad)


@pytest.mark.parametrize("grid", ["pp2cp2x2-1f1b", "pp4cp2-interleaved", "pp2dp2z2-gpipe"])
def test_evaluation_through_the_stages_equals_transformers(ranks, families, grid):
    sizes, _, _, _, virtual = GRIDS[grid]
    paths = {name: ref.path for name, ref in families.items()}
    results = ranks.run(evaluate_families, Layout(**sizes).world_size, paths, TOKENS, SEQ, 2, sizes, virtual)
    for name, ref in families.items():
        for out in results:  # every rank returns the same mean, over every window
            assert out[name]["tokens"] == 12 * SEQ
            assert out[name]["loss"] == pytest.approx(ref.eval_loss, rel=1e-10), name


def test_fourfold_eval_on_a_pipeline_grid(ranks, families, tmp_path):
    """`fourfold eval` (on the pool's 8 ranks) through the stages of pp2 cp2 x2."""
    from fourfold.testing import eval_command

    np.save(tmp_path / "tokens.npy", TOKENS)
    result = ranks.run(eval_command, 8, ["--hf", families["llama-tied"].path, "--tokens", str(tmp_path / "tokens.npy"),
                                         "--seq", str(SEQ), "--batch", "2", "--grid", "pp=2,cp=2,x=2",
                                         "--precision", "float64"])[0]
    assert result["loss"] == pytest.approx(families["llama-tied"].eval_loss, rel=1e-10)


def _train(options):
    from fourfold.train.trainer import train

    return train(load_train_config(None, options))


def _score_on_dp(options, path):
    """The held-out loss of checkpoint `path` on dp alone, as the trainer scores it."""
    from fourfold.data.prepare import packed_windows, tokens_files
    from fourfold.parallel.grid import Grid
    from fourfold.parallel.model import Model
    from fourfold.train.evaluate import evaluate

    cfg = load_train_config(None, options)
    model = Model(Grid(Layout(dp=2)), cfg.job().with_layout(dp=2), cfg.model_config(), dtype=torch.float64)
    checkpoint.load_checkpoint(path, model.module)
    files = tokens_files(cfg.data, cfg.tokenizer)
    loader = corpus.TokenLoader(files[1], cfg.batch.seq, cfg.batch.global_batch, seed=cfg.data.seed,
                                packing=cfg.data.packing, windows=packed_windows(cfg.data, cfg.batch.seq, *files))
    return evaluate(model, loader.held_out(), cfg.batch.seq, cfg.batch.micro_batch, cfg.train.eval_tokens)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_tied_pipeline_trains_evaluates_and_resumes(ranks, tmp_path):
    """tiny-gpt (tied) on pp2 dp2: the held-out loss logged after step 2 is the saved step 2's
    scored on dp alone; the checkpoints hold the table once (embed, no lm_head); a run resumed
    from step 1 repeats step 2 bit for bit."""
    text = tmp_path / "kjv.txt"
    text.write_text(corpus.bundled_text()[:100_000])
    options = ["--data.text", str(text), "--data.vocab", "1024", "--data.cache_dir", str(tmp_path / "cache"),
               "--model.preset", "tiny-gpt", "--log.progress", "false", "--train.steps", "2",
               "--train.eval_every", "2", "--train.precision", "float64", "--batch.global_batch", "8",
               "--batch.micro_batch", "2", "--batch.seq", "32", "--checkpoint.every", "1", "--checkpoint.keep", "2"]
    grid = ["--grid.pp", "2", "--grid.dp", "2"]
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    ranks.run(_train, 4, [*options, *grid, "--log.run_dir", str(run)])
    logged = [r for r in _records(run) if "eval_loss" in r]
    assert [r["eval_after_step"] for r in logged] == [2]
    step2 = checkpoint.latest(run / "checkpoints")
    scored = ranks.run(_score_on_dp, 2, [*options, "--log.run_dir", str(run)], step2)[0]
    assert logged[0]["eval_loss"] == pytest.approx(scored["loss"], rel=1e-12)
    saved = whole_checkpoint(step2)
    assert "model/embed" in saved and "optim/m/embed" in saved and not any("lm_head" in k for k in saved)

    ranks.run(_train, 4, [*options, *grid, "--log.run_dir", str(resumed), "--checkpoint.load",
                          str(run / "checkpoints" / "step-00000001")])
    losses = [{r["step"]: r["loss"] for r in _records(d) if "loss" in r and "step" in r} for d in (run, resumed)]
    assert losses[1] == {1: losses[0][1]}  # (steps count from 0: step 1 is the second)
    again = whole_checkpoint(checkpoint.latest(resumed / "checkpoints"))
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)
