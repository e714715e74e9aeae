"""The Slurm backend: `sbatch` one job of N nodes, follow its state and its output file, `scancel` it.

The commands are Slurm's own clients (sbatch, scontrol, scancel, sacct), run as argument lists; the
cluster is whichever they reach (SLURM_CONF in the environment, as for any Slurm user). What a job
is made of is `slurm_script`; what its end means is `slurm_status`.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast.backends import Ending, Launch, slurm_script, slurm_status
from ballast.errors import ConfigError, LaunchError
from ballast.spec import Spec

COMMAND_TIMEOUT = 60.0


class SlurmBackend:
    name = "slurm"

    def __init__(self, spec: Spec, job_dir: Path, log: Any):
        self.spec, self.job_dir, self.log = spec, Path(job_dir), log
        self.slurm = spec.execution.slurm

    def start(self, launch: Launch) -> dict[str, Any]:
        self.job_dir.mkdir(parents=True, exist_ok=True)
        script = self.job_dir / f"{launch.name}.sh"
        script.write_text(slurm_script.batch_script(self.spec, launch))
        script.chmod(0o700)
        log = self.job_dir / f"{launch.name}.log"
        argv = slurm_script.sbatch_argv(self.spec, launch, script, log=log)
        self.log.info("submitting: %s", " ".join(argv))
        out = _run(argv)
        if out.returncode != 0:
            raise self._submit_error(out.stderr.strip() or out.stdout.strip(), launch)
        job_id = out.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise LaunchError(f"sbatch printed {out.stdout.strip()!r}, not a job id", failure_class="unknown")
        self.log.info("Slurm job %s (%s): %d node(s)", job_id, launch.name, launch.nodes)
        return {"backend": self.name, "job_id": job_id, "name": launch.name, "log": str(log),
                "try_number": launch.try_number}

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
        """The job's fields (JobState, Reason, ExitCode, NodeList...), or None once Slurm forgot it."""
        out = _run(["scontrol", "show", "job", "-o", handle["job_id"]])
        if out.returncode == 0 and out.stdout.strip():
            return slurm_status.parse_show_job(out.stdout)
        acct = _run(["sacct", "-n", "-P", "-X", "-j", handle["job_id"], "-o", "State,ExitCode,NodeList,Reason"])
        if acct.returncode == 0 and acct.stdout.strip():
            state, code, nodes, reason = (acct.stdout.strip().splitlines()[0].split("|") + ["", "", "", ""])[:4]
            return {"JobState": state, "ExitCode": code, "NodeList": nodes, "Reason": reason or "None"}
        return None

    def wait(self, handle: dict[str, Any], *, on_line: Callable[[str], Any], should_stop: Callable[[], bool]) -> Ending:
        relay = _Tail(Path(handle["log"]))
        while True:
            for line in relay.lines():
                on_line(line)
            if should_stop():
                self.stop(handle, reason="cancelled")
                return Ending(None, reason="CANCELLED (by Ballast)", cancelled=True)
            fields = self.state(handle)
            if fields is None:
                return Ending(None, reason=f"Slurm has no record of job {handle['job_id']} any more")
            end = slurm_status.ending(fields)
            if end is not None:
                time.sleep(0.2)  # the last lines of the output file
                for line in relay.lines():
                    on_line(line)
                return end
            time.sleep(self.slurm.poll_seconds)

    def stop(self, handle: dict[str, Any], *, reason: str = "") -> None:
        """scancel the job (Slurm signals every step, then SIGKILLs after KillWait) and wait until it
        has left the running states."""
        _run(["scancel", handle["job_id"]])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            fields = self.state(handle)
            if fields is None or fields.get("JobState", "").split()[0] in slurm_status.TERMINAL:
                return
            time.sleep(0.5)
        self.log.warning("Slurm job %s still not ended 60 s after scancel", handle["job_id"])


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


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, env=os.environ.copy())
    except FileNotFoundError as exc:
        raise ConfigError(f"execution.backend: slurm, but {argv[0]!r} is not on PATH here: the Airflow worker"
                          f" needs Slurm's client commands and the cluster's slurm.conf") from exc
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"{argv[0]} did not answer within {COMMAND_TIMEOUT:.0f}s", failure_class="communication") from exc
