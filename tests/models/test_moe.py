"""Mixtures of experts (Mixtral; Qwen2-MoE with its shared expert) equal to transformers in
float64, router and load-balancing loss included, on one rank and on 3D, data-, context- and
sequence-parallel grids."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen2_moe import modeling_qwen2_moe

from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.data import corpus
from fourfold.models import mixtral, qwen2_moe
from fourfold.models.config import METADATA, ModelConfig
from fourfold.spec.counts import parameter_count
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import problems
from moe_on_grids import run_moe, run_moe_pipeline
from runs import step_losses, train_run, whole_checkpoint
from serial_reference import (
    cp_shard,
    load_balancing_in_input_dtype,
    relative_error,
    rms_norm_in_input_dtype,
    router_in_input_dtype,
    saved_gradients,
    saved_random_model,
)

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
              tie_word_embeddings=False, max_position_embeddings=64)
MODELS = {
    "mixtral": dict(COMMON, model_type="mixtral", num_local_experts=4, intermediate_size=16),
    "qwen2_moe": dict(COMMON, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, intermediate_size=48),
    # top-1 of 16: some experts get no token on a rank (their collectives still run, on empty tensors)
    "mixtral-16-top1": dict(COMMON, model_type="mixtral", num_local_experts=16, intermediate_size=16,
                            num_experts_per_tok=1),
    "qwen2_moe-normalised": dict(COMMON, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=24, intermediate_size=48, norm_topk_prob=True),
}
GRIDS = {  # name: (sizes, sequence parallel, recompute)
    "serial": (dict(), False, "none"),
    "x2y2z2": (dict(x=2, y=2, z=2), False, "none"),
    "dp2x2y2-sp": (dict(dp=2, x=2, y=2), True, "none"),
    "cp2z2x2-full-recompute": (dict(cp=2, z=2, x=2), False, "full"),
    "x4": (dict(x=4), False, "selective"),  # kv heads 2 < x*y: attention on the published path
    # expert parallelism: experts over ranks of dp*cp, tokens exchanged by all-to-all
    "dp4x2-ep4": (dict(dp=4, x=2, ep=4), False, "none"),
    "dp2cp2y2-ep2-sp": (dict(dp=2, cp=2, y=2, ep=2), True, "none"),
    "dp2z2x2-ep2-full-recompute": (dict(dp=2, z=2, x=2, ep=2), False, "full"),
}
BATCH, SEQ, VOCAB = 8, 16, 128
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _reference(name, path, microbatches=(IDS,), layers=2, router=router_in_input_dtype):
    """transformers' loss, logits and gradients: the token losses' mean over every micro-batch plus
    the mean of each micro-batch's load-balancing loss times its coefficient (as fourfold, and
    transformers under gradient accumulation, add them up)."""
    # every parameter non-trivial; routers decisive (no near ties)
    config, model = saved_random_model(dict(MODELS[name], num_hidden_layers=layers), path,
                                       lambda n: 1.0 if n.endswith("gate.weight") else 0.05,
                                       experts_implementation="eager")
    loss, logits = 0.0, []
    for ids in microbatches:
        with pytest.MonkeyPatch.context() as patch:
            for module in (modeling_mixtral, modeling_qwen2_moe):
                patch.setattr(module, "load_balancing_loss_func", load_balancing_in_input_dtype)
            patch.setattr(modeling_mixtral.MixtralRMSNorm, "forward", rms_norm_in_input_dtype)
            patch.setattr(modeling_qwen2_moe.Qwen2MoeRMSNorm, "forward", rms_norm_in_input_dtype)
            patch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", router)
            patch.setattr(modeling_qwen2_moe.Qwen2MoeTopKRouter, "forward", router)
            out = model(input_ids=ids[:, :-1])
        # the float64 copy is transformers' formula: its own (float32) gives the same to float32 rounding
        module = modeling_mixtral if "mixtral" in name else modeling_qwen2_moe
        own = module.load_balancing_loss_func(out.router_logits, _experts(config),
                                              config.num_experts_per_tok)
        assert abs(own.item() - out.aux_loss.item()) < 1e-6 * out.aux_loss.item()
        loss = loss + F.cross_entropy(out.logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum") / (
            IDS[:, 1:].numel()) + config.router_aux_loss_coef * out.aux_loss / len(microbatches)
        logits.append(out.logits.detach())
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), logits=torch.cat(logits),
                           grads=saved_gradients(model, path))


def _global_microbatches(dp, microbatches):
    """Micro-batch m of the step: the m-th of each data-parallel rank's share of IDS."""
    shares = [share.chunk(microbatches) for share in IDS.chunk(dp)]
    return [torch.cat([share[m] for share in shares]) for m in range(microbatches)]


def _experts(config):
    return getattr(config, "num_local_experts", None) or config.num_experts


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {name: _reference(name, tmp_path_factory.mktemp(name)) for name in MODELS}


@pytest.mark.parametrize("grid", GRIDS)
def test_mixtures_equal_transformers(ranks, references, grid):
    sizes, seq_parallel, recompute = GRIDS[grid]
    layout = Layout(**sizes)
    paths = {name: ref.path for name, ref in references.items()}
    results = ranks.run(run_moe, layout.world_size, paths, IDS, sizes, seq_parallel, recompute)
    errors = {}
    for name, ref in references.items():
        grads = {}
        for c, out in results:
            loss, logits, rank_grads, _ = out[name]
            errors.setdefault((name, "loss"), []).append(abs(loss - ref.loss) / ref.loss)
            grads.update(rank_grads or {})
            if logits is not None:
                expected = cp_shard(ref.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]], layout.cp, c["cp"])
                errors.setdefault((name, "logits"), []).append(relative_error(logits, expected))
        if name == "mixtral-16-top1" and layout.world_size > 1:
            assert any(0 in routed for _, out in results for routed in out[name][3])
        hf_grads = to_hf_tensors(ModelConfig.from_hf(MODELS[name]), grads)
        assert hf_grads.keys() == ref.grads.keys()
        for param, g in ref.grads.items():
            errors[(name, param)] = [relative_error(hf_grads[param], g)]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}  # NaN fails too
    assert not bad, (grid, bad)


def _capacity_router(groups, factor):
    """transformers' router (in the input's dtype) with an expert capacity in each of `groups`
    blocks of rows (a rank's tokens): each expert keeps its ceil(factor * top_k * rows / experts)
    most heavily weighted choices, ties by token order; a dropped choice's weight is zeroed (its
    expert's output then adds nothing, and no gradient reaches it)."""

    def forward(self, hidden_states):
        logits, values, indices = router_in_input_dtype(self, hidden_states)
        experts, kept = logits.shape[-1], torch.zeros_like(indices, dtype=torch.bool)
        for block in torch.arange(len(indices)).chunk(groups):
            capacity = math.ceil(factor * len(block) * indices.shape[1] / experts)
            for e in range(experts):
                choices = [(-values[t, j].item(), t.item(), j) for t in block for j in range(indices.shape[1])
                           if indices[t, j] == e]
                for _, t, j in sorted(choices)[:capacity]:
                    kept[t, j] = True
        return logits, values * kept, indices

    return forward


CAPACITY_GRIDS = {"serial": dict(), "dp2x2-ep2": dict(dp=2, x=2, ep=2), "dp2z2y2-ep2-sp": dict(dp=2, z=2, y=2, ep=2)}


@pytest.mark.parametrize("grid", CAPACITY_GRIDS)
def test_an_expert_capacity_drops_the_lightest_choices_on_every_grid(ranks, tmp_path_factory, grid):
    """With model.capacity_factor 0.5 each expert takes at most half its balanced share of a rank's
    choices, the heaviest: equal to transformers with the dropped choices' weights zeroed, over each
    rank's tokens (loss, logits, every gradient), and fewer tokens reach the experts than dropless."""
    sizes = CAPACITY_GRIDS[grid]
    layout = Layout(**sizes)
    names = ["mixtral", "qwen2_moe"]
    groups = layout.dp * layout.z
    refs = {name: _reference(name, tmp_path_factory.mktemp(name), router=_capacity_router(groups, 0.5))
            for name in names}
    results = ranks.run(run_moe, layout.world_size, {n: r.path for n, r in refs.items()}, IDS, sizes,
                        "y" in sizes, "none", 0.5)
    for name, ref in refs.items():
        grads, errors = {}, [abs(out[name][0] - ref.loss) / ref.loss for _, out in results]
        for c, out in results:
            grads.update(out[name][2] or {})
            if out[name][1] is not None:
                expected = ref.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
                errors.append(relative_error(out[name][1], expected))
        hf_grads = to_hf_tensors(ModelConfig.from_hf(MODELS[name]), grads)
        errors += [relative_error(hf_grads[param], g) for param, g in ref.grads.items()]
        assert all(e < 1e-10 for e in errors), (name, max(errors))
        # a rank's experts took at most capacity rows from each rank of their expert group, in all E * capacity
        experts, top_k = 4, MODELS[name]["num_experts_per_tok"]
        capacity = math.ceil(0.5 * top_k * BATCH * SEQ // groups / experts)
        routed = [sum(layer) for _, out in results for layer in out[name][3]]
        assert max(routed) <= experts * capacity < top_k * BATCH * SEQ // groups, routed


PIPELINES = {  # name: (sizes, micro-batches, schedule, virtual stages, layers)
    "pp2dp2x2-ep2-1f1b": (dict(pp=2, dp=2, x=2, ep=2), 2, "1f1b", 1, 2),
    "pp2cp2y2-gpipe": (dict(pp=2, cp=2, y=2), 2, "gpipe", 1, 2),
    "pp2dp2z2-ep2-interleaved": (dict(pp=2, dp=2, z=2, ep=2), 2, "interleaved-1f1b", 2, 4),
}


@pytest.mark.parametrize("grid", PIPELINES)
def test_mixtures_through_pipeline_stages_equal_transformers(ranks, tmp_path_factory, grid):
    """Through pipeline stages, each micro-batch's load-balancing loss spans the stages (its sums
    travel with the stream): loss and every gradient equal transformers' on the same micro-batches."""
    sizes, microbatches, schedule, virtual, layers = PIPELINES[grid]
    layout = Layout(**sizes)
    names = ["mixtral", "qwen2_moe"]
    batches = _global_microbatches(layout.dp * layout.z, microbatches)  # (z splits a dp rank's share)
    refs = {name: _reference(name, tmp_path_factory.mktemp(name), batches, layers) for name in names}
    results = ranks.run(run_moe_pipeline, layout.world_size, {n: r.path for n, r in refs.items()}, IDS, sizes,
                        microbatches, schedule, virtual)
    errors = {}
    for name, ref in refs.items():
        grads = {}
        for _, out in results:
            loss, _, rank_grads, _ = out[name]
            errors.setdefault((name, "loss"), []).append(abs(loss - ref.loss) / ref.loss)
            grads.update(rank_grads or {})
        hf_grads = to_hf_tensors(ModelConfig.from_hf(dict(MODELS[name], num_hidden_layers=layers)), grads)
        assert hf_grads.keys() == ref.grads.keys()
        for param, g in ref.grads.items():
            errors[(name, param)] = [relative_error(hf_grads[param], g)]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}
    assert not bad, (grid, bad)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_import_checkpoint_export_gives_transformers_the_same_weights(ranks, references, tmp_path, name):
    from moe_on_grids import assert_export_round_trip

    assert_export_round_trip(ranks, references[name].path, tmp_path)


def test_counts_are_transformers(references):
    for name, fields in MODELS.items():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields))
        cfg = ModelConfig.from_hf(fields)
        assert cfg.parameter_count() == sum(p.numel() for p in model.parameters())
        per_expert = 3 * cfg.hidden * cfg.ffn * cfg.layers
        assert parameter_count(cfg) - parameter_count(cfg, active=True) == (cfg.experts - cfg.top_k) * per_expert


@pytest.fixture(scope="module")
def mixtral_run(ranks, tmp_path_factory):
    """A small Mixtral saved by transformers (with its load-balancing loss), its tokenizer and a
    corpus, trained by `fourfold train --model.hf` for 50 steps on dp4 with expert parallelism ep4
    (each rank one expert of four) in float64, checkpoints at steps 25 and 50."""
    folder = tmp_path_factory.mktemp("mixtral-run")
    text = folder / "genesis.txt"
    text.write_text(corpus.bundled_text()[:60_000])
    tokenizer, tokens = corpus.prepare(str(text), 512, str(folder / "cache"))
    hf = folder / "mixtral"
    config = transformers.AutoConfig.for_model(**dict(MODELS["mixtral"], vocab_size=512))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    shutil.copy(tokenizer, hf / "tokenizer.json")
    options = ["--model.hf", str(hf), "--data.tokens", str(tokens), "--data.tokenizer", str(hf / "tokenizer.json"),
               "--log.progress", "false", "--log.every", "1", "--train.steps", "50", "--batch.global_batch", "8",
               "--batch.micro_batch", "2", "--batch.seq", "32", "--optimizer.lr", "0.01", "--optimizer.warmup", "2",
               "--checkpoint.every", "25", "--train.precision", "float64"]
    run = SimpleNamespace(folder=folder, options=options,
                          train_here=lambda *extra: ranks.run(train_run, 4, [*options, *extra]))  # the rank pool's
    run.train_here("--grid.dp", "4", "--grid.ep", "4", "--log.run_dir", str(folder / "ep4"))
    return run


def test_expert_parallel_training_learns_and_resumes_bitwise(mixtral_run, tmp_path):
    """50 steps on dp4 ep4: the loss falls. The same run resumed from its step-25 checkpoint gives
    every later step's loss bit for bit. (A killed rank restarted by torchrun resumes the same way:
    tests/train/test_trainer.py kills one.)"""
    expected = step_losses(mixtral_run.folder / "ep4")
    assert list(expected) == list(range(50)) and all(math.isfinite(x) for x in expected.values())
    assert sum(list(expected.values())[-5:]) / 5 < expected[0] - 0.8, expected
    start = mixtral_run.folder / "ep4" / "checkpoints" / "step-00000025"
    mixtral_run.train_here("--grid.dp", "4", "--grid.ep", "4", "--log.run_dir", str(tmp_path), "--checkpoint.load",
                           str(start))
    assert step_losses(tmp_path) == {s: expected[s] for s in range(25, 50)}


# (dp2 with micro-batches of 4: the load-balancing loss is a micro-batch's, so its tokens stay the same)
@pytest.mark.parametrize("grid", [["--grid.dp", "2", "--grid.x", "2", "--grid.ep", "2", "--batch.micro_batch", "4"],
                                  ["--grid.dp", "4", "--grid.ep", "2"], ["--grid.dp", "4"]],
                         ids=["dp2x2-ep2", "dp4-ep2", "dp4-ep1"])
def test_an_expert_parallel_checkpoint_continues_on_another_ep(mixtral_run, grid, tmp_path):
    """The step-25 checkpoint of dp4 ep4 continues on ep2 with x2, on ep2 with two replicas of each
    expert (their gradients reduced and their optimizer state sharded over both), and without expert
    parallelism, with the same losses over 25 steps (float64: in float32 the sums' order sets the
    runs apart by 4e-5 in three steps); the step-50 checkpoint holds every tensor of the ep4 run's,
    model and optimizer state, with the same values."""

    start = mixtral_run.folder / "ep4" / "checkpoints" / "step-00000025"
    mixtral_run.train_here(*grid, "--log.run_dir", str(tmp_path), "--checkpoint.load", str(start))
    expected = step_losses(mixtral_run.folder / "ep4")
    got = step_losses(tmp_path)
    assert list(got) == list(range(25, 50))
    assert got == pytest.approx({s: expected[s] for s in got}, rel=1e-9)
    mine, theirs = (whole_checkpoint(run / "checkpoints" / "step-00000050")
                    for run in (tmp_path, mixtral_run.folder / "ep4"))
    assert mine.keys() == theirs.keys() and any(k.startswith("optim/m/") and ".experts." in k for k in mine)
    assert all(torch.allclose(mine[k], theirs[k], rtol=1e-7, atol=1e-9) for k in mine)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
def test_an_expert_parallel_checkpoint_exports_to_transformers(mixtral_run, tmp_path):
    """The step-50 checkpoint of dp4 ep4, exported, loads in transformers with every expert's weights
    equal to the checkpoint's serial tensors."""
    from fourfold.checkpoint.export import export

    step = mixtral_run.folder / "ep4" / "checkpoints" / "step-00000050"
    export(step, tmp_path / "hf")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    cfg = ModelConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    saved = {name.removeprefix("model/"): t for name, t in whole_checkpoint(step).items() if name.startswith("model/")}
    ours = to_hf_tensors(cfg, saved)
    written = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert sum(".experts.3." in key for key in ours) == 6 and ours.keys() == written.keys()  # 3 per layer
    for key, value in ours.items():
        assert torch.equal(written[key], value), key


@pytest.mark.parametrize("config, fields", [(transformers.MixtralConfig, mixtral.FIELDS),
                                            (transformers.Qwen2MoeConfig, qwen2_moe.FIELDS)])
def test_every_field_of_the_config_classes_is_read_or_refused(config, fields):
    defaults = json.loads(config().to_json_string())
    assert sorted(set(defaults) - fields - METADATA) == []
    assert ModelConfig.from_hf(defaults).to_hf()["model_type"] == defaults["model_type"]


@pytest.mark.parametrize("change, message", [
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    (dict(model_type="qwen2_moe", decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(model_type="qwen2_moe", mlp_only_layers=[1]), "mlp_only_layers=\\[1\\]"),
])
def test_unimplemented_mixtures_are_refused_by_name(change, message):
    base = MODELS["qwen2_moe"] if change.get("model_type") == "qwen2_moe" else MODELS["mixtral"]
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**base, **change})


def test_rules_refuse_a_shared_expert_y_does_not_divide():
    cfg = ModelConfig.from_hf(dict(MODELS["qwen2_moe"], shared_expert_intermediate_size=20))
    assert problems(cfg, Job(Layout(x=2, y=2), seq=16)) == []
    assert problems(cfg, Job(Layout(pp=2, y=2), seq=16, global_batch=2)) == []
    found = [str(p) for p in problems(cfg, Job(Layout(pp=2, y=8), seq=16))]
    assert any("y=8 must divide the shared expert's ffn=20; choose y from 1, 2, 4, 5" in p for p in found), found


def test_expert_parallel_grids_that_cannot_work_are_refused_with_the_fix():
    cfg = ModelConfig.from_hf(MODELS["mixtral"])  # 4 experts
    assert problems(cfg, Job(Layout(dp=4, x=2, ep=4), seq=16)) == []
    found = [str(p) for p in problems(cfg, Job(Layout(dp=8, ep=8), seq=16))]
    assert any("ep=8 must divide the experts (4)" in p and "choose ep from 1, 2, 4" in p for p in found), found
    dense = ModelConfig.from_hf({k: v for k, v in MODELS["mixtral"].items() if k not in (
        "num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef")} | {
        "model_type": "llama"})
    found = [str(p) for p in problems(dense, Job(Layout(dp=2, ep=2), seq=16))]
    assert any("ep=2 splits a mixture's experts, and this model has none" in p for p in found), found
    with pytest.raises(ValueError, match="ep=3 must divide dp\\*cp=4 .*choose ep from 1, 2, 4"):
        Layout(dp=2, cp=2, ep=3)
    assert str(Layout(dp=4, ep=2)).startswith("dp=4,ep=2") and Layout.parse("dp=4,ep=2") == Layout(dp=4, ep=2)


def test_a_negative_capacity_factor_is_refused_by_name():
    from fourfold.config import ConfigError, load_train_config, validate

    with pytest.raises(ConfigError, match="model.capacity_factor=-1.0 must be a number >= 0"):
        validate(load_train_config(None, ["--model.capacity_factor", "-1"]), 1)


def test_eval_takes_the_capacity_factor_and_refuses_a_negative_one(mixtral_run, capsys):
    from fourfold.cli.main import main

    step = mixtral_run.folder / "ep4" / "checkpoints" / "step-00000025"
    tokens = next((mixtral_run.folder / "cache").glob("*/tokens.npy"))
    code = main(["eval", "--checkpoint", str(step), "--tokens", str(tokens), "--seq", "32", "--grid", "dp=4,ep=4",
                 "--capacity-factor", "-1"])
    assert code == 2 and "--capacity-factor -1.0 must be a number >= 0 (0: dropless)" in capsys.readouterr().err
