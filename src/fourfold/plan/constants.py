"""The step-time model's constants: those of software (`Calibration`, the same on every cluster)
and a hardware `Profile` per cluster the runs were measured on; `constants` joins them for one
evaluation. Fitted by `plan.calibrate`; read by the cost primitives (`plan.costs`) and the model."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from fourfold.spec.hardware import Cluster


@dataclass(frozen=True)
class Profile:
    """Hardware constants fitted to runs on one cluster (`Cluster.name`): they apply to that cluster
    only; any other keeps its preset's measured defaults (`fourfold.spec.hardware`)."""

    cluster: str
    efficiency_max: float  # best fraction of peak a large bf16 GEMM reaches
    efficiency_half: float  # smallest GEMM dimension at which a GEMM runs at half of that
    intra_node_efficiency: float  # collective bus bandwidth / the preset's link peak, inside a node
    inter_node_efficiency: float  # the same across nodes


# The hardware profiles of the shipped runs' clusters, fitted with the defaults below: the GEMMs' best
# efficiency and the NICs' (`calibrate.HARDWARE_KNOBS`); the GEMM curve's half point (the GPU's ridge)
# and NVLink's efficiency are the presets' (`spec.hardware`).
FITTED_A100 = Profile("dgx-a100", efficiency_max=0.8159, efficiency_half=152.94, intra_node_efficiency=0.8,
                      inter_node_efficiency=0.3)
FITTED_H100 = Profile("dgx-h100", efficiency_max=0.7731, efficiency_half=295.22, intra_node_efficiency=0.8,
                      inter_node_efficiency=0.9236)
# every B200 run is FP8: its GEMM figures stand for FP8's too (fp8_speedup is at its bound)
FITTED_B200 = Profile("dgx-b200", efficiency_max=0.9098, efficiency_half=281.25, intra_node_efficiency=0.8,
                      inter_node_efficiency=0.4869)


@dataclass(frozen=True)
class Calibration:
    """The step-time model's fitted constants (`fourfold calibrate`, `--calibrate FILE.json`): those
    of software (the same on every cluster), and a `Profile` of hardware constants per cluster the
    runs were measured on. Each means something physical, so that a fit carries over."""

    # Defaults: fitted to the published Megatron-LM runs (`python benchmarks/planner_calibration.py`,
    # docs/planner.md "Calibration"); UNCALIBRATED below holds the guesses they replace.
    attention_ratio: float = 0.4323  # flash attention's best rate as a fraction of the GEMMs' best (efficiency_max)
    attention_half: float = 512  # keys a query attends in one kernel call at which attention runs at half that rate
    fp8_speedup: float = 1.8  # an FP8 GEMM's speed over a bf16 GEMM of the same shape (runs with FP8 linears)
    ring_overlap: float = 1.0  # fraction of ring attention's traffic that can hide behind block attention
    dp_overlap: float = 0.0  # fraction of the data-parallel reduce-scatter that hides behind the last backward
    param_gather_overlap: float = 0.0  # fraction of the parameter all-gather that hides behind the first forward
    layer_overhead_us: float = 1186  # fixed cost of a layer's forward and backward on a micro-batch (launches)
    micro_batch_overhead_us: float = 10000  # fixed cost of a micro-batch on a pipeline rank (host side: schedule, loss)
    latency_us: float | None = None  # cost of one collective step (None: the cluster preset's)
    cv_error: float | None = 0.0869  # cross-validated mean error of a step time (fraction): leave one source out
    # the same by kind of configuration (cp > 1, else pp > 1, else tensor parallel, else data only):
    # the band within which `plan` cannot tell a candidate of that kind from the fastest
    cv_errors: tuple[tuple[str, float], ...] = (("cp", 0.0635), ("dp", 0.0132), ("pp", 0.0947), ("tp", 0.0176))
    profiles: tuple[Profile, ...] = (FITTED_A100, FITTED_B200, FITTED_H100)  # the clusters the fit was measured on

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """From a JSON file of constants (`fourfold calibrate` writes one; its "fit" record is left
        aside); constants it leaves out keep their defaults."""
        data = json.loads(Path(path).read_text())
        data.pop("fit", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if "bandwidth_factor" in unknown:
            raise ValueError(f"{path}: bandwidth_factor is now two constants: give its value as intra_node_efficiency "
                             f"and inter_node_efficiency, or write the file again with `fourfold calibrate`")
        hardware = sorted(set(unknown) & {f.name for f in dataclasses.fields(Profile)})
        if hardware:
            raise ValueError(f"{path}: {', '.join(hardware)} belong to the cluster they were measured on: give them in "
                             f"`profiles` with the cluster's name, or write the file again with `fourfold calibrate`")
        if unknown:
            raise ValueError(f"{path}: unknown constants {', '.join(unknown)}; the constants are "
                             f"{', '.join(sorted(known))} (`fourfold calibrate` writes them)")
        profiles = tuple(Profile(**p) for p in data.pop("profiles", []))
        errors = tuple((k, float(v)) for k, v in data.pop("cv_errors", []))
        return cls(**data, profiles=profiles, cv_errors=errors)

    def error_band(self, kind: str) -> float:
        """The cross-validated error of a configuration of `kind` (cp, pp, tp, dp), else the overall one."""
        return dict(self.cv_errors).get(kind, self.cv_error or 0.0)

    def widest_band(self) -> float:
        """The largest `error_band` of any kind: how far past a step time a tier can reach."""
        return max([self.cv_error or 0.0, *(e for _, e in self.cv_errors)])

    def profile(self, cluster: Cluster) -> Profile:
        """The hardware constants of `cluster`: fitted on it, else its preset's measured defaults."""
        for p in self.profiles:
            if p.cluster == cluster.name:
                return p
        return Profile(cluster.name, cluster.gpu.gemm_efficiency, cluster.gpu.ridge, cluster.intra_node_efficiency,
                       cluster.inter_node_efficiency)


@dataclass(frozen=True)
class Constants:
    """Every constant of one step-time evaluation: the calibration's software constants and its
    hardware constants for the cluster (`constants`)."""

    efficiency_max: float
    efficiency_half: float
    attention_ratio: float
    attention_half: float
    fp8_speedup: float
    intra_node_efficiency: float
    inter_node_efficiency: float
    ring_overlap: float
    dp_overlap: float
    param_gather_overlap: float
    layer_overhead_us: float
    micro_batch_overhead_us: float
    latency_us: float


@functools.lru_cache(maxsize=1024)
def constants(cal: Calibration, cluster: Cluster) -> Constants:
    p = cal.profile(cluster)
    return Constants(p.efficiency_max, p.efficiency_half, cal.attention_ratio, cal.attention_half, cal.fp8_speedup,
                     p.intra_node_efficiency, p.inter_node_efficiency, cal.ring_overlap, cal.dp_overlap,
                     cal.param_gather_overlap, cal.layer_overhead_us, cal.micro_batch_overhead_us,
                     cluster.latency_us if cal.latency_us is None else cal.latency_us)


# The guesses the model had before any fit (docs/planner.md's "uncalibrated" model): no overheads,
# every overlap perfect, the presets' measured hardware defaults.
UNCALIBRATED = Calibration(attention_ratio=1.0, attention_half=0, fp8_speedup=2.0, ring_overlap=1.0, dp_overlap=1.0,
                           param_gather_overlap=0.0, layer_overhead_us=0.0, micro_batch_overhead_us=0.0,
                           cv_error=None, profiles=())
