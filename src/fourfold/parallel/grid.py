"""The process grid on torch.distributed: a DeviceMesh over the six dims and a Group per dim.

A `Grid` is an ordinary object passed to whatever needs communication; there is no global
handle. It owns the `Ledger` that every collective on its groups writes to.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from fourfold.parallel.clock import Clock
from fourfold.parallel.comm import Group, Ledger
from fourfold.spec.hardware import DEVICES
from fourfold.spec.layout import DIMS, GridError, Layout, _as_dims

# A test double: the GPUs `train.device auto` sees, on any box. `FOURFOLD_FAKE_GPUS=8 pytest` on
# a CPU machine makes every test that does not hide the GPUs (tests/conftest.py) choose CUDA and
# fail, as it would on a GPU box (docs/architecture.md, Tests).
FAKE_GPUS = "FOURFOLD_FAKE_GPUS"


def visible_gpus() -> int:
    """The GPUs this process may use: none when CUDA_VISIBLE_DEVICES is empty (also after CUDA
    started, when torch's own count no longer reads it)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    if os.environ.get(FAKE_GPUS):
        return int(os.environ[FAKE_GPUS])
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(choice: str, local_ranks: int) -> str:
    """"cuda" or "cpu" for `local_ranks` ranks per node, from train.device: "auto" takes CUDA
    when every rank has a visible GPU of its own and CPU when there is none. Raises GridError
    naming the fix when the GPUs are too few (before launch, or every rank past the GPUs' count
    would fail on its device ordinal)."""
    if choice not in DEVICES:
        raise GridError(f"device {choice!r} is none of {', '.join(DEVICES)}; use one of them")
    gpus = visible_gpus()
    if choice == "cpu" or choice == "auto" and gpus == 0:
        return "cpu"
    if gpus == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise GridError(f"device cuda, but torch {torch.__version__} ({build}) sees no GPU; use --train.device cpu, "
                        f"or install a CUDA build of torch (see README, Install)")
    if local_ranks > gpus:
        raise GridError(f"{local_ranks} ranks per node but {gpus} visible GPU{'s' * (gpus > 1)}: NCCL needs a GPU per "
                        f"rank; use --train.device cpu (gloo, CPU processes), or a grid of at most {gpus} ranks "
                        f"per node")
    return "cuda"


def order_kernel_launches(environ=os.environ) -> None:
    """One hardware queue per GPU (CUDA_DEVICE_MAX_CONNECTIONS=1, unless the user set it): kernels start
    in the order they were launched, so a collective launched before a GEMM (the tensor-parallel
    overlaps of `parallel.overlap`) starts first and runs beside it, instead of waiting for the SMs
    the GEMM took. Megatron-LM sets the same for its tensor-parallel overlap. Read when the CUDA
    context is created: set before."""
    environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def init_process_group(timeout_s: float = 600.0, device: str = "auto", tensor_overlap: bool = False) -> None:
    """Join the job torchrun started: NCCL with this rank's GPU, or gloo on CPU, as `choose_device`
    resolves `device` (train.device) for the node's ranks. `tensor_overlap`: the job overlaps
    tensor-parallel collectives with GEMMs (`order_kernel_launches` on GPUs)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise GridError("no torchrun environment (RANK is not set); launch with `torchrun --nproc-per-node N ...`")
    cuda = None
    if choose_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) == "cuda":
        if tensor_overlap:
            order_kernel_launches()
        cuda = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(cuda)
        backend = "nccl"
    else:
        backend = "gloo"
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        # With the device named, NCCL's communicator is bound to it and DeviceMesh creates each
        # dim's groups with one communicator split instead of one creation per group.
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=cuda)
        return
    # After a torchrun restart the agent's store still holds the previous round's addresses
    # under the same keys (gloo then connects to dead ports): give this round its own prefix.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=dist.PrefixStore(f"fourfold-restart-{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=timeout_s), device_id=cuda)


class Grid:
    """dp x pp x cp x (x, y, z) over the ranks of the default process group."""

    def __init__(self, layout: Layout):
        if not dist.is_initialized():
            raise GridError(
                "torch.distributed is not initialised; launch with torchrun and call "
                "fourfold.parallel.grid.init_process_group() before building a Grid"
            )
        world = dist.get_world_size()
        if layout.world_size != world:
            raise GridError(
                f"grid {layout} has {layout.world_size} ranks but the job has {world}; "
                f"choose sizes whose product dp*pp*cp*x*y*z is {world}, or launch {layout.world_size} ranks"
            )
        self.layout = layout
        self.ledger = Ledger()
        nccl = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.clock = Clock(self.device)  # this rank's waits in its groups' collectives, by kind
        ranks = torch.arange(world).reshape([getattr(layout, d) for d in layout.mesh_order])
        self.mesh = DeviceMesh(self.device.type, ranks, mesh_dim_names=layout.mesh_order)
        self.rank = dist.get_rank()
        self.coords = layout.coords(self.rank)
        self._groups: dict[tuple[str, ...], Group] = {}
        self._expert_groups: dict[str, Group] = {}

    @classmethod
    def parse(cls, text: str, order: str | None = None) -> "Grid":
        return cls(Layout.parse(text, order))

    def size(self, dims: str | Iterable[str]) -> int:
        return self.layout.size(dims)

    def group(self, dims: str | Iterable[str]) -> Group:
        """The group along one dim ('x') or several (('dp', 'cp')) that holds this rank.

        Combined dims are ordered innermost first, so group ranks match `Layout.group_ranks`.
        Every rank must ask for the same combined groups in the same order (they are created
        collectively on first use).
        """
        key = tuple(sorted(_as_dims(dims), key=self.layout.order.index))
        if key not in self._groups:
            self._groups[key] = self._build_group(key)
        return self._groups[key]

    # ----- groups by role (as torchtitan's parallel_dims names its meshes) ------------------------
    def loss_group(self) -> Group:
        """The ranks holding different tokens' losses (dp, pp, cp, z): a loss summed over them is
        the global batch's (on ranks without the last pipeline stage, theirs is zero)."""
        return self.group(("dp", "pp", "cp", "z"))

    def token_group(self) -> Group:
        """The ranks holding different tokens of the same layer (dp, cp, z): a mixture's routing
        statistics are summed over them."""
        return self.group(("dp", "cp", "z"))

    def replica_group(self) -> Group:
        """The ranks holding the same (dense) parameters (dp, cp): their gradients are summed, their
        optimizer state is sharded, their checkpoint writes are shared."""
        return self.group(("dp", "cp"))

    def world_group(self) -> Group:
        """Every rank (all six dims): a global gradient norm is summed over it."""
        return self.group(DIMS)

    def _build_group(self, dims: tuple[str, ...]) -> Group:
        name = "_".join(dims)
        # Dims of size 1 add no rank: a combined group over them is the group of the other dims
        # under its own name (its ledger entries keep it), not a copy of that communicator (NCCL
        # bound to a device builds each one eagerly, with its own buffers).
        others = tuple(d for d in dims if self.layout.size(d) > 1) or dims[:1]
        if others != dims:
            same = self.group(others)
            return Group(name, same.process_group, same.ranks, same.rank, self.ledger, self.clock)
        if len(dims) == 1:
            process_group = self.mesh.get_group(dims[0])
        elif self.layout.size(dims) == self.layout.world_size:
            # Every rank, numbered as the global ranks (the mesh is the ranks in order): the
            # default group, not a second world-sized communicator (the gradient norm's group).
            process_group = dist.group.WORLD
        else:
            # DeviceMesh's own flattening: one split of the parent communicator where the backend
            # can split (NCCL bound to a device), otherwise one cheap call per group; never a Python
            # enumeration of every group's ranks. Mesh order is outermost first, so the flattened
            # rank runs innermost-fastest, as Layout.group_ranks numbers it.
            outer_first = tuple(d for d in self.layout.mesh_order if d in dims)
            with unset_fake_temporarily():  # the mesh's rank tensor is real, also under `simulate`'s fake mode
                process_group = self.mesh[outer_first]._flatten(name).get_group()
        ranks = tuple(dist.get_process_group_ranks(process_group))
        expected = tuple(self.layout.group_ranks(dims, self.rank))
        if ranks != expected:  # the one place the two layouts meet: fail loudly if they ever differ
            raise RuntimeError(f"group {name}: DeviceMesh ranks {ranks} differ from the layout's {expected}")
        return Group(name, process_group, ranks, ranks.index(self.rank), self.ledger, self.clock)

    def expert_group(self, kind: str) -> Group:
        """Expert parallelism's groups within this rank's dp*cp group (see `Layout`): "ep", the ep
        ranks that exchange tokens (consecutive dp*cp group ranks), or "edp", the dp*cp/ep ranks that
        hold the same experts (their gradients are summed over it). Collective on first use."""
        if kind not in ("ep", "edp"):
            raise ValueError(f"expert group {kind!r} is neither 'ep' nor 'edp'")
        if kind not in self._expert_groups:
            self._expert_groups.update(self._build_expert_groups())
        return self._expert_groups[kind]

    def _build_expert_groups(self) -> dict[str, Group]:
        data, ep = self.group(("dp", "cp")), self.layout.ep
        at = data.rank // ep * ep
        expected = {"ep": data.ranks[at : at + ep], "edp": data.ranks[data.rank % ep :: ep]}
        if ep == 1 or ep == data.size:  # one of the two is the dp*cp group, the other this rank alone
            whole, alone = ("edp", "ep") if ep == 1 else ("ep", "edp")
            return {whole: Group(whole, data.process_group, data.ranks, data.rank, self.ledger, self.clock),
                    alone: Group(alone, None, (self.rank,), 0, self.ledger, self.clock)}
        # The dp*cp mesh dim the data group came from (a dim of its own when the other has size 1;
        # else the flattened one, under the group's name, which DeviceMesh reuses: no new communicator)
        big = tuple(d for d in self.layout.mesh_order if d in ("dp", "cp") and self.layout.size(d) > 1)
        with unset_fake_temporarily():
            flat = self.mesh[big[0]] if len(big) == 1 else self.mesh[big]._flatten(data.name)
            mesh = flat._unflatten(0, (data.size // ep, ep), ("edp", "ep"))
        out = {}
        for kind in ("ep", "edp"):
            process_group = mesh.get_group(kind)
            ranks = tuple(dist.get_process_group_ranks(process_group))
            if ranks != expected[kind]:
                raise RuntimeError(f"group {kind}: DeviceMesh ranks {ranks} differ from the layout's {expected[kind]}")
            out[kind] = Group(kind, process_group, ranks, ranks.index(self.rank), self.ledger, self.clock)
        return out

    def __repr__(self) -> str:
        coords = ",".join(f"{d}={self.coords[d]}" for d in DIMS)
        return f"Grid({self.layout}, rank {self.rank} at {coords})"
