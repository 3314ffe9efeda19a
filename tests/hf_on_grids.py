"""What each rank runs in tests/models/test_models.py and test_vocab_padding.py: a Hugging Face
checkpoint loaded on a grid against transformers' loss, logits and gradients, in a module without
transformers (so that a rank need not import it)."""

import torch

from fourfold.checkpoint.hf import load_hf, to_hf_tensors
from fourfold.models.config import load_config
from fourfold.parallel import comm
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import full_weights
from fourfold.parallel.transformer import Transformer
from fourfold.spec.layout import Layout
from fourfold.spec.rules import padded_vocab
from fourfold.spec.volumes import ledger_bytes, model_collectives
from serial_reference import sum_replicated_grads


def compare_with_hf(path, sizes, ids, loss_ref, logits_ref, grads_ref, dtype, tol, recompute="none",
                    seq_parallel=False):
    layout = Layout(**sizes)
    grid = Grid(layout)
    cfg = load_config(path)
    model = Transformer(grid, cfg, TensorOptions(dtype=dtype, seq_parallel=seq_parallel), recompute=recompute)
    load_hf(model, path)
    c = grid.coords
    local = ids.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
    logits = model.logits(local[:, :-1])
    grid.ledger.reset()
    per_token = model(local[:, :-1], local[:, 1:])
    (per_token.sum() / ids[:, 1:].numel()).backward()
    # the head's collectives on its padded vocabulary are what volumes (and so the planner) count
    expected = model_collectives(cfg, layout.sizes, len(local), ids.shape[1] - 1, seq_parallel=seq_parallel,
                                 recompute=recompute)
    assert grid.ledger.bytes() == ledger_bytes(expected, layout.sizes, torch.finfo(dtype).bits // 8)
    sum_replicated_grads(model, grid)
    for p in model.parameters():
        comm.all_reduce(p.grad, grid.group("dp"))
    total = comm.all_reduce(per_token.detach().sum(), grid.group(("dp", "z"))) / ids[:, 1:].numel()
    # the head keeps this x rank's tokens (flattened, in its order) and y's part of the vocabulary
    full_logits = comm.all_gather(comm.all_gather(logits.detach(), grid.group("y"), dim=-1), grid.group("x"), dim=1)
    full_logits = full_logits.view(len(local), -1, full_logits.shape[-1])  # (the head's tokens: in order)
    # a vocabulary y does not divide is padded: its padded logits are -inf
    assert full_logits.shape[-1] == padded_vocab(cfg.vocab, layout.y)
    assert (full_logits[..., cfg.vocab:] == float("-inf")).all()
    ref_local = logits_ref.chunk(layout.dp)[c["dp"]].chunk(layout.z)[c["z"]]
    logits_error = (full_logits[..., :cfg.vocab] - ref_local.to(dtype)).abs().max() / ref_local.abs().max()
    errors = {"loss": abs(total.item() - loss_ref) / loss_ref, "logits": logits_error.item()}
    grads = to_hf_tensors(cfg, full_weights(model, grads=True))
    for name, ref in grads_ref.items():
        ref = ref.to(dtype)
        assert grads[name].shape == ref.shape, name  # the real rows only
        errors[name] = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, (sizes, worst, errors[worst])
    return errors[worst]
