"""Pipeline parallelism over pp on torch.distributed.pipelining schedules.

The layers are cut into pp * virtual stages; pp rank r holds stages r, r + pp, ... (the looped
placement the interleaved schedule expects). Each stage is a plain `Transformer` pruned to its
layers (`stage_model`: the embedding on the first stage, norm, LM head and loss on the last; built
on the meta device, so only the stage's parameters are ever allocated), so a stage sends
its own residual-stream shard [micro/z, seq/cp(/y), hidden/x] to the same tensor-grid position
of the next stage. Parameter gradients accumulate over the micro-batches into the hooks of
`fourfold.parallel.data.GradientSync`, which launches each bucket's reduction after the last one.

Tied input and output embeddings: the last stage's head holds a copy of the first stage's table
(`LMHead.hold_copy`), which is not a parameter there (the table is optimised, checkpointed and
exported once, on the first stage). Each step the first stage sends its table to the copy, and
the last stage sends the copy's gradient, summed over the micro-batches, back; the first stage adds
it to the table's gradient in its last micro-batch's backward (the last stage finished its
backward before that one began), before GradientSync reduces it. This sums the two gradients as
Megatron's all-reduce over the first and last stages does, for as many bytes, without a second
copy of the optimizer state, and the gradient's transfer hides behind the pipeline's drain.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from fourfold.models.config import ModelConfig
from fourfold.parallel import comm
from fourfold.parallel.comm import P2P, Group, at_least_fp32
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor import moe
from fourfold.parallel.tensor.block import TensorOptions
from fourfold.parallel.tensor.params import parallel_layers
from fourfold.parallel.tensor.vocab import vocab_parallel_cross_entropy
from fourfold.parallel.transformer import Transformer
from fourfold.spec.job import split_layers
from fourfold.spec.rules import padded_vocab

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


def stage_model(grid: Grid, cfg: ModelConfig, opts: TensorOptions, layers: range, *, first: bool, last: bool,
                seed: int, std: float, recompute: str) -> Transformer:
    """A plain model pruned to one pipeline stage: built on the meta device (no memory, no
    initialisation), cut to `layers` (plus the embedding on the first stage, the final norm and
    head on the last, a tied head there a copy of the embedding), then only what is left is
    allocated and given its initial values."""
    with torch.device("meta"):
        model = Transformer(grid, cfg, opts, seed=seed, std=std, recompute=recompute)
    for index in [i for i in model.layers if int(i) not in layers]:
        del model.layers[index]
    if not first:
        model.embed = model.positions = None
    if not last:
        model.norm = model.lm_head = None
    # What to_empty does, by replacing each parameter (to_empty swaps them in place, which the fake
    # parameters of `fourfold simulate` do not allow; the layers look theirs up by name); a tied
    # weight stays one parameter.
    new: dict[nn.Parameter, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p not in new:
                new[p] = nn.Parameter(torch.empty_like(p, device=grid.device), p.requires_grad)
            setattr(module, name, new[p])
        for name, b in module.named_buffers(recurse=False):  # (DeepSeek-V3's balancing bias: zeros until loaded)
            setattr(module, name, torch.zeros_like(b, device=grid.device))
    with torch.device(grid.device):  # the initial values computed where they live, as without pp
        for layer in parallel_layers(model):
            layer.reset_parameters()
        if cfg.tied and last and not first:
            model.lm_head.hold_copy()
    return model


class _RoutingStage(nn.Module):
    """A stage of a mixture whose load-balancing loss spans the stages (it multiplies every layer's
    counts by every layer's probabilities): the stage takes the running sums [counts; probabilities]
    of the layers before it beside the residual stream and passes them on with its own added, so
    the last stage computes the loss whole, and backward carries d(loss)/d(probabilities) to each
    stage's routers through the same sends as the stream's gradient."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(x, documents=documents)
        mine = moe.stage_stats([layer.mlp for layer in self.model.layers.values()])
        return out, mine if stats is None else stats + mine


class _LedgerStage(PipelineStage):
    """A PipelineStage whose activation and gradient sends are recorded in fourfold's ledger, and
    whose work on each micro-batch is timed as the stage's (`clock.Clock`: the schedule's other
    time is spent waiting for the other stages)."""

    def __init__(self, *args, pp: Group, **kwargs):
        super().__init__(*args, **kwargs)
        self.pp = pp

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        with self.pp.clock.span("stage"):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        with self.pp.clock.span("stage"):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with self.pp.clock.span("stage"):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return self._recorded(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return self._recorded(super().get_bwd_send_ops(bwd_chunk_id))

    def _recorded(self, ops):
        for op in ops:
            self.pp._record("send", op.tensor)
        return ops


class Pipeline:
    """This rank's stages of the model and the schedule that runs them.

    `step(ids, targets, documents, scale=)` runs forward and backward of a local batch of `microbatches`
    micro-batches of `micro_batch` sequences of `seq` tokens (this rank's: after the z and cp
    splits); each micro-batch's loss is sum(per-token loss) * scale, so with scale = 1/(tokens in
    the global batch) the gradients reduced over dp and cp are the mean's. It returns this rank's
    scaled loss (zero on ranks without the last stage)."""

    def __init__(self, grid: Grid, cfg: ModelConfig, opts: TensorOptions = TensorOptions(), *, schedule: str = "1f1b",
                 microbatches: int, micro_batch: int, seq: int, virtual: int = 1,
                 stage_layers: list[int] | None = None, seed: int = 0, std: float = 0.02, recompute: str = "none"):
        pp = grid.group("pp")
        n_stages = pp.size * virtual  # the job was checked by fourfold.spec.rules
        ranges = split_layers(cfg.layers, n_stages, stage_layers or ())
        self.grid, self.microbatches, self.seq_parallel = grid, microbatches, opts.seq_parallel
        self.batch_shape = torch.Size([microbatches * micro_batch, seq])
        self.indices = [pp.rank + v * pp.size for v in range(virtual)]
        self.models = [stage_model(grid, cfg, opts, ranges[i], first=i == 0, last=i == n_stages - 1, seed=seed,
                                   std=std, recompute=recompute) for i in self.indices]
        self.module = nn.ModuleList(self.models)  # every parameter of this rank, for GradientSync
        self.has_first, self.has_last = 0 in self.indices, n_stages - 1 in self.indices
        self.pp, self.tied = pp, cfg.tied and n_stages > 1  # a tied head on the last stage is a copy
        if self.tied and self.has_first:
            self.models[0].register_forward_pre_hook(self._count_forward)
        self._forwards = 0
        # Shapes given up front: torch's run-time inference would run an extra forward and backward.
        stream = torch.empty(micro_batch, seq // grid.size("y") if opts.seq_parallel else seq,
                             cfg.hidden // grid.size("x"), dtype=opts.dtype, device="meta",
                             requires_grad=True)  # a stage's input gradient goes back to the previous one
        ids = torch.empty(micro_batch, seq, dtype=torch.long, device="meta")
        vocab = padded_vocab(cfg.vocab, grid.size("y"))  # the head's columns, padded to a multiple of y
        logits = torch.empty(1, micro_batch * seq // grid.size("x"), vocab // grid.size("y"), dtype=opts.dtype,
                             device="meta", requires_grad=True)  # the head keeps this x rank's tokens
        self.stream_shape = stream.shape  # what travels between stages (`simulate` makes its own)
        modules, inputs, outputs = self.models, [stream] * n_stages, [stream] * (n_stages - 1) + [logits]
        self.routing = bool(cfg.experts and cfg.aux_loss)  # the load-balancing loss's sums travel too
        if self.routing:
            self.rows = cfg.layers * micro_batch * seq  # the loss's rows: every layer's, of a micro-batch
            stats = torch.empty(2, cfg.experts, dtype=at_least_fp32(opts.dtype), device="meta", requires_grad=True)
            modules = [_RoutingStage(m) for m in self.models]
            inputs, outputs = [(t, stats) for t in inputs], [(t, stats) for t in outputs]
        inputs[0] = ids
        stages = [_LedgerStage(m, i, n_stages, grid.device, input_args=inputs[i], output_args=outputs[i],
                               group=pp.process_group, pp=pp) for m, i in zip(modules, self.indices)]
        kind = SCHEDULE_CLASSES[schedule]
        # a schedule of several stages a rank takes them all; a single-stage one its one
        self.schedule = kind(stages if issubclass(kind, PipelineScheduleMulti) else stages[0], microbatches,
                             loss_fn=self._loss, scale_grads=False)
        self._scale = 1.0

    def _loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        with self.grid.clock.span("stage"):  # (the schedule computes it between the stage's calls)
            return self._stage_loss(output, targets)

    def _stage_loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        logits, sums = output if self.routing else (output, None)
        loss = vocab_parallel_cross_entropy(logits, targets, self.grid).sum() * self._scale
        if sums is None:
            return loss
        # each micro-batch's load-balancing loss, averaged as the token losses are (as without pp)
        coef = self.models[-1].cfg.aux_loss_coef
        return loss + moe.balance_loss(sums[0], sums[1], self.rows, self.grid, coef) / self.microbatches

    def step(self, ids: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None, *,
             scale: float, ready: Callable[[nn.Parameter], None] | None = None) -> torch.Tensor:
        """`documents` (`block.document_ids` of the inputs): attention within each document; the
        schedule cuts them into micro-batches and hands each stage's forward its micro-batch's.
        `ready`: waits for a parameter's all-gather in flight (`GradientSync.wait_for`), before the
        tied table is read outside a forward."""
        if targets.shape != self.batch_shape:
            raise ValueError(f"this pipeline was built for local batches of shape {tuple(self.batch_shape)} "
                             f"({self.microbatches} micro-batches); got {tuple(targets.shape)}")
        self._scale = scale
        if self.tied and self.has_first and ready is not None:
            ready(self.models[0].embed.weight)
        self._set_copy()
        self._forwards = 0
        for model in self.models:  # one step of the schedule is the unit whose weight gathers repeat
            model.overlap.new_pass()
        losses: list[torch.Tensor] = []
        args = (ids,) if self.has_first else ()
        kwargs = {} if documents is None else {"documents": documents}
        if self.has_last:
            # (the last stage's outputs are the loss's logits, its gradient written over them: not returned)
            with self.grid.clock.span("schedule"):
                self.schedule.step(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
            if self.tied:
                head = self.models[-1].lm_head
                comm.send(head.copy_grad, 0, self.pp)
                head.copy_grad.zero_()
            return torch.stack(losses).sum().detach()
        with self.grid.clock.span("schedule"):
            self.schedule.step(*args, return_outputs=False, **kwargs)
        return torch.zeros((), dtype=torch.float64, device=self.grid.device)

    @torch.no_grad()
    def losses(self, ids: torch.Tensor, targets: torch.Tensor,
               documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only, through the stages of whatever schedule this pipeline was built for: the
        per-token losses [batch, seq] of a local batch of any size on the ranks holding the last
        stage, None on the others. The batch is one micro-batch; each stage waits (a blocking
        receive) only for the one before it, and sends asynchronously."""
        self._set_copy()
        pp, n_stages = self.pp.size, self.pp.size * len(self.models)
        y = self.grid.size("y") if self.seq_parallel else 1
        stream = (ids.shape[0], ids.shape[1] // y, self.stream_shape[-1])
        sends, out = [], None
        for i, model in zip(self.indices, self.models):
            model.overlap.new_pass()
            h = ids if i == 0 else comm.recv(torch.empty(stream, dtype=model.opts.dtype, device=ids.device),
                                             (i - 1) % pp, self.pp)
            if i == n_stages - 1:
                out = model(h, targets, documents)
            else:
                sends.append(comm.batch_p2p([P2P("send", model(h, documents=documents), (i + 1) % pp)], self.pp,
                                            async_op=True))
        for pending in sends:
            pending.wait()
        return out

    # ----- tied embeddings: the last stage's copy of the table ---------------------------------
    def _set_copy(self) -> None:
        """The copy := the first stage's table (as the last optimizer step left it)."""
        if not self.tied:
            return
        if self.has_first:
            comm.send(self.models[0].embed.weight.detach(), self.pp.size - 1, self.pp)
        elif self.has_last:
            comm.recv(self.models[-1].lm_head.weight.detach(), 0, self.pp)

    def _count_forward(self, model: nn.Module, args) -> None:
        """Arms the embedding's last training forward of a step: its backward adds the copy's gradient."""
        self._forwards += 1
        if self._forwards == self.microbatches and torch.is_grad_enabled():
            model.embed.add_grad = self._copy_grad

    def _copy_grad(self) -> torch.Tensor:
        table = self.models[0].embed.weight
        grad = torch.empty(table.shape, dtype=at_least_fp32(table.dtype), device=table.device)
        return comm.recv(grad, self.pp.size - 1, self.pp)
