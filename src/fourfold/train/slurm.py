"""`fourfold slurm`: an sbatch script that runs a training config with torchrun on every node."""

from __future__ import annotations

import shlex
import sys
import unicodedata

from fourfold.config import ConfigError


def _refuse_control_characters(name: str, value: str) -> None:
    """A newline in a value would end its #SBATCH line and start a live shell line (and sbatch
    stops reading directives there); no control character belongs in a job's options."""
    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    if bad:
        raise ConfigError(f"{name} {value!r} contains the control character {bad[0]!r}; give it on one line "
                          f"without control characters")


STOP_WARNING_S = 300  # SLURM sends SIGTERM this long before the time limit: the ranks save and stop


def sbatch_script(config: str, overrides: list[str], *, nodes: int, gpus_per_node: int, cpus_per_task: int,
                  run_dir: str, workdir: str, job_name: str = "fourfold", time: str = "24:00:00", partition: str = "",
                  account: str = "", max_restarts: int = 3, min_nodes: int = 0) -> str:
    """The script's text: one task per node runs torchrun for its GPUs (c10d rendezvous on the first
    node, a port derived from the job id) on `config` (empty: the defaults) with `overrides`.
    `run_dir` (the job's output and error files) and `workdir` (where the job runs, so relative
    paths in the config mean what they meant when it was checked) are absolute. `min_nodes` below
    `nodes` (grid.elastic): torchrun's elastic form, `--nnodes MIN:MAX`, so that a restart goes on
    with the nodes left. Every user value is shell-quoted, and refused if it holds a control character."""
    values = {"--job-name": job_name, "--time": time, "--partition": partition, "--account": account, "config": config,
              "run directory": run_dir, "working directory": workdir}
    values.update({f"override {i}": v for i, v in enumerate(overrides)})
    for name, value in values.items():
        _refuse_control_characters(name, value)
    q, gpus = shlex.quote, int(gpus_per_node)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={q(job_name)}",
        f"#SBATCH --nodes={int(nodes)}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus}",
        f"#SBATCH --cpus-per-task={int(cpus_per_task)}",
        "#SBATCH --exclusive",
        f"#SBATCH --time={q(time)}",
        f"#SBATCH --signal=TERM@{STOP_WARNING_S}",
        f"#SBATCH --chdir={q(workdir)}",
        f"#SBATCH --output={q(run_dir + '/slurm-%j.out')}",
        f"#SBATCH --error={q(run_dir + '/slurm-%j.err')}",
    ]
    elastic = 0 < min_nodes < nodes
    # elastic: a node that fails ends its own task, not the job (the rendezvous host, the first node, must stay)
    lines += ["#SBATCH --no-kill"] if elastic else []
    lines += [f"#SBATCH --partition={q(partition)}"] if partition else []
    lines += [f"#SBATCH --account={q(account)}"] if account else []
    # torchrun through fourfold.train.launch: on a signal it leaves the ranks to stop (and save), quietly
    span = f"{int(min_nodes)}:{int(nodes)}" if elastic else f"{int(nodes)}"
    launcher = [sys.executable, "-m", "fourfold.train.launch", f"--nnodes={span}",
                f"--nproc-per-node={gpus}", f"--max-restarts={int(max_restarts)}", "--rdzv-backend=c10d"]
    rendezvous = '"--rdzv-id=$SLURM_JOB_ID" "--rdzv-endpoint=$HEAD:$PORT"'  # expanded by the shell, on purpose
    user = ["-m", "fourfold.cli.main", "train", *([config] if config else []), *overrides]
    quoted = " ".join([*map(q, launcher), rendezvous, *map(q, user)])
    lines += [
        "#",
        "# Written by `fourfold slurm`. The compute nodes run the Python named on the srun line: load modules",
        "# or activate its environment here if they need it. A SIGTERM (scancel, or the --signal above before",
        "# the time limit) makes every rank finish its step and save a checkpoint; sbatch this again to resume.",
        "set -euo pipefail",
        # (awk reads the whole list: `head -n 1` would close the pipe early, and with pipefail the
        # SIGPIPE that scontrol gets on a long node list would end the job)
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')',
        "PORT=$((29500 + SLURM_JOB_ID % 10000))  # the rendezvous port: jobs sharing a first node do not collide",
        f"THREADS=$(( ${{SLURM_CPUS_PER_TASK:-{gpus}}} / {gpus} ))  # the task's CPUs over its ranks",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}",
        "# NCCL: change these here or in the environment sbatch is called from. On nodes with several",
        "# networks name the one between nodes, e.g. NCCL_SOCKET_IFNAME=ib0 (or =^lo,docker0 to exclude",
        "# some) and, for InfiniBand, NCCL_IB_HCA=mlx5; NCCL_DEBUG=INFO shows what NCCL picked.",
        "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
        "# export NCCL_SOCKET_IFNAME=ib0",
        "# export NCCL_IB_HCA=mlx5",
        "# how long torchrun waits for the ranks to save after a SIGTERM before it kills them",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{STOP_WARNING_S - 60}}}",
        # srun does not pass sbatch's --cpus-per-task on to its tasks (SLURM >= 22.05): ask again
        f"srun --kill-on-bad-exit={0 if elastic else 1} --cpus-per-task={int(cpus_per_task)} {quoted}",
        "",
    ]
    return "\n".join(lines)
