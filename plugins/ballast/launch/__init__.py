"""Where a try's training runs, behind one interface: `local` (torchrun on the Airflow worker),
`kubernetes` (a pod, or an Indexed Job of pods), `slurm` (one batch job of N nodes).

A backend (`Backend`: `local.LocalBackend`, `slurm.SlurmBackend`, `kubernetes.KubernetesBackend`,
picked by `driver.backend_for`) starts a `Launch`, relays its log while it waits, stops it, and reports how it
ended (`Ending`: exit code, the node, the platform's own termination reason, and the failure class that
reason implies). The one driver of a try (`driver`: lease, cancel, the registry of running tries, the
hang guard, the stop-all) runs every backend alike; the train stage and the recovery policy see only
these. Pure builders (the torchrun argv, manifests, batch scripts) live apart from the code that starts
and watches processes: `kubernetes.manifests` and `slurm.script` are tested as data.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ballast.recovery.adapt import TrySettings
    from ballast.spec import Spec

NODE_RANK_ENV = "BALLAST_NODE_RANK"
RDZV_ENV = "BALLAST_RDZV_ENDPOINT"
RDZV_PORT = 29400


@dataclass(frozen=True)
class Launch:
    """One try's training job, whatever runs it."""

    name: str
    """Platform-safe name of this try's job (a DNS label; the try number is in it)."""
    try_number: int
    nodes: int
    command: tuple[str, ...]
    """What each node runs, as an argument list (never a shell string); its node rank comes from
    $BALLAST_NODE_RANK and the rendezvous endpoint from $BALLAST_RDZV_ENDPOINT."""
    env: dict[str, str] = field(default_factory=dict)
    capacity: str = "default"
    """`default` or `on-demand` (recovery's call after preemptions)."""
    avoid_hosts: tuple[str, ...] = ()
    """Hosts the job must not run on (recovery's avoid list)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Who it belongs to: dag_id, task_id, run_id (the try number is separate)."""
    shared_path: str | None = None
    """Where the run's storage is a file system: its absolute path, the same on every node."""


@dataclass(frozen=True)
class Ending:
    """How a started job ended, in the platform's own words and in a recovery class."""

    exit_code: int | None
    host: str | None = None
    reason: str = ""
    """The platform's termination reason (OOMKilled, PreemptionByScheduler, NODE_FAIL, ...), or ''."""
    failure_class: str | None = None
    """The recovery class the platform's reason implies; None: it says nothing (read the failure record)."""
    cancelled: bool = False
    hung: bool = False
    """Ended by Ballast for showing no progress (the hang guard), not by the platform."""
    left_running: bool = False
    """Ballast asked the platform to end the job and stopped waiting before it had: it may still run, so
    its lease stays and the next try ends it before starting (two tries never train into one storage)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.failure_class is None and not self.cancelled and not self.hung


class Backend(Protocol):
    """What the driver (`ballast.launch.driver`) needs of a backend."""

    def start(self, launch: Launch) -> Any:
        """Start the try; its handle."""

    def wait(self, handle: Any, *, on_line: Callable[[str], Any], should_stop: Callable[[], Any]) -> Ending:
        """Relay the log to `on_line` until the try ends, or until `should_stop()` returns a reason."""

    def stop(self, handle: Any, *, reason: str) -> bool:
        """End the try and wait (bounded) until it has; False: it had not ended when the wait gave up."""

    def lease(self, handle: Any) -> dict[str, Any] | None:
        """What the driver's lease keeps of a started job for the next try's `stop`; None: the backend
        keeps a lease of its own (the local process group's)."""

    def describe(self, handle: Any) -> dict[str, Any]:
        """What names the try in its cancel marker (a process group, a job)."""


def job_name(dag_id: str, run_id: str, try_number: int) -> str:
    """A DNS label naming one try (a Kubernetes Job, a Slurm job): short enough for `<name>-<index>`
    pod hostnames (63 characters), the try number last so no try takes another's."""
    base = re.sub(r"[^a-z0-9-]", "-", dag_id.lower().removeprefix("ballast_"))[:20].strip("-") or "run"
    digest = hashlib.sha256(f"{dag_id}/{run_id}".encode()).hexdigest()[:8]
    return f"ballast-{base}-{digest}-t{try_number}"


def node_command(python: str, job_ref: str) -> tuple[str, ...]:
    """What every node of a cluster try runs: `ballast.node` with the try's job file (in storage)."""
    return (python, "-m", "ballast.node", "--job", job_ref)


def launch_for(spec: Spec, settings: TrySettings, *, dag_id: str, run_id: str, task_id: str, try_number: int,
               job_ref: str, python: str = "python", shared_path: str | None = None) -> Launch:
    """The `Launch` of one try on a cluster backend, with recovery's placement (`settings`: capacity, the
    avoid list); its micro-batch goes to the nodes in the run config alone."""
    return Launch(name=job_name(dag_id, run_id, try_number), try_number=try_number, nodes=spec.training.nodes,
                  command=node_command(python, job_ref), capacity=settings.capacity,
                  avoid_hosts=tuple(settings.avoid_hosts),
                  labels={"dag_id": dag_id, "task_id": task_id, "run_id": run_id}, shared_path=shared_path)


def job_key(run_key: str, try_number: int) -> str:
    """Storage key of one try's job file (`ballast.node.NodeJob`)."""
    return f"{run_key}/train/try-{try_number}/job.json"


def job_ref(ctx: Any, try_number: int) -> str:
    """Where a node reads one try's job file: a path where storage is a shared file system, else its URI."""
    key = job_key(ctx.run_key, try_number)
    local = ctx.storage.local_path(key)
    return str(local) if local is not None else ctx.storage.describe(key)
