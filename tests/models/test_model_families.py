"""The families as users bring them from the Hub: Llama 3.1 (llama3 rope scaling, an explicit
head_dim, attention and MLP biases), linear, dynamic (NTK) and YaRN rope scaling, Mistral, Qwen2
(QKV bias) and GPT-2, each equal to transformers (float64) on 3D, data-, context- and
pipeline-parallel grids; every field of their config classes is read or refused by name."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from families_on_grids import run_families
from fourfold.checkpoint.hf import to_hf_tensors
from fourfold.models import gpt2, llama
from fourfold.models.config import METADATA, ModelConfig
from fourfold.parallel.tensor.block import rope_frequencies, rope_tables
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import problems
from serial_reference import cp_shard, relative_error, rms_norm_in_input_dtype, saved_random_model

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
             vocab_size=128, tie_word_embeddings=False, max_position_embeddings=64)
BATCH, SEQ, VOCAB = 8, 16, 128
FAMILIES = {
    # heads * head_dim (128) differs from hidden (64); the llama3 frequencies with a short
    # pretraining context, so that the blend between low and high frequencies is in play
    "llama3.1-head-dim-bias": dict(SMALL, model_type="llama", head_dim=16, attention_bias=True, mlp_bias=True,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=16)),
    "llama-linear-rope": dict(SMALL, model_type="llama", rope_scaling=dict(rope_type="linear", factor=4.0)),
    # trained on 12 positions, run on SEQ=16: the base grows (on cp ranks too, which hold 8 of them)
    "llama-dynamic-rope": dict(SMALL, model_type="llama", max_position_embeddings=12,
                               rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    # a 4096-token pretraining context puts head_dim 8's ramp over dims 1..3; DeepSeek's mscales
    "llama-yarn-rope": dict(SMALL, model_type="llama", max_position_embeddings=16384,
                            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096,
                                              mscale=1.0, mscale_all_dim=0.5)),
    # a window of 3 tokens: shorter than a cp2 chunk (4 of SEQ's 16 tokens), so the ring skips blocks
    "mistral": dict(SMALL, model_type="mistral", sliding_window=3),
    "qwen2": dict(SMALL, model_type="qwen2", use_sliding_window=False),
    # layer 0 full, layer 1 within a window of 3 (max_window_layers 1), as Qwen2Config resolves them
    "qwen2-sliding": dict(SMALL, model_type="qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1),
    # untied: tied embeddings cannot be split over pipeline stages (test_models covers tied GPT-2)
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=8, vocab_size=VOCAB, n_positions=32,
                 tie_word_embeddings=False),
}
GRIDS = {  # name: (sizes, sequence parallel, micro-batches of the pipeline)
    "x2y2z2-sp": (dict(x=2, y=2, z=2), True, 1),
    "dp2x2y2": (dict(dp=2, x=2, y=2), False, 1),
    "cp2x2y2-sp": (dict(cp=2, x=2, y=2), True, 1),
    "pp2x2y2-1f1b": (dict(pp=2, x=2, y=2), False, 2),
}
IDS = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _reference(name, path):
    """A saved random model and transformers' loss, logits and gradients on IDS (float64)."""
    _, model = saved_random_model(FAMILIES[name], path)
    with pytest.MonkeyPatch.context() as patch:  # transformers' RMSNorm is float32 whatever the input
        for norm in (transformers.models.llama.modeling_llama.LlamaRMSNorm,
                     transformers.models.mistral.modeling_mistral.MistralRMSNorm,
                     transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm):
            patch.setattr(norm, "forward", rms_norm_in_input_dtype)
        logits = model(input_ids=IDS[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))
    loss.backward()
    return SimpleNamespace(path=str(path), loss=loss.item(), logits=logits.detach(),
                           grads={k: p.grad for k, p in model.named_parameters()})


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return {name: _reference(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


@pytest.mark.parametrize("grid", GRIDS)
def test_every_family_equals_transformers(ranks, families, grid):
    """One launch per grid runs every family: loss, logits (grids without pp) and every gradient."""
    sizes, seq_parallel, microbatches = GRIDS[grid]
    layout = Layout(**sizes)
    paths = {name: ref.path for name, ref in families.items()}
    results = ranks.run(run_families, layout.world_size, paths, IDS, sizes, seq_parallel, microbatches)
    errors = {}  # (family, "loss" / "logits" / parameter) -> relative errors over the ranks

    def note(key, error):
        errors.setdefault(key, []).append(error)

    for name, ref in families.items():
        grads, logits_checked = {}, 0
        for c, out in results:
            loss, logits, stage_grads = out[name]
            note((name, "loss"), abs(loss - ref.loss) / ref.loss)
            grads.update(stage_grads or {})
            if logits is not None:
                expected = cp_shard(ref.logits.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]], layout.cp, c["cp"])
                note((name, "logits"), relative_error(logits, expected))
                logits_checked += 1
        assert logits_checked == (0 if layout.pp > 1 else layout.world_size // (layout.x * layout.y))
        hf_grads = to_hf_tensors(ModelConfig.from_hf(FAMILIES[name]), grads)
        assert hf_grads.keys() == ref.grads.keys()
        for param, g in ref.grads.items():
            note((name, param), relative_error(hf_grads[param], g))
    bad = {key: found for key, found in errors.items() if not all(e < 1e-10 for e in found)}  # NaN fails too
    assert not bad, (grid, bad)


def _hf_rope(d: dict, seq: int):
    """transformers' cos and sin for a llama config.json's fields at positions 0..seq-1 (a fresh module)."""
    emb = LlamaRotaryEmbedding(transformers.AutoConfig.for_model(**d))
    cos, sin = emb(torch.zeros(1, dtype=torch.float64), torch.arange(seq)[None])
    return cos[0], sin[0]


ROPES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "dynamic": dict(rope_type="dynamic", factor=3.7),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096),
    "yarn-untruncated-betas": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096,
                                   truncate=False, beta_fast=16, beta_slow=2),
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, mscale=0.707,
                        mscale_all_dim=0.5),
    "yarn-attention-factor-implicit-factor": dict(rope_type="yarn", factor=None, original_max_position_embeddings=4,
                                                  attention_factor=1.3),
}


@pytest.mark.parametrize("seq", [12, 13, 40])  # within, just past and far past max_position_embeddings
@pytest.mark.parametrize("rope", ROPES)
def test_rope_tables_equal_transformers_bit_for_bit(rope, seq):
    d = dict(SMALL, model_type="llama", head_dim=16, max_position_embeddings=12, rope_scaling=ROPES[rope])
    block = ModelConfig.from_hf(d).block
    cos, sin = rope_tables(torch.arange(seq), seq, block.head_dim, block.rope_theta, block.rope_scaling, torch.float64)
    hf_cos, hf_sin = _hf_rope(d, seq)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    default = rope_tables(torch.arange(seq), seq, block.head_dim, block.rope_theta, None, torch.float64)
    # the scaling is in play (dynamic: only past the trained 12 positions), else the test could not fail
    assert torch.equal(cos, default[0]) == (rope == "dynamic" and seq <= 12)


def test_rope_scaling_changes_the_model():
    """The scalings of FAMILIES are in play at SEQ, else the grid tests could not tell them apart."""
    def frequencies(name, seq=SEQ, scaled=True):
        b = ModelConfig.from_hf(FAMILIES[name]).block
        return rope_frequencies(b.head_dim, b.rope_theta, b.rope_scaling if scaled else None, seq)

    assert not torch.equal(frequencies("llama3.1-head-dim-bias"), frequencies("llama3.1-head-dim-bias", scaled=False))
    # dynamic: the whole sequence's length counts, not a cp rank's part (8 tokens, the last at 11)
    dynamic = [frequencies("llama-dynamic-rope", seq) for seq in (SEQ, 12, 8)]
    assert not torch.equal(dynamic[0], dynamic[1]) and torch.equal(dynamic[1], dynamic[2])
    # yarn: extrapolated (default), interpolated (default / factor) and blended dims, cos and sin scaled
    yarn, default = frequencies("llama-yarn-rope"), frequencies("llama-yarn-rope", scaled=False)
    kept, interpolated = yarn == default, yarn == default / 4.0
    assert kept.any() and interpolated.any() and not (kept | interpolated).all()
    assert ModelConfig.from_hf(FAMILIES["llama-yarn-rope"]).rope_scaling.attention_factor > 1


@pytest.mark.parametrize("config, fields", [(transformers.LlamaConfig, llama.FIELDS),
                                            (transformers.MistralConfig, llama.FIELDS),
                                            (transformers.Qwen2Config, llama.FIELDS),
                                            (transformers.GPT2Config, gpt2.FIELDS)])
def test_every_field_of_the_config_classes_is_read_or_refused(config, fields):
    defaults = json.loads(config().to_json_string())
    assert sorted(set(defaults) - fields - METADATA) == []  # none unaccounted for
    ModelConfig.from_hf(defaults)  # the defaults are a model fourfold implements


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'; fourfold implements 'silu' only"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(rope_scaling=dict(rope_type="longrope", factor=4.0)), "rope scaling 'longrope' is not implemented"),
    (dict(rope_scaling=dict(rope_type="dynamic")), "rope scaling 'dynamic' has no factor"),
    (dict(some_new_field=1), "fields fourfold does not implement: some_new_field"),
    (dict(attention_bias=True), "attention_bias=True; fourfold implements False only"),  # transformers ignores it here
])
def test_unimplemented_settings_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**FAMILIES["mistral"], **change})


def test_the_published_gpt2_config_reads():
    published = dict(json.loads(transformers.GPT2Config().to_json_string()),
                     task_specific_params={"text-generation": {"do_sample": True, "max_length": 50}})
    assert ModelConfig.from_hf(published).family == "gpt2"


def test_sliding_windows():
    """Mistral's window is the attention's, Qwen2's and Qwen3's sliding-window layers are the layers
    from max_window_layers on (Qwen2's equal to transformers on every grid above); either is off
    unless use_sliding_window. Qwen3-MoE's and Qwen2-MoE's are refused by name."""
    mistral = ModelConfig.from_hf({**FAMILIES["mistral"], "sliding_window": 32})
    assert mistral.block.window == 32 and problems(mistral, Job(seq=64, global_batch=1)) == []
    unset = {k: v for k, v in FAMILIES["mistral"].items() if k != "sliding_window"}
    assert ModelConfig.from_hf(unset).sliding_window == transformers.AutoConfig.for_model(**unset).sliding_window
    for kind in ("qwen2", "qwen3"):
        d = dict(FAMILIES["qwen2-sliding"], model_type=kind)
        cfg = ModelConfig.from_hf(d)
        assert cfg.layer_types == tuple(transformers.AutoConfig.for_model(**d).layer_types), kind
        assert [cfg.layer_block(i).window for i in range(2)] == [0, 3] and ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert ModelConfig.from_hf({**d, "use_sliding_window": False}).layer_types == ()
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    for kind in ("qwen3_moe", "qwen2_moe"):  # (their windows follow other rules: refused)
        with pytest.raises(ValueError, match="sliding-window layers"):
            ModelConfig.from_hf(dict(FAMILIES["qwen2-sliding"], model_type=kind, **experts))


@pytest.mark.parametrize("name", FAMILIES)
def test_export_and_checkpoints_write_each_family_back(families, name):
    path = families[name].path
    cfg = ModelConfig.from_hf(json.loads(open(f"{path}/config.json").read()))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg  # `fourfold export`
    assert ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg  # a checkpoint's meta.json
    exported = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert getattr(exported, "sliding_window", None) == getattr(transformers.AutoConfig.from_pretrained(path),
                                                                "sliding_window", None)  # null stays null
    if cfg.family == "llama":  # transformers reads the exported rope scaling as the original
        for seq in (8, SEQ):
            assert all(map(torch.equal, _hf_rope(cfg.to_hf(), seq), _hf_rope(FAMILIES[name], seq)))


@pytest.mark.parametrize("kind", llama.HF_TYPES)
def test_a_missing_max_position_embeddings_is_the_config_class_default(kind):
    d = {k: v for k, v in FAMILIES["llama-dynamic-rope"].items() if k != "max_position_embeddings"}
    d["model_type"] = kind
    cfg = ModelConfig.from_hf(d)
    expected = transformers.AutoConfig.for_model(**d).max_position_embeddings
    assert cfg.max_positions == cfg.rope_scaling.original_max_positions == expected
