"""What a framework profile decides: the jobs its framework can run, their memory, and the parts
of a step's time it does its own way. The rest of the step (GEMMs, attention, the ring, the data-
parallel collectives, the bubble) is priced alike for every framework by `plan.perf`."""

from __future__ import annotations

from abc import ABC, abstractmethod

from fourfold.models.config import ModelConfig
from fourfold.plan.constants import Constants
from fourfold.plan.memory import Memory
from fourfold.spec.blockspec import BlockConfig
from fourfold.spec.hardware import Cluster
from fourfold.spec.job import Job
from fourfold.spec.rules import Problem
from fourfold.spec.volumes import Collective

# Context parallelism's exchanges (Megatron-Core's cp_comm_type): the ring of K and V blocks ("p2p",
# fourfold's `parallel.context` and Transformer Engine's), K and V all-gathered before attention
# ("all_gather", Llama 3's), or Ulysses' all-to-alls of Q, K, V and the output over heads ("a2a")
CP_COMMS = ("p2p", "all_gather", "a2a")


class Framework(ABC):
    """A training framework as the planner prices it. Subclass it in a module of this package and
    add its instance to `FRAMEWORKS` (fourfold.plan.frameworks)."""

    name: str
    cp_comm: str = "p2p"  # context parallelism's exchange (CP_COMMS)
    keeps_gathered_inputs: bool  # its linears can keep their gathered inputs for backward (a search option)
    # ZeRO-1's parameter all-gather left in flight behind the next forward by the runtime itself (True),
    # or as the calibration or a measured run says (False: `param_gather_overlap`)
    hides_param_gather: bool

    def __repr__(self) -> str:
        return f"<{self.name} profile>"

    @abstractmethod
    def problems(self, cfg: ModelConfig, job: Job) -> list[Problem]:
        """What stops the framework from running `job`, each with its fix (the rules' included)."""

    @abstractmethod
    def runs_grid(self, cfg: ModelConfig, pp: int, x: int, z: int) -> bool:
        """False for a grid no job of the framework runs on (the search skips it before asking `problems`)."""

    @abstractmethod
    def placement_orders(self, cfg: ModelConfig) -> list[tuple[str, ...]]:
        """The placement orders the search tries."""

    @abstractmethod
    def expert_replicas(self, dp: int, cp: int) -> int:
        """The ranks a mixture's experts may be split over (ep divides it)."""

    @abstractmethod
    def virtuals(self, cfg: ModelConfig, pp: int) -> tuple[int, ...]:
        """The stages per pipeline rank the search tries on pp > 1 ranks (1: plain 1F1B)."""

    @abstractmethod
    def published_stages(self, layers: int, chunks: int) -> tuple[int, ...]:
        """The layers per stage a published run of `chunks` stages ran with (): an even split."""

    @abstractmethod
    def memory(self, cfg: ModelConfig, job: Job, memory_gib: float, rule80: bool = True,
               flash_attention: bool = True) -> Memory:
        """Bytes per GPU of `job` (`rule80`: the seed's 80% rule, where the profile has it;
        `flash_attention` False: CPU's math path, where the profile models it)."""

    @abstractmethod
    def attention_split(self, block: BlockConfig, x: int, y: int) -> int:
        """The head groups attention is split into over the (x, y) tensor grid."""

    @abstractmethod
    def head_columns(self, vocab: int, y: int) -> int:
        """The LM head's GEMM columns (the vocabulary as the framework pads it)."""

    @abstractmethod
    def loss_bytes(self, element_bytes: int) -> float:
        """HBM bytes the cross-entropy moves per logit (a token's share of the vocabulary on a rank),
        forward and backward, from logits of `element_bytes`: every elementwise pass of its loss
        over the fp32 logits (they are far larger than the caches)."""

    @abstractmethod
    def update_bytes(self, element_bytes: int) -> tuple[float, float]:
        """HBM bytes of the optimizer step (fp32 master weights and gradients, model weights of
        `element_bytes`): per parameter of the rank's ZeRO-1 shard, and per parameter the rank holds."""

    @abstractmethod
    def accumulate_bytes(self, element_bytes: int) -> tuple[float, float]:
        """HBM bytes a micro-batch's backward moves to add a gradient of `element_bytes` into its fp32
        accumulator outside the weight-gradient GEMM: per parameter of a linear layer (the head's
        too), and per parameter of the embedding table."""

    @abstractmethod
    def tensor_comm(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, forward_seconds: float,
                    gemm_tflops: float, gemm_overlap: bool = False) -> float:
        """Exposed tensor-parallel communication of one layer for one micro-batch (forward,
        backward, and the forward again under full recompute); `forward_seconds`: the layer's
        forward; `gemm_tflops`: the linear layers' peak; `gemm_overlap`: a measured run's tensor
        collectives pipelined with their GEMMs (`RunTraits.tp_comm_overlap`, where the profile has it)."""

    @abstractmethod
    def head_comm(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, tokens: int) -> float:
        """The embedding's and the LM head's collectives for one micro-batch of `tokens` on a rank."""

    @abstractmethod
    def pipeline_sends(self, cfg: ModelConfig, s: Job, tokens: float) -> list[Collective]:
        """What a pipeline stage sends the next for one micro-batch of `tokens` on a rank (its activation shard)."""

    @abstractmethod
    def tied_seconds(self, cfg: ModelConfig, s: Job, cluster: Cluster, k: Constants, bubble: float) -> float:
        """A tied embedding over pipeline stages, once per step: the exposed seconds."""
