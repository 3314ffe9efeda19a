"""OLMoE (q/k norms over all heads' features, a mixture of experts without a shared one) equal to
transformers in float64: loss (load-balancing loss included), logits and every gradient (the q/k norms'
and the routers' included) on one rank, on the published attention path (x ranks computing the same
heads) with sequence parallelism, on the non-redundant path with context parallelism and selective
recompute, with the statistics over y = 1 only (x4) and with expert parallelism; the norms' all-reduces in
the ledger as the volume functions count them; import -> checkpoint -> export gives transformers the same
weights; every field of OlmoeConfig is read or refused by name."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.olmoe import modeling_olmoe

from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.models import olmoe
from fourfold.models.config import METADATA, ModelConfig
from fourfold.spec.blockspec import block_plan
from fourfold.spec.layout import Layout
from fourfold.spec.volumes import block_passes
from moe_on_grids import run_moe
from serial_reference import (
    cp_shard,
    load_balancing_in_input_dtype,
    relative_error,
    rms_norm_in_input_dtype,
    router_in_input_dtype,
    saved_gradients,
    saved_random_model,
)

# 4 heads of 8 features, 2 kv heads: q_norm [32], k_norm [16]; x*y = 4 puts attention on the published
# path (heads over y, replicated over x), x*y = 2 on the non-redundant one
OLMOE = dict(model_type="olmoe", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=16, num_experts=4, num_experts_per_tok=2, attention_bias=True,
             output_router_logits=True, router_aux_loss_coef=0.02, vocab_size=128, tie_word_embeddings=False,
             max_position_embeddings=64, pad_token_id=None)
# (OlmoeConfig's default pad_token_id 1 would keep row 1 untrained in both, as tests/models/test_padding_row.py
# checks; None here, so that every row's gradient is compared)
GRIDS = {  # name: (sizes, sequence parallel, recompute)
    "serial": (dict(), False, "none"),
    "x2y2z2-sp": (dict(x=2, y=2, z=2), True, "none"),  # published: statistics over y, the x ranks the same heads
    "dp2cp2x2-selective": (dict(dp=2, cp=2, x=2), False, "selective"),  # non-redundant: over x*y, ring attention
    "x4": (dict(x=4), False, "none"),  # published on y = 1: every rank all heads, no statistics sent
    "dp4x2-ep4": (dict(dp=4, x=2, ep=4), False, "none"),
}
BATCH, SEQ, VOCAB = 8, 16, 128
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A saved random model (routers decisive) and transformers' loss (the mean token loss plus the
    load-balancing loss times its coefficient), logits and gradients in the checkpoint's layout."""
    path = tmp_path_factory.mktemp("olmoe")
    config, model = saved_random_model(OLMOE, path, lambda n: 1.0 if n.endswith("gate.weight") else 0.05,
                                       experts_implementation="eager")
    with pytest.MonkeyPatch.context() as patch:  # transformers' float32 steps, in the input's dtype
        patch.setattr(modeling_olmoe.OlmoeRMSNorm, "forward", rms_norm_in_input_dtype)
        patch.setattr(modeling_olmoe.OlmoeTopKRouter, "forward", router_in_input_dtype)
        patch.setattr(modeling_olmoe, "load_balancing_loss_func", load_balancing_in_input_dtype)
        out = model(input_ids=IDS[:, :-1])
    loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1)) + config.router_aux_loss_coef * (
        out.aux_loss)
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), logits=out.logits.detach(),
                           grads=saved_gradients(model, path))


@pytest.mark.parametrize("grid", GRIDS)
def test_olmoe_equals_transformers(ranks, reference, grid):
    sizes, seq_parallel, recompute = GRIDS[grid]
    layout = Layout(**sizes)
    results = ranks.run(run_moe, layout.world_size, {"olmoe": reference.path}, IDS, sizes, seq_parallel, recompute)
    errors, grads = {}, {}
    for c, out in results:
        loss, logits, rank_grads, _ = out["olmoe"]
        errors.setdefault("loss", []).append(abs(loss - reference.loss) / reference.loss)
        grads.update(rank_grads or {})
        if logits is not None:
            expected = cp_shard(reference.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]], layout.cp, c["cp"])
            errors.setdefault("logits", []).append(relative_error(logits, expected))
    hf_grads = to_hf_tensors(ModelConfig.from_hf(OLMOE), grads)
    assert hf_grads.keys() == reference.grads.keys()
    assert hf_grads["model.layers.1.self_attn.q_norm.weight"].shape == (32,)
    assert hf_grads["model.layers.1.self_attn.k_norm.weight"].shape == (16,)
    for param, g in reference.grads.items():
        errors[param] = [relative_error(hf_grads[param], g)]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}  # NaN fails too
    assert not bad, (grid, bad)


def test_the_norms_statistics_go_over_the_ranks_holding_the_other_heads():
    cfg = ModelConfig.from_hf(OLMOE)
    assert cfg.block.qk_norm_all_heads and not cfg.block.qk_norm
    assert block_plan(cfg.block, 2, 2, seq_parallel=True).head_group == "y"  # published: heads over y
    assert block_plan(cfg.block, 2, 1, seq_parallel=False).head_group == "x_y"  # non-redundant
    # q's and k's per-token sums, forward and backward: fp32 at least, as many as the attention's tokens
    sizes = dict(Layout(cp=2, x=2).sizes)
    stats = [c for c in block_passes(cfg.block, sizes, 2, 8, routed=(4,) * 4).all() if c.group == "x_y"]
    assert [(c.op, c.numel, c.wide) for c in stats] == [("all_reduce", 16, True)] * 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
def test_import_checkpoint_export_gives_transformers_the_same_weights(ranks, reference, tmp_path):
    from moe_on_grids import assert_export_round_trip

    assert_export_round_trip(ranks, reference.path, tmp_path)


def test_counts_are_transformers():
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**OLMOE))
    assert ModelConfig.from_hf(OLMOE).parameter_count() == sum(p.numel() for p in model.parameters())


def test_every_field_of_the_config_class_is_read_or_refused():
    defaults = json.loads(transformers.OlmoeConfig().to_json_string())
    assert sorted(set(defaults) - olmoe.FIELDS - METADATA) == []
    cfg = ModelConfig.from_hf(defaults)
    assert (cfg.experts, cfg.top_k, cfg.norm_topk, cfg.aux_loss_coef, cfg.eps) == (64, 8, False, 0.01, 1e-5)
    assert cfg.to_hf()["model_type"] == "olmoe" and ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("change, message", [
    (dict(clip_qkv=8.0), "clip_qkv=8.0"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(num_local_experts=8), "num_experts=4 and num_local_experts=8"),
    (dict(head_dim=16), "does not implement: head_dim"),
])
def test_unimplemented_settings_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**OLMOE, **change})
