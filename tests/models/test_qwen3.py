"""Qwen3 (per-head q/k norms, an explicit head_dim, attention biases) and Qwen3-MoE (its attention
with a mixture of experts, no shared expert) equal to transformers in float64: loss, logits and
every gradient (the q/k norms' and the routers' included) on one rank, on the published attention
path with sequence parallelism, on the non-redundant path with context and sequence parallelism,
with expert parallelism and (Qwen3) through pipeline stages; import -> checkpoint -> export gives
transformers the same weights; every field of the config classes is read or refused by name."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from families_on_grids import run_families
from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.models import qwen3, qwen3_moe
from fourfold.models.config import METADATA, ModelConfig
from fourfold.spec.blockspec import block_plan
from fourfold.spec.layout import Layout
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

# 8 heads of 8 features over hidden 32 (heads * head_dim 64 != hidden); kv heads 2, so x*y = 4 puts
# attention on the published path (heads over y, replicated over x) and x*y = 2 on the non-redundant one
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
              vocab_size=128, tie_word_embeddings=False, max_position_embeddings=64, rope_theta=1e6)
DENSE = {"qwen3": dict(COMMON, model_type="qwen3", intermediate_size=48, attention_bias=True)}
MIXTURES = {"qwen3_moe": dict(COMMON, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, norm_topk_prob=True, output_router_logits=True,
                              router_aux_loss_coef=0.02)}
MODELS = DENSE | MIXTURES
GRIDS = {  # name: (sizes, sequence parallel)
    "serial": (dict(), False),
    "x2y2z2-sp": (dict(x=2, y=2, z=2), True),  # published path: the norms' gradients summed over y and z
    "dp2cp2y2-sp": (dict(dp=2, cp=2, y=2), True),  # non-redundant path, ring attention
    "dp4x2-ep4": (dict(dp=4, x=2, ep=4), False),  # each rank one expert
    "pp2dp2x2-1f1b": (dict(pp=2, dp=2, x=2), False),  # Qwen3 only: stages built on the meta device, 2 micro-batches
}
BATCH, SEQ, VOCAB = 8, 16, 128
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _reference(name, path):
    """A saved random model (routers decisive) and transformers' loss (the mean token loss plus the
    load-balancing loss times its coefficient), logits and gradients in the checkpoint's layout."""
    config, model = saved_random_model(MODELS[name], path, lambda n: 1.0 if n.endswith("gate.weight") else 0.05,
                                       **({"experts_implementation": "eager"} if name in MIXTURES else {}))
    with pytest.MonkeyPatch.context() as patch:  # transformers' float32 steps, in the input's dtype
        patch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_input_dtype)
        patch.setattr(modeling_qwen3_moe.Qwen3MoeRMSNorm, "forward", rms_norm_in_input_dtype)
        patch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", router_in_input_dtype)
        patch.setattr(modeling_qwen3_moe, "load_balancing_loss_func", load_balancing_in_input_dtype)
        out = model(input_ids=IDS[:, :-1])
    loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
    if name in MIXTURES:
        loss = loss + config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), logits=out.logits.detach(),
                           grads=saved_gradients(model, path))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {name: _reference(name, tmp_path_factory.mktemp(name)) for name in MODELS}


@pytest.mark.parametrize("grid", GRIDS)
def test_qwen3_and_qwen3_moe_equal_transformers(ranks, references, grid):
    sizes, seq_parallel = GRIDS[grid]
    layout = Layout(**sizes)
    dense = {k: v for k, v in sizes.items() if k != "ep"}
    results = {}
    for c, out in ranks.run(run_families, layout.world_size, {n: references[n].path for n in DENSE}, IDS, dense,
                            seq_parallel, 2):
        results.setdefault(tuple(c.items()), {}).update({n: out[n] for n in DENSE})
    names = list(DENSE)
    if layout.pp == 1:
        names += list(MIXTURES)
        for c, out in ranks.run(run_moe, layout.world_size, {n: references[n].path for n in MIXTURES}, IDS, sizes,
                                seq_parallel, "none"):
            results[tuple(c.items())].update({n: out[n][:3] for n in MIXTURES})
    errors = {}
    for name in names:
        ref = references[name]
        grads = {}
        for c, out in results.items():
            c = dict(c)
            loss, logits, rank_grads = out[name]
            errors.setdefault((name, "loss"), []).append(abs(loss - ref.loss) / ref.loss)
            grads.update(rank_grads or {})
            if logits is not None:
                expected = cp_shard(ref.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]], layout.cp, c["cp"])
                errors.setdefault((name, "logits"), []).append(relative_error(logits, expected))
        hf_grads = to_hf_tensors(ModelConfig.from_hf(MODELS[name]), grads)
        assert hf_grads.keys() == ref.grads.keys()
        assert sum(".q_norm." in key or ".k_norm." in key for key in hf_grads) == 4
        for param, g in ref.grads.items():
            errors[(name, param)] = [relative_error(hf_grads[param], g)]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}  # NaN fails too
    assert not bad, (grid, bad)


def test_the_grids_take_both_attention_paths():
    block = ModelConfig.from_hf(MODELS["qwen3"]).block
    assert block.qk_norm and block.head_dim == 8
    assert block_plan(block, 2, 2, seq_parallel=True).attention_chunks == 2  # published: y
    assert block_plan(block, 1, 2, seq_parallel=True).attention_chunks == 2  # non-redundant: x*y
    assert block_plan(block, 2, 1, seq_parallel=False).attention_chunks == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
@pytest.mark.parametrize("name", MODELS)
def test_import_checkpoint_export_gives_transformers_the_same_weights(ranks, references, tmp_path, name):
    from moe_on_grids import assert_export_round_trip

    assert_export_round_trip(ranks, references[name].path, tmp_path)


def test_counts_are_transformers():
    for fields in MODELS.values():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields))
        assert ModelConfig.from_hf(fields).parameter_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config, fields", [(transformers.Qwen3Config, qwen3.FIELDS),
                                            (transformers.Qwen3MoeConfig, qwen3_moe.FIELDS)])
def test_every_field_of_the_config_classes_is_read_or_refused(config, fields):
    defaults = json.loads(config().to_json_string())
    assert sorted(set(defaults) - fields - METADATA) == []
    cfg = ModelConfig.from_hf(defaults)
    assert cfg.to_hf()["model_type"] == defaults["model_type"] and ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("name", MODELS)
def test_a_missing_head_dim_is_the_one_transformers_uses(name):
    d = {k: v for k, v in MODELS[name].items() if k != "head_dim"}  # Qwen3Config's 128; Qwen3-MoE: hidden / heads
    expected = getattr(transformers.AutoConfig.for_model(**d), "head_dim", d["hidden_size"] // d["num_attention_heads"])
    assert ModelConfig.from_hf(d).block.head_dim == expected


@pytest.mark.parametrize("change, message", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers=\\[1\\]"),
    (dict(num_local_experts=8), "num_experts=4 and num_local_experts=8"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(use_sliding_window=True), "sliding-window layers"),  # (Qwen3-MoE's only: Qwen3's are read)
])
def test_unimplemented_settings_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**MIXTURES["qwen3_moe"], **change})
    if not any(word in message for word in ("experts", "sparse", "mlp_only", "sliding")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf({**DENSE["qwen3"], **change})
