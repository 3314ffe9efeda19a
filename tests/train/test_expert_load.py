"""A mixture's expert load in the log (issue #39, item 2): each layer's tokens per expert, imbalance,
dropped choices and router entropy, in log.jsonl and TensorBoard, equal to the router's counts of
transformers' Mixtral on the same weights and batch, counted here."""

import json

import pytest
import torch
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fourfold.checkpoint.export import export
from fourfold.config import load_train_config
from fourfold.data import corpus
from fourfold.data.prepare import packed_windows, tokens_files
from runs import prepared_corpus, train_run

VOCAB, EXPERTS, TOP_K, LAYERS, SEQ, BATCH = 512, 4, 2, 2, 32, 8
MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=32, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, num_local_experts=EXPERTS,
               num_experts_per_tok=TOP_K, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False,
               rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", router_aux_loss_coef=0.02)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_corpus(tmp_path_factory.mktemp("data"), 100_000, VOCAB)


def _run(tmp_path, data, *grid):
    preset = tmp_path / "tiny-mixtral.json"
    preset.write_text(json.dumps(MIXTRAL))
    run = tmp_path / "run"
    options = [*data, "--model.preset", str(preset), "--train.precision", "float64", *grid, "--log.run_dir", str(run),
               "--log.progress", "false", "--train.steps", "2", "--batch.global_batch", str(BATCH),
               "--batch.micro_batch", "2", "--batch.seq", str(SEQ), "--checkpoint.every", "1"]
    return options, run


def _step_one(options, run):
    """Step 1's global batch (its input ids, as the trainer's data order gives it) and transformers'
    Mixtral on the weights it ran, from the export of the checkpoint written after step 0."""
    cfg = load_train_config(None, options)
    tokenizer, tokens = tokens_files(cfg.data, cfg.tokenizer)
    loader = corpus.TokenLoader(tokens, SEQ, BATCH, seed=cfg.data.seed, packing=cfg.data.packing,
                                windows=packed_windows(cfg.data, SEQ, tokenizer, tokens))
    ids = torch.from_numpy(loader.batch_at(BATCH, 0, 1))[:, :-1].clamp_min(0)
    export(run / "checkpoints" / "step-00000001", run / "export")
    return ids, transformers.AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float64,
                                                                  experts_implementation="eager")


def _router_counts(options, run):
    """Each layer's [choices per expert] and mean router entropy on step 1's batch, by transformers'
    Mixtral loaded from the export of the checkpoint written after step 0 (the weights step 1 ran)."""
    ids, model = _step_one(options, run)
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    out = []
    for layer in logits:
        probs = torch.softmax(layer.reshape(-1, EXPERTS).double(), dim=-1)
        chosen = torch.topk(probs, TOP_K, dim=-1).indices
        entropy = -(probs * probs.log()).sum(-1).mean().item()
        out.append((torch.bincount(chosen.reshape(-1), minlength=EXPERTS).tolist(), entropy))
    return out


@pytest.mark.parametrize("grid", [("--grid.dp", "2", "--grid.x", "2", "--grid.ep", "2"),
                                  # (full recompute runs each forward again in backward: counted once)
                                  ("--grid.pp", "2", "--grid.y", "2", "--grid.z", "2", "--train.recompute", "full")])
def test_expert_load_is_the_routers_counts(ranks, data, tmp_path, grid):
    options, run = _run(tmp_path, data, *grid)
    ranks.run(train_run, 8 if "--grid.z" in grid else 4, options)
    records = {r["step"]: r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
               if "step" in r and "event" not in r}
    figures = records[1]["experts"]
    assert sorted(figures) == [f"layer{i}" for i in range(LAYERS)]
    for i, (counts, entropy) in enumerate(_router_counts(options, run)):
        got = figures[f"layer{i}"]
        assert sum(counts) == BATCH * SEQ * TOP_K
        assert (got["min"], got["mean"], got["max"]) == (min(counts), sum(counts) / EXPERTS, max(counts))
        assert got["imbalance"] == pytest.approx(max(counts) / (sum(counts) / EXPERTS))
        assert got["dropped"] == 0 and got["entropy"] == pytest.approx(entropy, rel=1e-9)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for i in range(LAYERS):
        assert [(e.step, e.value) for e in events.Scalars(f"train/experts/layer{i}/max")] == [
            (s, float(records[s]["experts"][f"layer{i}"]["max"])) for s in (0, 1)]


def test_choices_dropped_over_capacity_are_counted(ranks, data, tmp_path):
    """Capacity factor 1 on dp2: each rank's micro-batch of 2 sequences routes 64 tokens, each expert
    takes at most 32 of their 128 choices; the first layer's dropped choices and kept tokens per
    expert are those of transformers' router counts per micro-batch (the later layers see the
    drops, which transformers does not make)."""
    options, run = _run(tmp_path, data, "--grid.dp", "2", "--model.capacity_factor", "1")
    ranks.run(train_run, 2, options)
    records = {r["step"]: r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
               if "step" in r and "event" not in r}
    ids, model = _step_one(options, run)
    kept, dropped = torch.zeros(EXPERTS), 0
    for micro_batch in ids.split(2):  # (replica d holds sequences 4d..4d+3: micro-batches of 2 in order)
        with torch.no_grad():
            first = model(input_ids=micro_batch, output_router_logits=True).router_logits[0]
        chosen = torch.topk(torch.softmax(first.reshape(-1, EXPERTS), dim=-1), TOP_K, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
        capacity = -(-TOP_K * len(chosen) // EXPERTS)
        kept += counts.clamp(max=capacity)
        dropped += int((counts - capacity).clamp(min=0).sum())
    got = records[1]["experts"]["layer0"]
    assert dropped > 0 and got["dropped"] == dropped
    assert (got["min"], got["max"], got["mean"]) == (kept.min().item(), kept.max().item(), kept.mean().item())
