"""A vocabulary that y does not divide (61, prime: GPT-2's 50,257 is odd too), padded to a multiple of
y: Llama and GPT-2 equal transformers in float64 on y=2 grids, checkpoints hold only the real rows
and reshard across grids padded differently, and `fourfold eval` gives transformers' loss."""


import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fourfold import checkpoint
from fourfold.checkpoint.hf import load_hf, to_hf_tensors
from fourfold.models.config import load_config
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import full_weights
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from hf_on_grids import compare_with_hf
from serial_reference import rms_norm_in_input_dtype

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 61, 4, 8
HF_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=64, vocab_size=VOCAB, tie_word_embeddings=False,
                  max_position_embeddings=32),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32),  # tied
}


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def model(request, tmp_path_factory):
    """A saved random model and transformers' loss, logits and gradients on a fixed batch (float64)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**HF_CONFIGS[request.param])
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    with torch.no_grad():  # every parameter non-trivial
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
        logits = hf(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    return str(path), ids, loss.item(), logits.detach(), {k: p.grad for k, p in hf.named_parameters()}


@pytest.mark.parametrize("sizes, seq_parallel, recompute", [(dict(x=2, y=2, z=2), False, "none"),
                                                            (dict(x=2, y=2, z=2), True, "selective"),
                                                            (dict(dp=2, x=2, y=2), False, "none")],
                         ids=["x2y2z2", "x2y2z2-sp-selective", "dp2x2y2"])
def test_odd_vocabulary_equals_transformers_on_y2(ranks, model, sizes, seq_parallel, recompute):
    path, ids, loss, logits, grads = model
    errors = ranks.run(compare_with_hf, 8, path, sizes, ids, loss, logits, grads, torch.float64, 1e-10, recompute,
                       seq_parallel)
    assert max(errors) < 1e-10


def _save(path, root, sizes):
    model = Transformer(Grid(Layout(**sizes)), load_config(path), TensorOptions(dtype=torch.float64))
    load_hf(model, path)
    checkpoint.save(root, 1, model, None, {}, keep=1)
    return True


def _load(path, root, sizes):
    cfg = load_config(path)
    model = Transformer(Grid(Layout(**sizes)), cfg, TensorOptions(dtype=torch.float64), seed=5)
    checkpoint.load_checkpoint(checkpoint.latest(root), model)
    return to_hf_tensors(cfg, full_weights(model))


def test_checkpoints_hold_the_real_rows_and_reshard_across_paddings(ranks, model, tmp_path):
    """Saved on y=2 (62 rows), loaded on y=4 (64 rows) and on one rank (61): the HF model's tensors."""
    path, *_ = model
    root = tmp_path / "run"
    ranks.run(_save, 4, path, root, dict(y=2, z=2))
    saved = dcp.FileSystemReader(str(checkpoint.latest(root))).read_metadata().state_dict_metadata
    assert tuple(saved["model/embed"].size) == (VOCAB, 32)
    original = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).state_dict()
    for sizes in (dict(y=4), dict(x=1)):
        n = Layout(**sizes).world_size
        tensors = ranks.run(_load, n, path, root, sizes)[0]
        for name, t in tensors.items():
            assert torch.equal(t, original[name]), (sizes, name)


def test_eval_command_on_y2_gives_transformers_loss(ranks, model, tmp_path):
    """`fourfold eval DIR` on y=2, z=2 (4 CPU ranks, the pool's) against transformers."""
    from fourfold.testing import eval_command

    path, *_ = model
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=SEQ * 6 + 3).astype(np.int32)  # 6 windows, 2 padded
    np.save(tmp_path / "tokens.npy", tokens)
    result = ranks.run(eval_command, 4, [path, "--tokens", str(tmp_path / "tokens.npy"), "--seq", str(SEQ),
                                         "--grid", "y=2,z=2", "--precision", "float64"])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    ids = torch.from_numpy(tokens.astype(np.int64))[torch.arange(6)[:, None] * SEQ + torch.arange(SEQ + 1)]
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
        logits = hf(input_ids=ids[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).item()
    assert result["tokens"] == 6 * SEQ
    assert abs(result["loss"] - expected) < 1e-10 * expected


def _two_steps(sizes, schedule):
    """The second step's loss of training the odd-vocabulary Llama (the first step's update in it)."""
    from fourfold.models.config import ModelConfig
    from fourfold.parallel.data import GradientSync
    from fourfold.parallel.model import Model, local_batch
    from fourfold.parallel.optimizer import AdamW
    from fourfold.spec.job import Job

    cfg = ModelConfig("llama", hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=VOCAB, max_positions=32,
                      tied=False, eps=1e-5)
    job = Job(Layout(**sizes), micro_batch=2, global_batch=4, seq=SEQ, schedule=schedule, precision="float64")
    grid = Grid(job.layout)
    model = Model(grid, job, cfg, dtype=torch.float64)
    opt = AdamW(GradientSync(model.module, grid), lr=1e-2)
    ids = np.random.default_rng(0).integers(0, VOCAB, (4, SEQ + 1))
    for _ in range(2):
        loss = model.step(local_batch(job, grid, ids), opt.sync, 1.0 / (4 * SEQ))
        opt.step()
    return float(loss)


def test_training_through_the_pipeline_with_a_padded_vocabulary(ranks):
    """pp=2 y=2 (the last stage's logits padded to 31 columns per y rank) trains as one rank does."""
    alone = ranks.run(_two_steps, 1, dict(x=1), "1f1b")[0]
    piped = ranks.run(_two_steps, 4, dict(pp=2, y=2), "1f1b")
    assert piped[2] == piped[3] and abs(piped[2] - alone) < 1e-12 * alone
