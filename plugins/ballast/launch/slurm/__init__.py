"""The Slurm backend: `sbatch` one job of N nodes, follow its state and its output file, `scancel` it.

The commands are Slurm's own clients (sbatch, scontrol, scancel, sacct), run as argument lists; the
cluster is whichever they reach (SLURM_CONF in the environment, as for any Slurm user). What a job
is made of is `slurm.script`; what its end means is `slurm.status`. sbatch gets the job's own
environment (`slurm_script.job_environment`, with the worker's SLURM_* to find the cluster), never
the worker's; the batch script, which holds execution.env's values, is its owner's alone from the start.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast.launch import Ending, Launch
from ballast.launch.slurm import script as slurm_script, status as slurm_status
from ballast.errors import ConfigError, LaunchError
from ballast.spec import Spec

COMMAND_TIMEOUT = 60.0


class SlurmBackend:
    name = "slurm"
    stop_wait_seconds = 60.0
    """How long `stop` waits for a scancelled job to leave Slurm's running states (KillWait and the
    epilog included); past it the job may still run, and its lease stays."""
    state_misses = 5
    """Polls in a row whose `scontrol` fails before a running try gives up on the job (class communication)."""

    def __init__(self, spec: Spec, job_dir: Path, log: Any):
        self.spec, self.job_dir, self.log = spec, Path(job_dir), log
        self.slurm = spec.execution.slurm

    def start(self, launch: Launch) -> dict[str, Any]:
        self.job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = slurm_script.job_environment(self.spec, os.environ, storage_credentials=self._storage_credentials())
        script = self.job_dir / f"{launch.name}.sh"
        _write_private(script, slurm_script.batch_script(self.spec, launch, export=env))
        log = self.job_dir / f"{launch.name}.log"
        argv = slurm_script.sbatch_argv(self.spec, launch, script, log=log, export=env)
        self.log.info("submitting: %s", " ".join(argv))  # names only: the values are in sbatch's environment
        # sbatch's own input (SLURM_CONF, SBATCH_ACCOUNT, ...) reaches sbatch, never the job: --export names it not.
        own = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "SBATCH_"))}
        out = _run(argv, env={**own, **env})
        if out.returncode != 0:
            raise self._submit_error(out.stderr.strip() or out.stdout.strip(), launch)
        job_id = out.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise LaunchError(f"sbatch printed {out.stdout.strip()!r}, not a job id", failure_class="unknown")
        self.log.info("Slurm job %s (%s): %d node(s)", job_id, launch.name, launch.nodes)
        return {"backend": self.name, "job_id": job_id, "name": launch.name, "log": str(log),
                "try_number": launch.try_number}

    def _storage_credentials(self) -> dict[str, str] | None:
        """S3 storage through an Airflow connection: its keys, region and endpoint as boto3's environment
        (a node has no Airflow connections; the node's job file names none)."""
        st = self.spec.storage
        if not st.uri.startswith("s3://") or not st.conn_id:
            return None
        from ballast.storage.s3 import _s3_connection_kwargs

        kwargs = _s3_connection_kwargs(st.conn_id)
        names = {"aws_access_key_id": "AWS_ACCESS_KEY_ID", "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
                 "region_name": "AWS_DEFAULT_REGION", "endpoint_url": "AWS_ENDPOINT_URL_S3"}
        return {names[k]: str(v) for k, v in kwargs.items() if k in names and v}

    def _submit_error(self, said: str, launch: Launch) -> BaseException:
        partition, qos = slurm_script.partition_for(self.slurm, launch.capacity)
        field = "on_demand_partition" if launch.capacity == "on-demand" and self.slurm.on_demand_partition else "partition"
        if "invalid partition" in said.lower():
            return ConfigError(f"execution.slurm.{field}: Slurm has no partition {partition!r} (sbatch: {said});"
                               f" set it to one that `sinfo -s` lists")
        if "invalid qos" in said.lower():
            return ConfigError(f"execution.slurm.qos: Slurm refused QoS {qos!r} (sbatch: {said})")
        if "invalid account" in said.lower():
            return ConfigError(f"execution.slurm.account: Slurm refused account {self.slurm.account!r} (sbatch: {said})")
        if "requested node configuration is not available" in said.lower():
            return ConfigError(f"execution.slurm: no nodes of partition {partition!r} can hold"
                               f" {launch.nodes} x (cpus {self.slurm.cpus_per_node}, mem {self.slurm.memory},"
                               f" gpus {self.slurm.gpus_per_node}) (sbatch: {said})")
        return LaunchError(f"sbatch failed: {said}", failure_class="unknown")

    def state(self, handle: dict[str, Any]) -> dict[str, str] | None:
        """The job's fields (JobState, Reason, ExitCode, NodeList...), or None once Slurm forgot it.
        LaunchError (communication) when Slurm did not say: a controller that does not answer is no
        sign that the job has ended."""
        out = _run(["scontrol", "show", "job", "-o", handle["job_id"]])
        if out.returncode == 0 and out.stdout.strip():
            return slurm_status.parse_show_job(out.stdout)
        acct = _run(["sacct", "-n", "-P", "-X", "-j", handle["job_id"], "-o", "State,ExitCode,NodeList,Reason"])
        if acct.returncode == 0 and acct.stdout.strip():
            state, code, nodes, reason = (acct.stdout.strip().splitlines()[0].split("|") + ["", "", "", ""])[:4]
            return {"JobState": state, "ExitCode": code, "NodeList": nodes, "Reason": reason or "None"}
        if out.returncode == 0 or "invalid job id" in out.stderr.lower():
            return None
        raise LaunchError(f"scontrol show job {handle['job_id']} failed: {out.stderr.strip() or out.stdout.strip()}",
                          failure_class="communication")

    def wait(self, handle: dict[str, Any], *, on_line: Callable[[str], Any], should_stop: Callable[[], bool]) -> Ending:
        relay, misses = _Tail(Path(handle["log"])), 0
        while True:
            for line in relay.lines():
                on_line(line)
            if should_stop():
                ended = self.stop(handle, reason="cancelled")
                return Ending(None, reason="CANCELLED (by Ballast)", cancelled=True, left_running=not ended)
            try:
                fields = self.state(handle)
                misses = 0
            except LaunchError as exc:  # one slow answer of the controller is no reason to end a healthy job
                misses += 1
                if misses >= self.state_misses:
                    raise
                self.log.warning("%s (%d of %d tries)", exc, misses, self.state_misses)
                time.sleep(self.slurm.poll_seconds)
                continue
            if fields is None:
                return Ending(None, reason=f"Slurm has no record of job {handle['job_id']} any more")
            end = slurm_status.ending(fields)
            if end is not None:
                time.sleep(0.2)  # the last lines of the output file
                for line in relay.lines():
                    on_line(line)
                return end
            time.sleep(self.slurm.poll_seconds)

    def stop(self, handle: dict[str, Any], *, reason: str = "") -> bool:
        """scancel the job (Slurm signals every step, then SIGKILLs after KillWait) and wait until it
        has left the running states (COMPLETING included: its processes are gone then); False if it
        had not within `stop_wait_seconds`, or Slurm would not say."""
        out = _run(["scancel", handle["job_id"]])
        if out.returncode != 0:
            self.log.warning("scancel %s: %s", handle["job_id"], out.stderr.strip() or out.stdout.strip())
        deadline = time.monotonic() + self.stop_wait_seconds
        while True:
            try:
                fields = self.state(handle)
                if fields is None or (fields.get("JobState") or "?").split()[0] in slurm_status.TERMINAL:
                    return True
            except LaunchError as exc:
                self.log.warning("%s", exc)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        self.log.error("Slurm job %s had not ended %.0f s after scancel; it may still run", handle["job_id"],
                       self.stop_wait_seconds)
        return False

    def lease(self, handle: dict[str, Any]) -> dict[str, Any]:
        return handle  # what `stop` needs of the job, for the next try (the driver's lease)

    def describe(self, handle: dict[str, Any]) -> dict[str, Any]:
        return {"job": handle["job_id"]}


class _Tail:
    """New lines of a growing file (the job's --output)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        text = self.partial + data.decode("utf-8", "replace")
        *done, self.partial = text.split("\n")
        return done


def _write_private(path: Path, text: str) -> None:
    """Write `path` as its owner's alone from its first byte (created 0700, never made private after):
    a leftover of that name, or anything planted there (a link), is removed first."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A Slurm client; `env`: its whole environment (sbatch's is the job's), else the worker's."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                              env=os.environ.copy() if env is None else env)
    except FileNotFoundError as exc:
        raise ConfigError(f"execution.backend: slurm, but {argv[0]!r} is not on PATH here: the Airflow worker"
                          f" needs Slurm's client commands and the cluster's slurm.conf") from exc
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"{argv[0]} did not answer within {COMMAND_TIMEOUT:.0f}s", failure_class="communication") from exc
