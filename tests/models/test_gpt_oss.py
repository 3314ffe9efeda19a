"""GPT-OSS equal to transformers in float64: loss (the load-balancing loss included), logits and every
gradient (the sinks', the router's and its bias', the experts' biases) on one rank, on the 3D grid
with sequence parallelism, with context parallelism (a window of 3, longer than a cp4 chunk: the
blocks it reaches fetched), with
expert parallelism, and through pipeline stages; its alternating sliding and full layers; import ->
checkpoint -> export gives transformers the same weights (the stacked, interleaved experts); every
field of GptOssConfig is read or refused by name."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss

from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.models import gpt_oss
from fourfold.models.config import METADATA, ModelConfig
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import problems
from hf_training import fourfold_steps, relative, transformers_steps
from moe_on_grids import run_moe, run_moe_pipeline
from runs import assert_exports_the_checkpoint, hub_model_run, step_losses, train_run
from serial_reference import (
    cp_shard,
    load_balancing_in_input_dtype,
    relative_error,
    rms_norm_in_input_dtype,
    saved_gradients,
    saved_random_model,
)

BATCH, SEQ, VOCAB = 8, 16, 128
# 4 heads of 16 features over hidden 32, 2 kv heads; 4 experts of 24 features, 2 a token; a window of 3
# on the sliding layers; YaRN as the published models (scaled from 16 pretraining positions).
GPT_OSS = dict(model_type="gpt_oss", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=24, vocab_size=VOCAB, max_position_embeddings=64,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=3, output_router_logits=True,
               router_aux_loss_coef=0.02,
               rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                    original_max_position_embeddings=16, rope_theta=150000.0))
GRIDS = {  # name: (sizes, sequence parallel)
    "serial": (dict(), False),
    "x2y2z2-sp": (dict(x=2, y=2, z=2), True),
    # a window of 3, longer than a cp4 chunk (2 tokens); shorter ones: Gemma 3's and Mistral's tests
    "cp4x2": (dict(cp=4, x=2), False),
    "dp4x2-ep4": (dict(dp=4, x=2, ep=4), False),
}
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _router_in_input_dtype(self, hidden_states):
    # GptOssTopKRouter: top-k of the logits, their softmax (fourfold: the renormalised softmax of all)
    logits = F.linear(hidden_states, self.weight, self.bias)
    top, chosen = torch.topk(logits, self.top_k, dim=-1)
    return logits, torch.softmax(top, dim=1), chosen


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A saved random model (routers decisive) and transformers' loss, logits and gradients."""
    path = tmp_path_factory.mktemp("gpt_oss")
    config, model = saved_random_model(GPT_OSS, path, lambda n: 1.0 if "router" in n or "sinks" in n else 0.05,
                                       experts_implementation="eager", attn_implementation="eager")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_gpt_oss.GptOssRMSNorm, "forward", rms_norm_in_input_dtype)
        patch.setattr(modeling_gpt_oss.GptOssTopKRouter, "forward", _router_in_input_dtype)
        patch.setattr(modeling_gpt_oss, "load_balancing_loss_func", load_balancing_in_input_dtype)
        out = model(input_ids=IDS[:, :-1], output_router_logits=True)
    loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1)) + config.router_aux_loss_coef * \
        out.aux_loss
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), logits=out.logits.detach(),
                           grads=saved_gradients(model, path))


@pytest.mark.parametrize("grid", GRIDS)
def test_gpt_oss_equals_transformers(ranks, reference, grid):
    sizes, seq_parallel = GRIDS[grid]
    layout = Layout(**sizes)
    errors, grads = {}, {}
    for c, out in ranks.run(run_moe, layout.world_size, {"gpt_oss": reference.path}, IDS, sizes, seq_parallel,
                            "none"):
        loss, logits, rank_grads, _ = out["gpt_oss"]
        errors.setdefault("loss", []).append(abs(loss - reference.loss) / reference.loss)
        grads.update(rank_grads or {})
        if logits is not None:
            expected = cp_shard(reference.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]], layout.cp, c["cp"])
            errors.setdefault("logits", []).append(relative_error(logits, expected))
    hf_grads = to_hf_tensors(ModelConfig.from_hf(GPT_OSS), grads)
    assert hf_grads.keys() == reference.grads.keys()
    for param, g in reference.grads.items():
        errors[param] = [relative_error(hf_grads[param], g)]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}  # NaN fails too
    assert not bad, (grid, bad)


def test_through_pipeline_stages(ranks, reference):
    """pp2 dp2 x2, one micro-batch a step (so that its load-balancing loss is the batch's)."""
    results = ranks.run(run_moe_pipeline, 8, {"gpt_oss": reference.path}, IDS, dict(pp=2, dp=2, x=2), 1, "gpipe")
    errors, grads = {}, {}
    for _, out in results:
        loss, _, rank_grads, _ = out["gpt_oss"]
        errors.setdefault("loss", []).append(abs(loss - reference.loss) / reference.loss)
        grads.update(rank_grads or {})
    hf_grads = to_hf_tensors(ModelConfig.from_hf(GPT_OSS), grads)
    assert hf_grads.keys() == reference.grads.keys()
    for param, g in reference.grads.items():
        errors[param] = [relative_error(hf_grads[param], g)]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}
    assert not bad, bad


def test_training_on_expert_parallelism_with_x_equals_transformers(ranks, tmp_path):
    """The trial's `--grid.dp 4 --grid.ep 4 --grid.x 2` (8 ranks), which crashed in the first backward:
    three clipped AdamW steps through the trainer's Model, GradientSync and AdamW give transformers'
    losses, gradient norms and weights (the experts' biases, summed over x, then their replicas)."""
    config, model = saved_random_model(dict(GPT_OSS, output_router_logits=False), tmp_path,
                                       lambda n: 1.0 if "router" in n or "sinks" in n else 0.05,
                                       experts_implementation="eager", attn_implementation="eager")
    ids = IDS.numpy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_gpt_oss.GptOssRMSNorm, "forward", rms_norm_in_input_dtype)
        patch.setattr(modeling_gpt_oss.GptOssTopKRouter, "forward", _router_in_input_dtype)
        losses, norms, weights = transformers_steps(model.train(), ids, 3)
    got_losses, got_norms, got = ranks.run(fourfold_steps, 8, str(tmp_path), ids, dict(dp=4, x=2, ep=4), False, 3,
                                           1)[0]
    assert got_losses == pytest.approx(losses, rel=1e-10) and got_norms == pytest.approx(norms, rel=1e-10)
    bad = {name: relative(t, weights[name]) for name, t in got.items() if not relative(t, weights[name]) < 1e-10}
    assert not bad, bad


def test_the_layers_alternate():
    cfg = ModelConfig.from_hf(GPT_OSS)
    assert [cfg.layer_block(i).window for i in range(2)] == [3, 0]
    block = cfg.layer_block(0)
    assert block.sinks and block.router_bias and block.mlp_bias and block.activation == "swiglu_clamped"
    assert cfg.rope_scaling.kind == "yarn" and not cfg.rope_scaling.truncate


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
def test_import_checkpoint_export_gives_transformers_the_same_weights(ranks, reference, tmp_path):
    from moe_on_grids import assert_export_round_trip

    assert_export_round_trip(ranks, reference.path, tmp_path)


def test_counts_are_transformers():
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**GPT_OSS))
    assert ModelConfig.from_hf(GPT_OSS).parameter_count() == sum(p.numel() for p in model.parameters())


def test_every_field_of_the_config_class_is_read_or_refused():
    defaults = json.loads(transformers.GptOssConfig().to_json_string())
    assert sorted(set(defaults) - gpt_oss.FIELDS - METADATA) == []
    cfg = ModelConfig.from_hf(defaults)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    back, published = (transformers.AutoConfig.for_model(**d).to_dict() for d in (cfg.to_hf(), defaults))
    for d in (back, published):
        del d["architectures"]
    # YaRN's attention factor written out as resolved: transformers' own default for factor 32
    assert back["rope_parameters"].pop("attention_factor") == pytest.approx(0.1 * math.log(32) + 1)
    assert back == published  # transformers reads the export as the same model


def test_expert_biases_with_expert_parallelism_and_tensor_dims_are_accepted():
    """Their gradients are summed over the tensor dims, then the replicas (test_data_parallel's biased mixture)."""
    cfg = ModelConfig.from_hf(GPT_OSS)
    assert problems(cfg, Job(Layout(dp=4, x=2, ep=4), seq=16)) == []
    assert problems(cfg, Job(Layout(dp=4, z=2, ep=4), micro_batch=2, global_batch=8, seq=16)) == []


@pytest.mark.parametrize("change, message", [
    (dict(swiglu_limit=5.0), "swiglu_limit=5.0"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(quantization_config={"quant_method": "mxfp4"}), "Mxfp4Config\\(dequantize=True\\)"),
])
def test_unimplemented_settings_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**GPT_OSS, **change})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
def test_training_learns_resumes_bitwise_and_exports(ranks, tmp_path):
    """A tiny GPT-OSS saved by transformers, trained by `fourfold train --model.hf` for 20 steps on dp4
    with expert parallelism ep4 (float64): the loss falls; resumed from its step-10 checkpoint it gives
    every later step's loss bit for bit; the step-20 checkpoint exported loads in transformers with no
    missing or unexpected tensor and the checkpoint's values."""
    options = hub_model_run(tmp_path, dict(GPT_OSS, output_router_logits=False), "--grid.dp", "4", "--grid.ep", "4")
    ranks.run(train_run, 4, [*options, "--log.run_dir", str(tmp_path / "run")])
    losses = step_losses(tmp_path / "run")
    assert list(losses) == list(range(20)) and sum(list(losses.values())[-3:]) / 3 < losses[0] - 0.5, losses
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    ranks.run(train_run, 4, [*options, "--log.run_dir", str(tmp_path / "again"), "--checkpoint.load", str(step)])
    assert step_losses(tmp_path / "again") == {s: losses[s] for s in range(10, 20)}
    assert_exports_the_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000020", tmp_path / "hf")
