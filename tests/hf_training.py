"""Training steps against transformers' (tests/models/test_padding_row.py, test_gpt_oss.py): a few clipped
AdamW steps of a saved Hugging Face model, in transformers (torch's AdamW, clip_grad_norm_) and on a
fourfold grid (the trainer's Model, GradientSync and AdamW), in float64, in a module without
transformers (so that a rank need not import it)."""

import numpy as np
import torch

from fourfold.checkpoint.hf import load_hf, to_hf_tensors
from fourfold.models.config import load_config
from fourfold.parallel import comm
from fourfold.parallel.data import GradientSync
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model, local_batch
from fourfold.parallel.optimizer import AdamW
from fourfold.parallel.tensor.params import full_weights
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout

OPTIMIZER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0


def transformers_steps(model, ids: np.ndarray, steps: int):
    """(losses, pre-clip gradient norms, final state dict) of a transformers model trained on `ids`
    [batch, seq + 1] (the caller patches its float32-only pieces to the input's dtype)."""
    # no decay on norms and biases, GPT-OSS's experts' biases stacked in 2-D tensors among them (as fourfold's AdamW)
    params = dict(model.named_parameters())
    vector = [p for n, p in params.items() if p.dim() < 2 or n.endswith("bias")]
    matrix = [p for n, p in params.items() if not (p.dim() < 2 or n.endswith("bias"))]
    groups = [{"params": matrix, "weight_decay": OPTIMIZER["weight_decay"]}, {"params": vector, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, **OPTIMIZER)
    ids = torch.from_numpy(ids)
    losses, norms = [], []
    for _ in range(steps):
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def fourfold_steps(path: str, ids: np.ndarray, sizes: dict, seq_parallel: bool, steps: int, micro_batches: int = 2,
                   train_padding_row: bool = False):
    """The same steps on a grid (this rank's part; collective): (losses, norms, final weights in the
    checkpoint's names)."""
    batch = len(ids)
    job = Job(Layout(**sizes), global_batch=batch, micro_batch=batch // sizes.get("dp", 1) // micro_batches,
              seq=ids.shape[1] - 1, seq_parallel=seq_parallel, precision="float64")
    grid = Grid(job.layout)
    model = Model(grid, job, load_config(path), dtype=torch.float64, train_padding_row=train_padding_row)
    load_hf(model.module, path)
    opt = AdamW(GradientSync(model.module, grid), clip_norm=CLIP, **OPTIMIZER)
    rows = np.arange(batch).reshape(job.dp, -1)[grid.coords["dp"]]
    local = local_batch(job, grid, ids[rows])
    losses, norms = [], []
    for _ in range(steps):
        loss = model.step(local, opt.sync, 1.0 / (batch * job.seq))
        opt.step()
        losses.append(comm.all_reduce(loss, grid.loss_group()).item())
        norms.append(opt.last_norm)
    opt.sync.flush()
    return losses, norms, to_hf_tensors(load_config(path), full_weights(model.module))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()
