"""The Slurm job of one try, as pure functions of the spec and the try's `Launch`: the `sbatch` argument
list and the batch script it runs.

One job of N nodes, one task per node: the batch script (on the job's first node) exports the
rendezvous endpoint (its own host, a port derived from the job id) and `srun` starts `ballast.node` on
every node, whose node rank is Slurm's SLURM_NODEID. The preemption notice is `--signal=TERM@grace`
(recovery.preempt_grace_seconds before the time limit) to every task; recovery's adaptations are the
partition and QoS (on-demand after preemptions) and `--exclude` (the avoid list).

Options go to `sbatch` as arguments, never as `#SBATCH` text; in the script every value is a
`shlex.quote`d word: nothing from the spec, the run or the failure history is read as shell syntax.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

from ballast.backends import RDZV_ENV, Launch
from ballast.errors import ConfigError
from ballast.spec import Spec
from ballast.spec.execution import SlurmSpec

HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,252}")


def _slurm(spec: Spec) -> SlurmSpec:
    s = spec.execution.slurm
    if s is None:
        raise ConfigError("execution.slurm: the slurm backend needs this section (at least partition)")
    return s


def partition_for(s: SlurmSpec, capacity: str) -> tuple[str, str | None]:
    """(partition, QoS) of a try with this capacity."""
    if capacity == "on-demand":
        return s.on_demand_partition or s.partition, s.on_demand_qos or s.qos
    return s.partition, s.qos


def sbatch_argv(spec: Spec, launch: Launch, script: Path, *, log: Path, sbatch: str = "sbatch") -> list[str]:
    """`sbatch` for one try's job, as an argument list."""
    s = _slurm(spec)
    partition, qos = partition_for(s, launch.capacity)
    grace = math.ceil(spec.recovery.preempt_grace_seconds)
    argv = [sbatch, "--parsable", f"--job-name={launch.name}", f"--nodes={launch.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={s.cpus_per_node}", f"--mem={s.memory}", f"--partition={partition}",
            f"--time={s.time_limit_minutes}", f"--signal=TERM@{grace}", "--no-requeue",
            f"--output={log}", "--open-mode=append",
            f"--comment=ballast try {launch.try_number} of {launch.labels.get('dag_id', spec.dag_id)}"]
    if s.gpus_per_node:
        argv.append(f"--gpus-per-node={s.gpus_per_node}")
    if qos:
        argv.append(f"--qos={qos}")
    if s.account:
        argv.append(f"--account={s.account}")
    if launch.avoid_hosts:
        for host in launch.avoid_hosts:
            if not HOST.fullmatch(host):
                raise ConfigError(f"recovery's avoid list: {host!r} is not a host name Slurm can exclude")
        argv.append(f"--exclude={','.join(sorted(launch.avoid_hosts))}")
    argv.append(str(script))
    return argv


def batch_script(spec: Spec, launch: Launch) -> str:
    """The batch script: environment, rendezvous endpoint, and `srun` of the node command on every node."""
    env = {**spec.execution.env, **launch.env}
    if launch.micro_batch_size is not None:
        env["BALLAST_MICRO_BATCH_SIZE"] = str(launch.micro_batch_size)
    lines = [
        "#!/bin/bash",
        f"# Ballast: try {launch.try_number} of {shlex.quote(launch.labels.get('dag_id', spec.dag_id))},"
        f" {launch.nodes} node(s). Generated; every value is quoted.",
        "set -euo pipefail",
        *(f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())),
        # The batch script runs on the job's first node: its host is node 0's rendezvous endpoint.
        f'export {RDZV_ENV}="$(hostname):$((20000 + SLURM_JOB_ID % 10000))"',
        # srun gives each task SLURM_NODEID: `ballast.node` takes it as its node rank.
        "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 --export=ALL " + shlex.join(launch.command),
    ]
    return "\n".join(lines) + "\n"
