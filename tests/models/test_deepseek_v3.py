"""DeepSeek-V3 equal to transformers in float64: loss, logits and every gradient (the latent attention's
projections and norms, the router's, the shared expert's) on one rank, on the 3D grid with sequence
parallelism (latents replicated, heads split), with context parallelism (V padded on the ring),
with expert parallelism and through pipeline stages; its first dense layer, group-limited sigmoid
routing with a balancing bias, routed scaling and YaRN's softmax scale; every field of
DeepseekV3Config is read or refused by name."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3

from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.models import deepseek_v3
from fourfold.models.config import METADATA, ModelConfig
from fourfold.spec.layout import Layout
from moe_on_grids import run_moe, run_moe_pipeline
from runs import assert_exports_the_checkpoint, hub_model_run, step_losses, train_run, whole_checkpoint
from serial_reference import cp_shard, relative_error, rms_norm_in_input_dtype, saved_gradients, saved_random_model

BATCH, SEQ, VOCAB = 8, 16, 128
# 4 heads over hidden 32: q latent 24, kv latent 16, per head 8 features without RoPE and 8 with, values
# of 6 (not the queries' 16); layer 0 dense (ffn 48), layer 1 a mixture of 8 experts (ffn 16) in 4 groups,
# the best 2 groups kept, top-2, scaled by 2.5, plus one shared expert; YaRN with DeepSeek's mscales.
DEEPSEEK = dict(model_type="deepseek_v3", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=6, vocab_size=VOCAB, max_position_embeddings=64,
                rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                                     mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0, rope_theta=10000.0))
GRIDS = {  # name: (sizes, sequence parallel)
    "serial": (dict(), False),
    "x2y2z2-sp": (dict(x=2, y=2, z=2), True),
    "dp2cp2y2-sp": (dict(dp=2, cp=2, y=2), True),
    "dp4x2-ep4": (dict(dp=4, x=2, ep=4), False),
}
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _router_in_input_dtype(self, hidden_states):
    # DeepseekV3TopkRouter computes in float32 whatever the input; the same arithmetic in the input's dtype
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    groups = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(groups).scatter_(1, best, 1).unsqueeze(-1).expand(
        -1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
    chosen = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, chosen


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A saved random model (routers decisive, a balancing bias that changes the choice) and
    transformers' loss, logits and gradients."""
    path = tmp_path_factory.mktemp("deepseek_v3")
    _, model = saved_random_model(DEEPSEEK, path, lambda n: 1.0 if n.endswith("gate.weight") else 0.05,
                                  experts_implementation="eager")
    with torch.no_grad():
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        bias.copy_(0.3 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(2)))
    model.save_pretrained(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", rms_norm_in_input_dtype)
        patch.setattr(modeling_deepseek_v3.DeepseekV3TopkRouter, "forward", _router_in_input_dtype)
        logits = model(input_ids=IDS[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), logits=logits.detach(), grads=saved_gradients(model, path))


def _check(results, reference, layout, grid):
    errors, grads = {}, {}
    for c, out in results:
        loss, logits, rank_grads, _ = out["deepseek_v3"]
        errors.setdefault("loss", []).append(abs(loss - reference.loss) / reference.loss)
        grads.update(rank_grads or {})
        if logits is not None:
            expected = cp_shard(reference.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]], layout.cp, c["cp"])
            errors.setdefault("logits", []).append(relative_error(logits, expected))
    hf_grads = to_hf_tensors(ModelConfig.from_hf(DEEPSEEK), grads)
    expected = {k for k in reference.grads if not k.endswith("e_score_correction_bias")}  # (a buffer)
    assert expected <= hf_grads.keys()
    for param in expected:
        errors[param] = [relative_error(hf_grads[param], reference.grads[param])]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}  # NaN fails too
    assert not bad, (grid, bad)


@pytest.mark.parametrize("grid", GRIDS)
def test_deepseek_v3_equals_transformers(ranks, reference, grid):
    sizes, seq_parallel = GRIDS[grid]
    layout = Layout(**sizes)
    results = ranks.run(run_moe, layout.world_size, {"deepseek_v3": reference.path}, IDS, sizes, seq_parallel, "none")
    _check(results, reference, layout, grid)


def test_through_pipeline_stages(ranks, reference):
    results = ranks.run(run_moe_pipeline, 8, {"deepseek_v3": reference.path}, IDS, dict(pp=2, dp=2, x=2), 2, "1f1b")
    _check(results, reference, Layout(pp=2, dp=2, x=2), "pp2dp2x2-1f1b")


def test_the_layers_take_their_kind():
    cfg = ModelConfig.from_hf(DEEPSEEK)
    dense, mixture = cfg.layer_block(0), cfg.layer_block(1)
    assert (dense.experts, dense.ffn, mixture.experts, mixture.ffn, mixture.shared_ffn) == (0, 48, 8, 16, 16)
    assert mixture.mla and mixture.head_dim == 16 and mixture.v_dim == 6 and mixture.routing == "sigmoid_grouped"
    scale = (0.1 * math.log(4.0) + 1) ** 2 / 16 ** 0.5  # mscale(factor 4, mscale_all_dim 1) squared
    assert mixture.scale == pytest.approx(scale, rel=1e-12)


def test_counts_are_transformers():
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**DEEPSEEK))
    assert ModelConfig.from_hf(DEEPSEEK).parameter_count() == sum(p.numel() for p in model.parameters())


def test_every_field_of_the_config_class_is_read_or_refused():
    defaults = json.loads(transformers.DeepseekV3Config().to_json_string())
    assert sorted(set(defaults) - deepseek_v3.FIELDS - METADATA) == []
    cfg = ModelConfig.from_hf(defaults)  # told once, in the training header, not warned by every process
    assert "1 multi-token prediction layer(s); fourfold trains the main model only" in deepseek_v3.notes(defaults)[0]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert round(cfg.parameter_count() / 1e9) == 671


@pytest.mark.parametrize("change, message", [
    (dict(q_lora_rank=None), "no q_lora_rank"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
])
def test_unimplemented_settings_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**DEEPSEEK, **change})


def _imbalance(run_dir) -> list[float]:
    """The mixture layer's max / mean tokens per expert, step by step, from a run's log."""
    records = map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
    return [r["experts"]["layer1"]["imbalance"] for r in records if "experts" in r]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
def test_training_balances_resumes_bitwise_and_exports(ranks, tmp_path):
    """A tiny DeepSeek-V3 saved by transformers, trained by `fourfold train --model.hf` for 20 steps on
    dp4 with expert parallelism ep4 (float64): the loss falls; resumed from its step-10 checkpoint
    (biases included) every later loss is bit for bit the same; the balancing biases move toward
    balance: the router, collapsed by step 10, is spread out again by step 20, where the same steps
    with the biases frozen leave it collapsed (the log's expert-load imbalance); exported,
    transformers loads the checkpoint's tensors, the biases among them."""
    options = hub_model_run(tmp_path, DEEPSEEK, "--grid.dp", "4", "--grid.ep", "4",
                            "--optimizer.balance_bias_speed", "0.01")
    ranks.run(train_run, 4, [*options, "--log.run_dir", str(tmp_path / "run")])
    losses = step_losses(tmp_path / "run")
    assert list(losses) == list(range(20)) and sum(list(losses.values())[-3:]) / 3 < losses[0] - 0.5, losses
    last = tmp_path / "run" / "checkpoints" / "step-00000020"
    bias = whole_checkpoint(last)["model/layers.1.mlp.router.balance_bias"]
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    ranks.run(train_run, 4, [*options, "--log.run_dir", str(tmp_path / "again"), "--checkpoint.load", str(step)])
    assert step_losses(tmp_path / "again") == {s: losses[s] for s in range(10, 20)}
    # the same 10 steps with the biases frozen at step 10's: the router stays collapsed
    ranks.run(train_run, 4, [*options, "--log.run_dir", str(tmp_path / "frozen"), "--checkpoint.load", str(step),
                             "--optimizer.balance_bias_speed", "0"])
    balanced, frozen = (_imbalance(tmp_path / run)[-3:] for run in ("run", "frozen"))
    assert sum(balanced) < sum(frozen) - 1.5 and bias.abs().max() > 0.1, (balanced, frozen, bias)
    assert_exports_the_checkpoint(last, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    loaded = model.model.layers[1].mlp.gate.e_score_correction_bias  # (transformers keeps it in float32)
    assert torch.equal(loaded, bias.to(loaded.dtype))
