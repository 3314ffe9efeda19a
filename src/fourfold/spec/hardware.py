"""GPU and cluster presets. Sources: vendor data sheets and the seed papers (see docs/planner.md);
figures are peaks unless said otherwise, and every one can be overridden on the command line."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense peak
    memory_gib: float  # nominal capacity, taken as GiB (as the seed paper does)
    hbm_tbs: float


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int
    intra_node_gbs: float  # per GPU, per direction
    inter_node_gbs: float  # per GPU (node NIC bandwidth / GPUs per node)
    latency_us: float = 10.0  # per collective step


GPUS = {g.name: g for g in [
    GPU("a100-40gb", 312, 40, 1.56),
    GPU("a100-80gb", 312, 80, 2.04),
    GPU("h100-80gb", 989, 80, 3.35),
    GPU("h100-94gb", 989, 94, 2.4),
    GPU("h200", 989, 141, 4.8),
    GPU("gh200", 989, 96, 4.0),
    GPU("mi250x", 191.5, 64, 1.6),  # one GCD
]}

# Effective, not link-peak, bandwidths where the seed papers measured them (AxoNN on Perlmutter).
CLUSTERS = {
    "perlmutter": Cluster(GPUS["a100-40gb"], 4, 76.0, 20.0),
    "frontier": Cluster(GPUS["mi250x"], 8, 50.0, 12.5),
    "alps": Cluster(GPUS["gh200"], 4, 150.0, 25.0),
    "dgx-a100": Cluster(GPUS["a100-80gb"], 8, 300.0, 25.0),
    "dgx-h100": Cluster(GPUS["h100-80gb"], 8, 450.0, 50.0),
}


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
