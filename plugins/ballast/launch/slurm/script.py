"""The Slurm job of one try, as pure functions of the spec and the try's `Launch`: the `sbatch` argument
list and the batch script it runs.

One job of N nodes, one task per node: the batch script (on the job's first node) exports the
rendezvous endpoint (its own host, a port derived from the job id) and `srun` starts `ballast.node` on
every node, whose node rank is Slurm's SLURM_NODEID. The preemption notice is `--signal=TERM@grace`
(recovery.preempt_grace_seconds before the time limit) to every task; recovery's adaptations are the
partition and QoS (on-demand after preemptions) and `--exclude` (the avoid list).

Options go to `sbatch` as arguments, never as `#SBATCH` text; in the script every value is a
`shlex.quote`d word: nothing from the spec, the run or the failure history is read as shell syntax.

The job's environment is a list, never the worker's whole environment (sbatch's default, which put the
JWT secret, the Fernet key, the database URL and every AIRFLOW_CONN_* on every node and into the job
Slurm stores): `job_environment` says what a node needs, `sbatch --export=` and `srun --export=` name
exactly that (names only: the values travel in sbatch's environment, not in an argument anyone can read
in `ps`), and Slurm adds its own SLURM_* variables.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from ballast.launch import RDZV_ENV, Launch
from ballast.errors import ConfigError
from ballast.spec import Spec
from ballast.spec.execution import SlurmSpec

HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,252}")
BASICS = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR")
"""What any process expects of its environment (the nodes' Python is found on PATH)."""
AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
           "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "AWS_PROFILE", "AWS_CONFIG_FILE",
           "AWS_SHARED_CREDENTIALS_FILE")
"""boto3's environment: the nodes' way to S3 storage, sent only when storage is on S3."""
AWS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
"""The worker's own identity, left out when the storage connection gives the node one (no mixed pairs)."""
NETWORK = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "SSL_CERT_FILE",
           "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")
"""The way out to S3 behind a proxy or a private CA, sent with the S3 variables. Anything else a
cluster's nodes need (PYTHONPATH, LD_LIBRARY_PATH, a virtualenv) is the spec's `execution.env`."""


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


def job_environment(spec: Spec, worker_env: Mapping[str, str], *,
                    storage_credentials: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a node needs of the worker's environment, and nothing else of it: the basics, Ballast's own
    BALLAST_* variables and, where storage is on S3, its credentials (`storage_credentials`, from the
    storage's Airflow connection, over the worker's AWS_* variables). execution.env is the script's."""
    env = {name: worker_env[name] for name in BASICS if worker_env.get(name)}
    env.setdefault("PATH", os.defpath)
    env.update({name: value for name, value in worker_env.items() if name.startswith("BALLAST_")})
    if spec.storage.uri.startswith("s3://"):
        skip = AWS_CREDENTIALS if storage_credentials else ()
        env.update({name: worker_env[name] for name in (*AWS_ENV, *NETWORK) if worker_env.get(name)
                    and name not in skip})
        env.update(storage_credentials or {})
    return env


def export_option(names: Iterable[str]) -> str:
    """`--export=` of sbatch and srun: these variables (and Slurm's SLURM_*), never ALL or NONE."""
    names = sorted(set(names))
    if not names:
        raise ValueError("a Slurm job exports at least PATH")
    return "--export=" + ",".join(names)


def sbatch_argv(spec: Spec, launch: Launch, script: Path, *, log: Path, export: Iterable[str],
                sbatch: str = "sbatch") -> list[str]:
    """`sbatch` for one try's job, as an argument list; `export`: the names of `job_environment`."""
    s = _slurm(spec)
    partition, qos = partition_for(s, launch.capacity)
    grace = math.ceil(spec.recovery.preempt_grace_seconds)
    argv = [sbatch, "--parsable", f"--job-name={launch.name}", f"--nodes={launch.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={s.cpus_per_node}", f"--mem={s.memory}", f"--partition={partition}",
            f"--time={s.time_limit_minutes}", f"--signal=TERM@{grace}", "--no-requeue",
            f"--output={log}", "--open-mode=append", export_option(export),
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


def batch_script(spec: Spec, launch: Launch, *, export: Iterable[str]) -> str:
    """The batch script: environment, rendezvous endpoint, and `srun` of the node command on every node,
    which gets what sbatch exported (`export`) and what the script sets, nothing else."""
    env = {**spec.execution.env, **launch.env}
    lines = [
        "#!/bin/bash",
        f"# Ballast: try {launch.try_number} of {shlex.quote(launch.labels.get('dag_id', spec.dag_id))},"
        f" {launch.nodes} node(s). Generated; every value is quoted.",
        "set -euo pipefail",
        *(f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())),
        # The batch script runs on the job's first node: its host is node 0's rendezvous endpoint.
        f'export {RDZV_ENV}="$(hostname):$((20000 + SLURM_JOB_ID % 10000))"',
        # srun gives each task SLURM_NODEID: `ballast.node` takes it as its node rank.
        "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 "
        + shlex.join([export_option([*export, *env, RDZV_ENV]), *launch.command]),
    ]
    return "\n".join(lines) + "\n"
