"""`fourfold slurm`: an sbatch script that runs a training config with torchrun on every node."""

from __future__ import annotations

import shlex
import sys
import unicodedata

from fourfold.trainconfig import ConfigError


def _refuse_control_characters(name: str, value: str) -> None:
    """A newline in a value would end its #SBATCH line and start a live shell line (and sbatch
    stops reading directives there); no control character belongs in a job's options."""
    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    if bad:
        raise ConfigError(f"{name} {value!r} contains the control character {bad[0]!r}; give it on one line "
                          f"without control characters")


def sbatch_script(config: str, overrides: list[str], *, nodes: int, gpus_per_node: int, job_name: str = "fourfold",
                  time: str = "24:00:00", partition: str = "", account: str = "", max_restarts: int = 3,
                  port: int = 29500) -> str:
    """The script's text; every user value is shell-quoted, and refused if it holds a control character."""
    values = {"--job-name": job_name, "--time": time, "--partition": partition, "--account": account, "config": config}
    values.update({f"override {i}": v for i, v in enumerate(overrides)})
    for name, value in values.items():
        _refuse_control_characters(name, value)
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={q(job_name)}",
        f"#SBATCH --nodes={int(nodes)}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={int(gpus_per_node)}",
        f"#SBATCH --time={q(time)}",
    ]
    lines += [f"#SBATCH --partition={q(partition)}"] if partition else []
    lines += [f"#SBATCH --account={q(account)}"] if account else []
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={int(nodes)}",
                f"--nproc-per-node={int(gpus_per_node)}", f"--max-restarts={int(max_restarts)}", "--rdzv-backend=c10d"]
    rendezvous = f'"--rdzv-id=$SLURM_JOB_ID" "--rdzv-endpoint=$HEAD:{int(port)}"'  # expanded by the shell, on purpose
    user = ["-m", "fourfold.cli", "train", config, *overrides]
    quoted = " ".join([*map(q, launcher), rendezvous, *map(q, user)])
    lines += [
        "set -euo pipefail",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
        f"srun --kill-on-bad-exit=1 {quoted}",
        "",
    ]
    return "\n".join(lines)
