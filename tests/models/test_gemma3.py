"""Gemma 3's text model equal to transformers in float64: loss, logits and every gradient (the four
norms a block, the q/k norms and the tied embedding's included) on one rank, on the 3D grid with
sequence parallelism, with context parallelism whose chunks are longer than the local layers'
window (cp2) and shorter (cp4), and through pipeline stages; its two kinds of layers each with their
window and RoPE; import -> checkpoint -> export gives transformers the same weights; every field
of Gemma3TextConfig is read or refused by name."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.gemma3 import modeling_gemma3

from families_on_grids import run_families
from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.models import gemma3
from fourfold.models.config import METADATA, ModelConfig
from fourfold.spec.layout import Layout
from serial_reference import cp_shard, relative_error, saved_gradients, saved_random_model

BATCH, SEQ, VOCAB = 8, 16, 128
# 4 heads of 16 features over hidden 64 (sqrt(64): an exact embedding scale), 2 kv heads; the scores
# scaled by 24 ** -0.5, not head_dim's; a local window of 3 tokens (cp2's chunks hold 4, cp4's 2);
# global layers with linearly scaled RoPE of base 1e6, local ones of base 1e4 unscaled. No pad id: a
# pad row is frozen by transformers' nn.Embedding(padding_idx) (see docs/architecture.md).
GEMMA = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64,
             query_pre_attn_scalar=24, sliding_window=3, pad_token_id=None,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
GRIDS = {  # name: (sizes, sequence parallel)
    "serial": (dict(), False),
    "x2y2z2-sp": (dict(x=2, y=2, z=2), True),
    "dp2cp2y2-sp": (dict(dp=2, cp=2, y=2), True),  # a window shorter than a cp chunk
    "cp4x2": (dict(cp=4, x=2), False),  # longer than a chunk
    "pp2dp2x2-1f1b": (dict(pp=2, dp=2, x=2), False),  # the tied embedding over two stages
}
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def gemma_norm_in_input_dtype(self, h):
    # Gemma3RMSNorm computes in float32 whatever the input; the same formula in the input's dtype
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    _, model = saved_random_model(GEMMA, path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", gemma_norm_in_input_dtype)
        logits = model(input_ids=IDS[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), logits=logits.detach(), grads=saved_gradients(model, path))


@pytest.mark.parametrize("grid", GRIDS)
def test_gemma3_equals_transformers(ranks, reference, grid):
    sizes, seq_parallel = GRIDS[grid]
    layout = Layout(**sizes)
    errors, grads = {}, {}
    for c, out in ranks.run(run_families, layout.world_size, {"gemma3": reference.path}, IDS, sizes, seq_parallel, 2):
        loss, logits, rank_grads = out["gemma3"]
        errors.setdefault("loss", []).append(abs(loss - reference.loss) / reference.loss)
        grads.update(rank_grads or {})
        if logits is not None:
            expected = cp_shard(reference.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]], layout.cp, c["cp"])
            errors.setdefault("logits", []).append(relative_error(logits, expected))
    hf_grads = to_hf_tensors(ModelConfig.from_hf(GEMMA), grads)
    assert hf_grads.keys() == reference.grads.keys()
    for param, g in reference.grads.items():
        errors[param] = [relative_error(hf_grads[param], g)]
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}  # NaN fails too
    assert not bad, (grid, bad)


def test_the_layers_take_their_kind():
    cfg = ModelConfig.from_hf(GEMMA)
    local, full = cfg.layer_block(0), cfg.layer_block(1)
    assert (local.window, local.rope_theta, local.rope_scaling) == (3, 1e4, None)
    assert (full.window, full.rope_theta, full.rope_scaling.kind, full.rope_scaling.factor) == (0, 1e6, "linear", 8.0)
    assert local.scale == full.scale == 24 ** -0.5 and full.post_norms and full.norm == "rms_plus_one"
    # the published pattern: five local layers to one global
    published = ModelConfig.from_hf({k: v for k, v in GEMMA.items() if k != "layer_types"} | {"num_hidden_layers": 12})
    assert [published.layer_block(i).window for i in range(12)] == ([3] * 5 + [0]) * 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export reads the checkpoint in one process
def test_import_checkpoint_export_gives_transformers_the_same_weights(ranks, reference, tmp_path):
    from moe_on_grids import assert_export_round_trip

    assert_export_round_trip(ranks, reference.path, tmp_path)


def test_counts_are_transformers():
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**GEMMA))
    assert ModelConfig.from_hf(GEMMA).parameter_count() == sum(p.numel() for p in model.parameters())


def test_every_field_of_the_config_class_is_read_or_refused():
    defaults = json.loads(transformers.Gemma3TextConfig().to_json_string())
    assert sorted(set(defaults) - gemma3.FIELDS - METADATA) == []
    cfg = ModelConfig.from_hf(defaults)
    assert cfg.to_hf()["model_type"] == "gemma3_text" and ModelConfig.from_hf(cfg.to_hf()) == cfg
    back, published = (transformers.AutoConfig.for_model(**d).to_dict() for d in (cfg.to_hf(), defaults))
    del back["architectures"], published["architectures"]
    assert back == published  # transformers reads the export as the same model


@pytest.mark.parametrize("change, message", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}), "sliding-window layers"),
])
def test_unimplemented_settings_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**GEMMA, **change})
