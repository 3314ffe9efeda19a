"""A decoder-only language model (Llama or GPT-2 family) built only from the 3D-parallel layers."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fourfold.models.config import ModelConfig
from fourfold.parallel import comm, context
from fourfold.parallel.grid import Grid
from fourfold.parallel.overlap import Overlapper
from fourfold.parallel.tensor import init, moe
from fourfold.parallel.tensor.block import ParallelBlock, TensorOptions, traces_whole
from fourfold.parallel.tensor.norm import ParallelNorm
from fourfold.parallel.tensor.params import ParallelModule, ParamLayout, Piece
from fourfold.parallel.tensor.vocab import LMHead, ParallelEmbedding, vocab_parallel_cross_entropy
from fourfold.spec.job import RECOMPUTE


class PositionEmbedding(ParallelModule):
    """GPT-2's learned positions [max_positions, hidden], features split over x (small: not z-sharded)."""

    def __init__(self, grid: Grid, cfg: ModelConfig, opts: TensorOptions, seed: int, std: float):
        super().__init__()
        self.grid, self.hidden, self.seed, self.std = grid, cfg.hidden, seed, std
        self.weight = nn.Parameter(torch.empty(cfg.max_positions, cfg.hidden // grid.size("x"), dtype=opts.dtype))
        self.seq_parallel = opts.seq_parallel
        self.initialise()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        positions, local = self.weight.shape
        rows = torch.arange(positions)[:, None]
        cols = torch.arange(local)[None, :] + self.grid.coords["x"] * local
        self.weight.copy_(init.normal(self.seed, "positions", rows * self.hidden + cols, self.std, self.weight.dtype))

    def forward(self, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """The rows of `positions` ([seq], or [batch, seq]) for this rank's tokens: with sequence
        parallelism its share of the batch's tokens flattened (`regions.own_tokens`)."""
        if not self.seq_parallel:
            return self.weight[positions]
        y = self.grid.group("y")
        mine = positions.expand(batch, -1).reshape(-1).chunk(y.size)[y.rank]
        return self.weight[mine].view(batch, -1, self.weight.shape[-1])

    def load(self, read, put) -> None:
        local = self.weight.shape[1]
        features = slice(self.grid.coords["x"] * local, (self.grid.coords["x"] + 1) * local)
        put(self.weight, read("positions", slice(0, self.weight.shape[0]), features))

    def full_weights(self, pick) -> dict:
        t = pick(self.weight).detach()
        return {"positions": comm.all_gather(t, self.grid.group("x"), dim=1)}

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        rows, local = self.weight.shape
        piece = Piece("positions", (rows, self.hidden), (0, self.grid.coords["x"] * local), (rows, local),
                      (0, rows * local), 0)
        return {self.weight: ParamLayout(("z", "y") if self.seq_parallel else ("z",), ("y", "z"), (piece,))}


class Transformer(nn.Module):
    """ids [batch/z, seq/cp] -> per-token loss [batch/z, seq/cp]; full logits never exist on a rank.

    With context parallelism the ids are this rank's two load-balanced chunks
    (`context.shard_sequence`). A plain model holds everything; `fourfold.parallel.pipeline.stage_model`
    prunes one to a pipeline stage (its layers, the embedding on the first stage, the norm and
    head on the last), whose forward takes and returns the residual stream shard that travels
    between stages.

    Serial parameter names (what `params.full_weights` and `params.load` use): embed, positions (GPT-2),
    layers.{i}.attn.{q,k,v,o} (Qwen3: and layers.{i}.attn.{q,k}_norm.weight),
    layers.{i}.mlp.{gate,up,down | fc,down}, layers.{i}.{attn,mlp}_norm.weight (and .bias), norm.weight
    (.bias), lm_head (untied), biases as NAME.bias; a mixture of experts' layers.{i}.mlp.router,
    layers.{i}.mlp.experts.{e}.{gate,up,down}, and a shared expert's layers.{i}.mlp.shared.{gate,up,down}
    with layers.{i}.mlp.shared_gate.
    """

    def __init__(self, grid: Grid, cfg: ModelConfig, opts: TensorOptions = TensorOptions(), *, seed: int = 0,
                 std: float = 0.02, recompute: str = "none"):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute {recompute!r} must be one of {', '.join(RECOMPUTE)}")
        self.grid, self.cfg, self.opts, self.recompute = grid, cfg, opts, recompute
        block = cfg.block
        self.overlap = Overlapper(opts.overlap, grid.group("z"))  # one prefetch order for all layers
        out_std = std / (2 * cfg.layers) ** 0.5  # GPT-2's scaled init of the residual projections
        self.embed = ParallelEmbedding(grid, cfg.vocab, cfg.hidden, seed=seed, std=std,
                                       seq_parallel=opts.seq_parallel, dtype=opts.dtype,
                                       padding_idx=None if opts.train_padding_row else cfg.pad_token)
        self.positions = PositionEmbedding(grid, cfg, opts, seed, std) if cfg.family_spec().learned_positions else None
        # keyed by global index so that parameter names stay the serial model's on a pipeline stage
        self.layers = nn.ModuleDict({
            str(i): ParallelBlock(grid, cfg.layer_block(i), opts, seed=seed, std=std, out_std=out_std,
                                  prefix=f"layers.{i}",
                                  selective_recompute=recompute == "selective", overlap=self.overlap)
            for i in range(cfg.layers)
        })
        for i, layer in self.layers.items() if opts.compile else ():
            if traces_whole(grid, cfg.layer_block(int(i))):
                layer.compile_whole()
        self.norm = ParallelNorm(grid, cfg.hidden, block.norm, block.eps, seq_parallel=opts.seq_parallel,
                                 dtype=opts.dtype, name="norm")
        self.lm_head = LMHead(grid, cfg.hidden, cfg.vocab, seed=seed, std=std,
                              input_gather="tokens" if opts.seq_parallel else "none", keep_weight=opts.keep_weights,
                              keep_gathered_input=opts.keep_gathered_inputs, dtype=opts.dtype, overlap=self.overlap)
        if cfg.tied:
            self.lm_head.weight = self.embed.weight
            self.lm_head.matrix = self.embed.matrix

    def router_loss(self) -> torch.Tensor | float:
        """A mixture's load-balancing loss of the last forward times its coefficient, this rank's
        share (`moe.router_loss`), when the model config adds it to the loss (output_router_logits); else 0."""
        if not (self.cfg.experts and self.cfg.aux_loss):
            return 0.0
        return moe.router_loss([layer.mlp for layer in self.layers.values()], self.grid, self.cfg.aux_loss_coef)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel logits [1, tokens/x, padded_vocab/y]: this x rank's share of the batch's
        tokens flattened in order (a reshape restores [batch, seq]); padded columns are -inf."""
        return self(ids)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's output for ids (first stage) or the residual stream shard (later stages):
        the residual stream, or on the last stage the logits, or with `targets` (global token ids,
        negative ones ignored) the per-token cross-entropy. `documents` ([batch/z, seq/cp] document
        ids, `block.document_ids`): attention causal within each document only (data.attention =
        document). `positions`: the tokens' positions (default: the global sequence's, which
        document masking keeps)."""
        documents = context.as_documents(documents)  # its attention plans made once, for every layer
        first, last = self.embed is not None, self.lm_head is not None  # a stage may lack either
        if first and last:  # a pipeline starts the pass at each schedule step
            self.overlap.new_pass()
        seq = x.shape[1] * (self.grid.size("y") if self.opts.seq_parallel and not first else 1)
        if positions is None:
            positions = context.positions(seq, self.grid.group("cp"), device=x.device)
        h = x
        if first:
            h = self.embed(x)
            if self.cfg.family_spec().scaled_embedding:  # sqrt(hidden) rounded as transformers' float32 buffer
                h = h * torch.tensor(self.cfg.hidden ** 0.5, dtype=torch.float32).to(h.dtype)
            if self.positions is not None:
                h = h + self.positions(positions, h.shape[0])
        for layer in self.layers.values():
            if self.recompute == "full":
                h = checkpoint(layer, h, positions, documents, use_reentrant=False)
            else:
                h = layer(h, positions, documents)
        if not last:
            return h.contiguous()  # sent to the next stage, whose receive buffer is contiguous
        logits = self.lm_head(self.norm(h))
        return logits if targets is None else vocab_parallel_cross_entropy(logits, targets, self.grid)
