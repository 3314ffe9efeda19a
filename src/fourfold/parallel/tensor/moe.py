"""A mixture of SwiGLU experts in place of the MLP (Mixtral, Qwen2-MoE), dropless, on the 3D grid.

Every expert is the dense MLP of the block plan under its own serial names
(layers.{i}.mlp.experts.{e}.{gate,up,down}), its weights split over x, y and z exactly as the
dense MLP's; it runs on the tokens routed to it, in a loop over the experts (every rank calls
every expert, with no token if none chose it: the z weight gathers are collectives). The routing
is replicated over x and y: the router's logits are all-reduced over x, and each rank of a
(x, y) group holds the same tokens. With sequence parallelism the block gathers the stream's
tokens over y first and keeps its own part of the output.

With expert parallelism (`Layout.ep`) a rank holds experts/ep of them, and each choice's token
goes to its expert's rank of the expert group and back by uneven all-to-alls (`_exchanged`); the
experts' x/y/z splits are unchanged, their gradients summed over their replicas only (`ExpertShard`).

The router's arithmetic is transformers': softmax, top-k, optional renormalisation, in float32 at
least (transformers: float32 always, so a float64 model matches a float64 reference to rounding);
the load-balancing loss (Switch Transformer's, `load_balancing_loss_func`) from each layer's
per-expert sums, finished over all layers and all ranks holding other tokens by the model
(`router_loss`). The weights multiply the experts' outputs in the model's dtype (Qwen2-MoE's
cast; Mixtral multiplies bf16 outputs by float32 weights).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from fourfold.parallel import comm
from fourfold.parallel.grid import Grid
from fourfold.parallel.tensor import init, regions
from fourfold.parallel.tensor.experts import Routed, grouped_gemm_runs, run_experts
from fourfold.parallel.tensor.params import ExpertShard, ParallelModule, ParamLayout, Piece, vector_piece
from fourfold.spec.blockspec import BlockPlan


class ReplicatedLinear(ParallelModule):
    """A small [out, hidden] matrix (the router, the shared expert's gate) on the residual stream:
    its columns split over x as the stream's features, replicated over y and z (not worth a z
    gather); the products all-reduced over x, used identically by every x rank. A bias (GPT-OSS's
    router) is held whole by every rank and added after the reduction."""

    def __init__(self, grid: Grid, hidden: int, out: int, *, name: str, seed: int, std: float, dtype: torch.dtype,
                 bias: bool = False, wide: bool = False, balance_bias: bool = False):
        """`wide`: the products in fp32 at least (DeepSeek-V3's router); `balance_bias`: DeepSeek-V3's
        aux-loss-free balancing bias, [out] in fp32 at least, no parameter (`ParallelMoE`)."""
        super().__init__()
        self.grid, self.hidden, self.out, self.name, self.seed, self.std = grid, hidden, out, name, seed, std
        self.local, self.wide = hidden // grid.size("x"), wide
        self.weight = nn.Parameter(torch.empty(out * self.local, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype)) if bias else None
        balance = torch.zeros(out, dtype=comm.at_least_fp32(dtype)) if balance_bias else None
        self.register_buffer("balance_bias", balance, persistent=False)
        self.initialise()

    @property
    def col0(self) -> int:
        return self.grid.coords["x"] * self.local

    @torch.no_grad()
    def reset_parameters(self) -> None:
        rows, cols = torch.arange(self.out)[:, None], torch.arange(self.local)[None, :] + self.col0
        values = init.normal(self.seed, self.name, rows * self.hidden + cols, self.std, self.weight.dtype)
        self.weight.copy_(values.reshape(-1))
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.weight.view(self.out, self.local)
        if self.wide:
            h, weight = h.to(comm.at_least_fp32(h.dtype)), weight.to(comm.at_least_fp32(h.dtype))
        out = regions.all_reduce_replicated(h @ weight.t(), self.grid.group("x"))
        return out if self.bias is None else out + self.bias

    def load(self, read, put) -> None:
        put(self.weight, read(self.name, slice(0, self.out), slice(self.col0, self.col0 + self.local)).reshape(-1))
        if self.bias is not None:
            put(self.bias, read(f"{self.name}.bias", slice(0, self.out), None))
        if self.balance_bias is not None:
            self.balance_bias.copy_(read(f"{self.name}.balance_bias", slice(0, self.out), None))

    def param_layouts(self) -> dict[nn.Parameter, ParamLayout]:
        # Its tokens are split over z only (replicated over y even with sequence parallelism: gathered first).
        piece = Piece(self.name, (self.out, self.hidden), (0, self.col0), (self.out, self.local),
                      (0, self.out * self.local), 0)
        out = {self.weight: ParamLayout(("z",), ("y", "z"), (piece,))}
        if self.bias is not None:  # every x rank adds it to the same reduced products
            out[self.bias] = ParamLayout(("z",), ("x", "y", "z"), (vector_piece(f"{self.name}.bias", self.out, 0,
                                                                                 self.out),))
        return out

    def buffer_layouts(self) -> dict[torch.Tensor, ParamLayout]:
        """The balancing bias, whole on every rank: checkpointed beside the parameters (no gradient)."""
        if self.balance_bias is None:
            return {}
        piece = vector_piece(f"{self.name}.balance_bias", self.out, 0, self.out)
        return {self.balance_bias: ParamLayout((), ("x", "y", "z"), (piece,))}

    def full_weights(self, pick) -> dict[str, torch.Tensor]:
        t = pick(self.weight).detach().view(self.out, self.local)
        out = {self.name: comm.all_gather(t, self.grid.group("x"), dim=1)}
        if self.bias is not None:
            out[f"{self.name}.bias"] = pick(self.bias).detach()
        if self.balance_bias is not None:
            out[f"{self.name}.balance_bias"] = self.balance_bias.clone()
        return out


@dataclasses.dataclass
class RouterStats:
    """One layer's routing on this rank's tokens, for the load-balancing loss."""

    counts: torch.Tensor  # [experts] top-k choices per expert (float32 at least, no gradient)
    probs: torch.Tensor  # [experts] sum of the router's probabilities over the tokens (float32 at least)
    tokens: int


def balanced_choices(chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """The choices in place of `chosen` [tokens, top_k] under a fixed balanced routing, for fake
    tensors only (`fourfold.tools.measure` under FakeTensorMode, which has no values to route by):
    choice i = token * top_k + slot goes to expert i % experts, so each expert gets top_k * T /
    experts of them (give or take one: `plan.routing.balanced_routing`, what the planner prices) and
    no token picks an expert twice (top_k <= experts). Real tensors never take this path."""
    return (torch.arange(chosen.numel(), device=chosen.device) % experts).view(chosen.shape)


class ParallelMoE(nn.Module):
    # its experts' weights are read as one GEMM per linear, not through their modules' forwards: ZeRO-1
    # waits for all of its parameters' gathers before its forward (`data.GradientSync`)
    reads_all_parameters = True

    def __init__(self, grid: Grid, plan: BlockPlan, mlp, *, seed: int, std: float, prefix: str, dtype: torch.dtype,
                 seq_parallel: bool, capacity_factor: float = 0.0):
        """`mlp(plan)`: the runtime MLP of a block plan (ParallelMLP), for each expert and the shared one;
        `capacity_factor`: see `within_capacity` (0: dropless)."""
        super().__init__()
        cfg = plan.cfg
        self.grid, self.cfg, self.seq_parallel, self.capacity_factor = grid, cfg, seq_parallel, capacity_factor
        grouped = cfg.routing == "sigmoid_grouped"
        self.router = ReplicatedLinear(grid, cfg.hidden, cfg.experts, name=f"{prefix}.mlp.router", seed=seed, std=std,
                                       dtype=dtype, bias=cfg.router_bias, wide=grouped, balance_bias=grouped)
        # Expert parallelism: this rank holds experts [first, first + experts/ep) of the mixture.
        self.dispatch = grid.expert_group("ep")
        local = cfg.experts // self.dispatch.size
        self.first = self.dispatch.rank * local
        experts = (mlp(dataclasses.replace(plan, up=up, down=down))
                   for up, down in map(plan.expert, range(self.first, self.first + local)))
        self.experts = ExpertShard(experts, self.first, self.dispatch) if self.dispatch.size > 1 else nn.ModuleList(
            experts)
        for expert in self.experts:  # run as one GEMM per linear (`tensor.experts`): train.fp8 leaves them as they are
            expert.up.fp8 = expert.down.fp8 = None
        self.shared = self.shared_gate = None
        if plan.shared_up is not None:
            self.shared = mlp(dataclasses.replace(plan, up=plan.shared_up, down=plan.shared_down))
            if cfg.shared_gate:
                self.shared_gate = ReplicatedLinear(grid, cfg.hidden, 1, name=f"{prefix}.mlp.shared_gate", seed=seed,
                                                    std=std, dtype=dtype)
        self.stats: RouterStats | None = None  # the last forward's
        self._routed: Routed | None = None  # the last forward's rows per expert (`routed`)
        # this rank's experts as one grouped GEMM where the device and dtype allow (`tensor.experts`); off:
        # their loop, the reference path
        self.grouped_gemm = True
        one = self.experts[0]  # the GEMMs' feature counts, which the grouped kernel needs 16-byte aligned
        self._features = {n for layer in (one.up, one.down) for n in layer.matrix.block_shape}
        self.exchanged = (0, 0)  # with expert parallelism: rows sent to, and received from, the other ranks
        # the training forwards' routing since `take_load` (`_count`): on the device, read with the step's records
        self.load: torch.Tensor | None = None
        self.chosen: torch.Tensor | None = None  # with a balancing bias: the choices since the last `balance`

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.grid.group("y")
        if self.seq_parallel:  # every y rank routes the whole sequence; each keeps its part at the end
            h = regions.gather_tokens_replicated(h, y)
        shape = h.shape
        flat = h.reshape(-1, shape[-1])
        logits = self.router(flat)
        if self.cfg.routing == "sigmoid_grouped":
            weights, chosen, probs = self._grouped(logits)
        else:
            probs = F.softmax(logits, dim=-1, dtype=comm.at_least_fp32(logits.dtype))
            weights, chosen = torch.topk(probs, self.cfg.top_k, dim=-1)
            if self.cfg.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        # d(weight) is a dot product over the hidden features, which x splits
        weights = regions.sum_gradients(weights.to(h.dtype), self.grid.group("x"))
        fake = is_fake(flat)  # measured under FakeTensorMode: a static balanced routing (balanced_choices)
        if self.capacity_factor and not fake:  # (a balanced routing is within any capacity factor >= 1)
            kept = within_capacity(chosen, weights.detach(), self.cfg.experts, self.capacity_factor)
            chosen = torch.where(kept, chosen, self.cfg.experts)  # a dropped choice: no expert's
        if not fake and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self._count(chosen, probs)  # (a training forward: not evaluation, nor a recompute in backward)
        if fake:
            chosen = balanced_choices(chosen, self.cfg.experts)
        order, scaled = (self._exchanged if self.dispatch.size > 1 else self._local)(flat, chosen, weights)
        out = self._combined(scaled, order, chosen)
        if self.shared_gate is not None:
            gate = regions.sum_gradients(torch.sigmoid(self.shared_gate(flat)), self.grid.group("x"))
            out = out + gate * self.shared(flat[None])[0]
        elif self.shared is not None:  # (DeepSeek-V3's: ungated)
            out = out + self.shared(flat[None])[0]
        self.stats = self._stats(logits)
        out = out.view(shape)
        return regions.own_tokens(out, y) if self.seq_parallel else out

    def _grouped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter), in fp32 at least: (the chosen
        experts' weights, the chosen experts, the scores as a distribution for the load's entropy).
        The balancing bias picks the experts; the weights are the sigmoid scores alone."""
        cfg = self.cfg
        scores = torch.sigmoid(logits)
        choice = scores + self.router.balance_bias
        groups = choice.view(-1, cfg.groups, cfg.experts // cfg.groups).topk(2, dim=-1).values.sum(-1)
        best = torch.topk(groups, cfg.top_groups, dim=-1, sorted=False).indices
        kept = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~kept.repeat_interleave(cfg.experts // cfg.groups, dim=1), float("-inf"))
        chosen = torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if cfg.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scale, chosen, scores.detach() / scores.detach().sum(-1, keepdim=True)

    def _local(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        """Without expert parallelism: (the choices sorted by expert, their rows' weighted outputs). The
        experts' rows are counted on the device: the grouped GEMM needs no host read (dropless)."""
        experts, k = self.cfg.experts, self.cfg.top_k
        choice_expert = chosen.reshape(-1)  # choice i = token * top_k + slot
        order = torch.argsort(choice_expert, stable=True)  # tokens ascending within each expert
        grouped = self.grouped_gemm and grouped_gemm_runs(flat, *self._features)
        if is_fake(flat):
            counts = [len(range(e, len(choice_expert), experts)) for e in range(experts)]
        else:  # (an index_add: CUDA's bincount reads the largest index on the host; expert `experts`: dropped)
            counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
            counts = counts.index_add_(0, choice_expert, torch.ones_like(choice_expert))[:experts]
            if self.capacity_factor or not grouped:  # the kept rows, or the loop's split: one host read
                counts = counts.tolist()
        routed = Routed.from_counts(counts, flat.device, grouped)
        if isinstance(counts, list):
            order = order[: sum(counts)]
        self._routed = routed
        out = run_experts(self.experts, flat[order // k], routed)
        return order, out * weights.reshape(-1)[order, None]

    def _exchanged(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        """With expert parallelism: (the choices sorted by expert, their rows' weighted outputs); each
        choice's token sent to the rank of the expert group holding its expert (counts exchanged first:
        the splits are uneven), run there beside the other ranks' tokens for that expert, and sent
        back. The x and y ranks of a (x, y) group route the same tokens the same way, so each receives
        the same rows as its peers."""
        group, k, experts = self.dispatch, self.cfg.top_k, self.cfg.experts
        local = len(self.experts)
        choice_expert = chosen.reshape(-1)  # choice i = token * top_k + slot
        if is_fake(flat):  # the static balanced routing: every rank routes alike
            n = len(choice_expert)
            per = [len(range(e, n, experts)) for e in range(experts)]
            comm.all_to_all(torch.tensor(per, device=flat.device), group)  # counted as a real one is
            send = [sum(per[s * local : (s + 1) * local]) for s in range(group.size)]
            received = [per[self.first : self.first + local]] * group.size
        else:  # (a choice dropped over capacity names expert `experts`: counted apart, sorted last, not sent)
            counts = torch.bincount(choice_expert, minlength=experts + 1)[:experts]
            arriving = comm.all_to_all(counts, group).view(group.size, local)  # [source][my expert]
            both = torch.cat([counts.view(group.size, local).sum(1), arriving.reshape(-1)]).tolist()  # (one host read)
            send = both[: group.size]
            received = [both[group.size + s * local : group.size + (s + 1) * local] for s in range(group.size)]
        order = torch.argsort(choice_expert, stable=True)[: sum(send)]  # the choices by expert, tokens ascending
        here = [sum(r) for r in received]  # rows from each rank of the group
        self.exchanged = (sum(send) - send[group.rank], sum(here) - here[group.rank])
        rows = regions.all_to_all_rows(flat[order // k], group, send, here)
        # from (source, expert) order to expert order for the experts, and back
        pieces = rows.split([n for r in received for n in r])
        by_expert = [pieces[s * local + j] for j in range(local) for s in range(group.size)]
        counts = [sum(r[j] for r in received) for j in range(local)]
        routed = Routed.from_counts(counts, flat.device, self.grouped_gemm and grouped_gemm_runs(flat, *self._features))
        self._routed = routed
        outputs = run_experts(self.experts, torch.cat(by_expert), routed).split([len(p) for p in by_expert])
        back = regions.all_to_all_rows(torch.cat([outputs[j * group.size + s] for s in range(group.size)
                                                  for j in range(local)]), group, here, send)
        return order, back * weights.reshape(-1)[order, None]

    def _combined(self, scaled: torch.Tensor, order: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each token's sum of its choices' rows (`scaled`, in `order`), in expert order as transformers
        adds them: each row is put in its token's slot of that order (a dropped choice's slot, last,
        stays zero), so no index is written twice and the sum is the same on every run (an index_add
        over repeated indices adds in any order on CUDA)."""
        tokens, k = chosen.shape
        place = torch.argsort(torch.argsort(chosen, dim=-1, stable=True), dim=-1)  # a choice's place by expert
        place = (torch.arange(tokens, device=chosen.device)[:, None] * k + place).reshape(-1)
        slots = scaled.new_zeros(tokens * k, scaled.shape[-1]).index_copy(0, place[order], scaled)
        return slots.view(tokens, k, -1).sum(dim=1)  # (its backward a view of the gradient: no [tokens, k, h] per slot)

    @property
    def routed(self) -> list[int]:
        """Tokens each of this rank's experts got in the last forward (for the volumes; a host read)."""
        return [] if self._routed is None else self._routed.counts

    def _count(self, chosen: torch.Tensor, probs: torch.Tensor) -> None:
        """Add a forward's routing to `load`, [experts + 2] float64 (exact counts): the choices each
        expert takes, those dropped over capacity, and the router's entropy summed over the tokens.
        An index_add, not a bincount: CUDA's bincount reads the largest index on the host."""
        flat = chosen.reshape(-1)
        counts = torch.zeros(self.cfg.experts + 1, dtype=torch.float64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        entropy = torch.special.entr(probs.detach()).sum().to(torch.float64)
        mine = torch.cat([counts, entropy[None]])
        self.load = mine if self.load is None else self.load + mine
        if self.router.balance_bias is not None:  # the step's choices, for `balance` (the load is the window's)
            step = counts[: self.cfg.experts]
            self.chosen = step if self.chosen is None else self.chosen + step

    @torch.no_grad()
    def balance(self, counts: torch.Tensor, speed: float | torch.Tensor) -> None:
        """DeepSeek-V3's aux-loss-free balancing: the bias of each expert that took fewer than the mean of
        `counts` (the step's choices per expert, summed over every rank holding other tokens) rises by
        `speed`, of each that took more falls by it; outside the gradient, the same on every rank."""
        self.router.balance_bias += speed * torch.sign(counts.mean() - counts).to(self.router.balance_bias.dtype)

    def take_chosen(self) -> torch.Tensor:
        """This rank's choices per expert since the last take ([experts], float64; zeros if none)."""
        chosen = self.chosen if self.chosen is not None else torch.zeros(
            self.cfg.experts, dtype=torch.float64, device=self.router.weight.device)
        self.chosen = None
        return chosen

    def take_load(self) -> torch.Tensor:
        """`load` since the last take (zeros if no training forward ran), and forget it."""
        load = self.load if self.load is not None else torch.zeros(
            self.cfg.experts + 2, dtype=torch.float64, device=self.router.weight.device)
        self.load = None
        return load

    def _stats(self, logits: torch.Tensor) -> RouterStats:
        """As `load_balancing_loss_func`: the softmax of the logits in their dtype, its top-k again,
        counted and summed in float32 at least."""
        wide = comm.at_least_fp32(logits.dtype)
        probs = F.softmax(logits, dim=-1)
        chosen = torch.topk(probs, self.cfg.top_k, dim=-1).indices
        if is_fake(logits):  # bincount's length depends on the data (see balanced_choices); no values to count
            counts = torch.zeros(self.cfg.experts, dtype=wide, device=logits.device)
        else:
            counts = torch.bincount(chosen.reshape(-1), minlength=self.cfg.experts).to(wide)
        return RouterStats(counts, probs.to(wide).sum(dim=0), len(logits))


def within_capacity(chosen: torch.Tensor, weights: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """[tokens, top_k] bool: the choices each expert takes when it takes at most
    ceil(factor * top_k * tokens / experts) of them, the most heavily weighted first (Megatron's
    capacity with its "probs" drop policy; ties by token order). Counted over the tokens this rank
    routes in a micro-batch (the x and y ranks of a tensor group route the same ones), so a grid
    drops the same choices as any other of the same dp, cp and z. The load-balancing loss still
    counts every choice (as Megatron's, from the routing before the drop)."""
    capacity = math.ceil(factor * chosen.numel() / experts)
    expert = chosen.reshape(-1)
    heaviest = torch.argsort(-weights.reshape(-1), stable=True)
    order = heaviest[torch.argsort(expert[heaviest], stable=True)]  # by expert, then weight, then token
    first = torch.searchsorted(expert[order], torch.arange(experts, device=expert.device))  # each expert's start
    place = torch.arange(len(order), device=expert.device) - first[expert[order]]  # its rank within its expert
    kept = torch.empty_like(expert, dtype=torch.bool)
    kept[order] = place < capacity
    return kept.view_as(chosen)


def router_loss(layers: list[ParallelMoE], grid: Grid, coef: float) -> torch.Tensor:
    """coef * the load-balancing loss of the last forward (transformers' `load_balancing_loss_func`
    over every layer's router and all tokens of the micro-batch): E * sum_e f_e * P_e, f_e the
    fraction of top-k choices that went to expert e, P_e its mean probability, both over the
    rows (layers x tokens). This rank's share: f over every rank holding other tokens, P over its
    own tokens, so that the shares of the (dp, cp, z) ranks add up to the loss and each rank's
    gradient is its part. Counts are summed in float32 at least (in float32: exact up to 2^24
    choices, as transformers')."""
    counts, probs = stage_stats(layers)
    return balance_loss(counts, probs, sum(layer.stats.tokens for layer in layers), grid, coef)


def stage_stats(layers: list[ParallelMoE]) -> torch.Tensor:
    """[2, experts]: the top-k choices per expert and the sums of the router's probabilities of
    these layers' last forward on this rank's tokens (a pipeline stage passes its running sum on)."""
    return torch.stack([sum(layer.stats.counts for layer in layers), sum(layer.stats.probs for layer in layers)])


def balance_loss(counts: torch.Tensor, probs: torch.Tensor, rows: int, grid: Grid, coef: float) -> torch.Tensor:
    """This rank's share of the load-balancing loss from every layer's `stage_stats` summed, over
    `rows` = layers x this rank's tokens (see `router_loss`)."""
    tokens = grid.token_group()
    rows *= tokens.size  # every rank holds as many tokens
    counts = comm.all_reduce(counts.detach().clone(), tokens)
    return coef * (torch.sum((counts / rows) * (probs / rows)) * len(counts))
