"""The Llama family as users bring it from the Hub: Llama 3.1 (llama3 rope scaling, an explicit
head_dim, attention and MLP biases), linear rope scaling, Mistral and Qwen2 (QKV bias), each equal
to transformers (float64) on 3D and data-parallel grids; every field of their config classes is
read or refused by name."""

import dataclasses
import json

import pytest
import torch
import transformers

from fourfold.job import Job
from fourfold.layout import Layout
from fourfold.models.config import GPT2_FIELDS, LLAMA_FIELDS, METADATA, ModelConfig
from fourfold.rules import problems
from test_models import _compare, _rms_norm_in_input_dtype

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
             vocab_size=128, tie_word_embeddings=False, max_position_embeddings=64)
FAMILIES = {
    # heads * head_dim (128) differs from hidden (64); the llama3 frequencies with a short
    # pretraining context, so that the blend between low and high frequencies is in play
    "llama3.1-head-dim-bias": dict(SMALL, model_type="llama", head_dim=16, attention_bias=True, mlp_bias=True,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=16)),
    "llama-linear-rope": dict(SMALL, model_type="llama", rope_scaling=dict(rope_type="linear", factor=4.0)),
    "mistral": dict(SMALL, model_type="mistral", sliding_window=None),
    "qwen2": dict(SMALL, model_type="qwen2", use_sliding_window=False),
}
BATCH, SEQ = 8, 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """A saved random model and transformers' loss, logits and gradients on a fixed batch (float64)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**FAMILIES[request.param])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    with torch.no_grad():  # every parameter non-trivial, biases too
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    ids = torch.randint(0, 128, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as patch:  # transformers' RMSNorm is float32 whatever the input
        for norm in (transformers.models.llama.modeling_llama.LlamaRMSNorm,
                     transformers.models.mistral.modeling_mistral.MistralRMSNorm,
                     transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm):
            patch.setattr(norm, "forward", _rms_norm_in_input_dtype)
        logits = model(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1))
    loss.backward()
    return str(path), ids, loss.item(), logits.detach(), {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("sizes, seq_parallel", [(dict(x=2, y=2, z=2), True), (dict(dp=2, x=2, y=2), False)],
                         ids=["x2y2z2-sp", "dp2x2y2"])
def test_each_family_equals_transformers(ranks, family, sizes, seq_parallel):
    path, ids, loss, logits, grads = family
    n = Layout(**sizes).world_size
    ranks.run(_compare, n, path, sizes, ids, loss, logits, grads, torch.float64, 1e-10, "none", seq_parallel)


def test_rope_scaling_changes_the_model():
    """The scaled frequencies differ from the default ones (else the tests above could not fail)."""
    from fourfold.tensor.block import rope_frequencies

    scaled = ModelConfig.from_hf(FAMILIES["llama3.1-head-dim-bias"]).block
    default = rope_frequencies(scaled.head_dim, scaled.rope_theta, None)
    assert not torch.equal(rope_frequencies(scaled.head_dim, scaled.rope_theta, scaled.rope_scaling), default)


@pytest.mark.parametrize("config, fields", [(transformers.LlamaConfig, LLAMA_FIELDS),
                                            (transformers.MistralConfig, LLAMA_FIELDS),
                                            (transformers.Qwen2Config, LLAMA_FIELDS),
                                            (transformers.GPT2Config, GPT2_FIELDS)])
def test_every_field_of_the_config_classes_is_read_or_refused(config, fields):
    defaults = json.loads(config().to_json_string())
    assert sorted(set(defaults) - fields - METADATA) == []  # none unaccounted for
    ModelConfig.from_hf(defaults)  # the defaults are a model fourfold implements


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'; fourfold implements 'silu' only"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope scaling 'yarn' is not implemented"),
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
    with pytest.raises(ValueError, match="sliding-window layers"):
        ModelConfig.from_hf({**FAMILIES["qwen2"], "use_sliding_window": True})
    mistral = ModelConfig.from_hf({**FAMILIES["mistral"], "sliding_window": 32})
    assert problems(mistral, Job(seq=32, global_batch=1)) == []
    found = problems(mistral, Job(seq=64, global_batch=1))
    assert found and "sliding window of 32 tokens" in found[0].what


def test_export_and_checkpoints_write_each_family_back(family):
    path, *_ = family
    cfg = ModelConfig.from_hf(json.loads(open(f"{path}/config.json").read()))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg  # `fourfold export`
    assert ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg  # a checkpoint's meta.json
    exported = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert getattr(exported, "sliding_window", None) == getattr(transformers.AutoConfig.from_pretrained(path),
                                                                "sliding_window", None)  # null stays null
