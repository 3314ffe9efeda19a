"""GPU and cluster presets. Sources: vendor data sheets and the seed papers (see docs/planner.md,
"Presets"); bandwidths are link peaks, each with the fraction of it a collective reaches (a
published measurement, never a fit: a fit of the step-time model to runs on a cluster is that
cluster's profile in `fourfold.plan.constants.Calibration`). Every figure can be overridden."""

from __future__ import annotations

from dataclasses import dataclass, replace

DEVICES = ("auto", "cpu", "cuda")  # where ranks run (train.device); parallel.grid.choose_device resolves auto


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense peak
    memory_gib: float  # nominal capacity, taken as GiB (as the seed paper does)
    hbm_tbs: float
    gemm_efficiency: float  # best fraction of the peak a large bf16 GEMM reaches (measured, docs/planner.md)
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (0: the GPU has no FP8 tensor cores)
    sms: int = 0  # streaming multiprocessors (compute units), what kernels running side by side share (0: unknown)

    @property
    def ridge(self) -> float:
        """FLOPs per byte of HBM at which a kernel turns from memory- to compute-bound (roofline)."""
        return self.bf16_tflops / self.hbm_tbs


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int
    intra_node_gbs: float  # per GPU, per direction
    inter_node_gbs: float  # per GPU (node NIC bandwidth / GPUs per node)
    latency_us: float = 10.0  # per collective step
    name: str = ""  # the preset's: the profile a calibration fitted on this cluster applies to
    # Fractions of the link peak a collective's bus bandwidth reaches (docs/planner.md, "Presets")
    intra_node_efficiency: float = 0.8
    inter_node_efficiency: float = 0.8


# GEMM efficiency: the maximum achievable matmul FLOP/s measured by Bekman's mamf-finder (A100 SXM
# 0.87, H100 SXM 0.80 of the dense peak); the other Hopper parts take the H100's, the MI250X the
# H100's too (no published figure found: an assumption), and so do the Blackwell parts (B200,
# GB200, GB300: no published mamf-finder figure found either). FP8: the data sheets' dense peaks
# (twice bf16 on Hopper and Blackwell). SMs: the architecture white papers' (A100 108; H100 SXM5 and
# the other GH100 parts 132); the Blackwell parts and the MI250X are left unknown (0).
GPUS = {g.name: g for g in [
    GPU("a100-40gb", 312, 40, 1.56, 0.87, sms=108),
    GPU("a100-80gb", 312, 80, 2.04, 0.87, sms=108),
    GPU("h100-80gb", 989, 80, 3.35, 0.80, 1979, sms=132),
    GPU("h100-94gb", 989, 94, 2.4, 0.80, 1979, sms=132),
    GPU("h100-96gb", 989, 96, 3.35, 0.80, 1979, sms=132),  # the SXM part with 96 GB (torchtitan's, capped at 500 W)
    GPU("h200", 989, 141, 4.8, 0.80, 1979, sms=132),
    GPU("gh200", 989, 96, 4.0, 0.80, 1979, sms=132),
    GPU("b200", 2250, 180, 8.0, 0.80, 4500),  # DGX B200: 1,440 GB over 8 GPUs
    GPU("gb200", 2500, 186, 8.0, 0.80, 5000),
    GPU("gb300", 2500, 279, 8.0, 0.80, 5000),
    GPU("mi250x", 191.5, 64, 1.6, 0.80),  # one GCD
]}

# Link peaks per GPU and direction: NVLink inside a node, the node's NICs / its GPUs between nodes.
CLUSTERS = {name: replace(c, name=name) for name, c in {
    "perlmutter": Cluster(GPUS["a100-40gb"], 4, 300.0, 25.0),  # 12 NVLink3 links; 4 x 200 Gb/s Slingshot
    "frontier": Cluster(GPUS["mi250x"], 8, 50.0, 12.5),
    "alps": Cluster(GPUS["gh200"], 4, 150.0, 25.0),
    "dgx-a100": Cluster(GPUS["a100-80gb"], 8, 300.0, 25.0),  # 12 NVLink3 links; 8 x 200 Gb/s InfiniBand
    "dgx-h100": Cluster(GPUS["h100-80gb"], 8, 450.0, 50.0),  # 18 NVLink4 links; 8 x 400 Gb/s InfiniBand
    "dgx-b200": Cluster(GPUS["b200"], 8, 900.0, 50.0),  # 18 NVLink5 links; 8 x 400 Gb/s InfiniBand
    # NVL72 racks: the NVLink domain (the bandwidth model's node) is the rack's 72 GPUs, not a
    # compute tray's 4; ConnectX-7 (400 Gb/s) per GB200, ConnectX-8 (800 Gb/s) per GB300
    "gb200-nvl72": Cluster(GPUS["gb200"], 72, 900.0, 50.0),
    "gb300-nvl72": Cluster(GPUS["gb300"], 72, 900.0, 100.0),
}.items()}


def make_cluster(cluster: str | None = None, gpu: str | None = None, gpus_per_node: int | None = None,
                 intra_node_gbs: float | None = None, inter_node_gbs: float | None = None,
                 latency_us: float | None = None) -> Cluster:
    """A cluster preset (default dgx-h100), with any field overridden."""
    name = cluster or "dgx-h100"
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(CLUSTERS)}")
    return overridden(CLUSTERS[name], gpu, gpus_per_node, intra_node_gbs, inter_node_gbs, latency_us)


def overridden(c: Cluster, gpu: str | None = None, gpus_per_node: int | None = None,
               intra_node_gbs: float | None = None, inter_node_gbs: float | None = None,
               latency_us: float | None = None) -> Cluster:
    """`c` with the fields given (None: kept)."""
    if gpu is not None:
        if gpu not in GPUS:
            raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(GPUS)}")
        c = replace(c, gpu=GPUS[gpu])
    return replace(c, gpus_per_node=gpus_per_node or c.gpus_per_node, intra_node_gbs=intra_node_gbs or c.intra_node_gbs,
                   inter_node_gbs=inter_node_gbs or c.inter_node_gbs,
                   latency_us=c.latency_us if latency_us is None else latency_us)
