"""The one driver of a try, whatever backend runs it: start, follow, end it with the task.

A backend (`ballast.launch.Backend`: local, Slurm, Kubernetes) starts a `Launch`, relays its log
while it waits, stops it, and says how it ended. Around it, written once here:

- The lease. A cluster job is named in `<out_dir>/remote.json` (backend, job id or name, try) while it
  runs; a local process group in its own lease (`ballast.launch.process`). The next try's `end_leftovers`
  reads both and ends what they name before it starts its own: a retry never trains beside an earlier
  try, even when the task that started it was SIGKILLed and could not clean up. A job's lease goes only
  once the job is known to have ended: a stop that gave up waiting (scancel not obeyed, pods still in
  their grace period past it) leaves it, and the next try ends that job first or does not start.
- Cancel. The operator's on_kill (`stop_all`), an interrupt, an exception in the task or (where nothing
  else handles it) a SIGTERM write `<out_dir>/CANCELLED` first (time, reason, try, and the process
  group or job), then stop the try: a local group gets SIGKILL (SIGTERM would have the trainers commit
  a preemption checkpoint for a try nobody continues), a Slurm job scancel, a Kubernetes Job or pod is
  deleted. A SIGKILLed trainer writes no failure record, so a cancel is never read as a failure class;
  `was_cancelled(out_dir)` tells the caller afterwards. The next try's `run` clears the marker.
- The registry of running tries: what `stop_all` cancels.
- The hang guard. Where the trainers' heartbeat file is readable from here (always on this machine;
  on a cluster where the run's storage is a shared file system), a try with no step for the hang
  timeout is ended and reported as a hang.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ballast.errors import LaunchError
from ballast.launch.process import end_leftovers as end_group_leftovers
from ballast.launch.process import read_json, write_json

if TYPE_CHECKING:
    from ballast.launch import Backend, Ending, Launch
    from ballast.spec import Spec

CANCELLED = "CANCELLED"
JOB_LEASE = "remote.json"


@dataclass(eq=False)
class _Try:
    backend: Any
    handle: Any
    out_dir: Path
    try_number: int
    cancelled: bool = False
    """A cancel began (its marker is being written, or the try stopped)."""
    stopped: bool = False
    """The cancel has stopped the try: the backend's wait is told to return."""
    hung: bool = False


_RUNNING: set[_Try] = set()
_LOCK = threading.RLock()  # re-entrant: a cancel may run in a signal handler on the thread that holds it


def run(backend: Backend, launch: Launch, out_dir: Path, log: Any, *, hang_timeout: float, heartbeat: bool = True,
        tail: deque | None = None, should_stop: Callable[[], Any] | None = None) -> Ending:
    """Start `launch` on `backend`, relay its log into `log` (its last lines also into `tail`, for
    classifying a failure) until it ends; how it ended (`hung` when the hang guard ended it, `cancelled`
    when a cancel did). With `heartbeat`, the trainers' heartbeat in `out_dir` is watched for a hang;
    `should_stop()` returning a reason (the background cache warm-up failed) ends the try as well."""
    out_dir = Path(out_dir)
    (out_dir / CANCELLED).unlink(missing_ok=True)  # an earlier try's cancel; this marker is this try's
    handle = backend.start(launch)
    job = backend.lease(handle)
    if job is not None:
        write_json(out_dir / JOB_LEASE, {**job, "host": socket.gethostname(), "time": time.time()})
    entry = _Try(backend, handle, out_dir, launch.try_number)
    with _LOCK:
        _RUNNING.add(entry)
    restore = _cancel_on_sigterm()
    started = time.time()

    def on_line(line: str) -> None:
        log.info("%s", line)
        if tail is not None:
            tail.append(line)

    def stop_why() -> Any:
        if entry.stopped:  # not before: a local group must get the cancel's SIGKILL, never a SIGTERM
            return "cancelled"
        if heartbeat and stalled(out_dir, started, hang_timeout):
            log.error("no training progress for %.0fs; ending the try", hang_timeout)
            entry.hung = True
            return f"hang: no progress for {hang_timeout:.0f}s"
        return should_stop() if should_stop is not None else None

    try:
        end = backend.wait(handle, on_line=on_line, should_stop=stop_why)
    except BaseException as exc:
        cancel(entry, f"{type(exc).__name__} in the task")
        raise
    finally:
        restore()
        with _LOCK:
            _RUNNING.discard(entry)
    if entry.hung:
        end = replace(end, reason="hang: ended by the orchestrator", failure_class="hang", hung=True, cancelled=False)
    elif entry.cancelled:
        end = replace(end, failure_class=None, cancelled=True)
        log.warning("training cancelled: %s", (read_cancel(out_dir) or {}).get("reason"))
    if job is not None:
        if end.left_running:
            log.error("%s job %s may still be running: its lease %s stays, and the next try ends it before it"
                      " starts", job.get("backend"), _job_id(job), out_dir / JOB_LEASE)
        else:
            (out_dir / JOB_LEASE).unlink(missing_ok=True)
    return end


def backend_for(spec: Spec, out_dir: Path, log: Any) -> Backend:
    """The backend of `spec.execution.backend`, for a try whose outputs go to `out_dir`."""
    if spec.execution.backend == "local":
        from ballast.launch.local import LocalBackend

        return LocalBackend(out_dir, log)
    if spec.execution.backend == "slurm":
        from ballast.launch.slurm import SlurmBackend

        return SlurmBackend(spec, Path(out_dir) / "jobs", log)
    if spec.execution.backend == "kubernetes":
        from ballast.launch.kubernetes import KubernetesBackend

        return KubernetesBackend(spec, log)
    raise ValueError(f"no backend {spec.execution.backend!r}")


def stalled(out_dir: Path, started: float, hang_timeout: float) -> bool:
    """The hang guard: no heartbeat in `out_dir` for `hang_timeout` seconds (counted from `started`
    before the first one)."""
    beat = Path(out_dir) / "heartbeat"
    try:
        last = max(started, beat.stat().st_mtime)
    except OSError:
        last = started
    return time.time() - last > hang_timeout


def cancel(entry: _Try, reason: str) -> None:
    """Record the cancel of one running try, then stop it (recorded before any signal: whoever looks
    after the try is gone must find why)."""
    with _LOCK:
        if entry.cancelled:
            return
        entry.cancelled = True
    write_json(entry.out_dir / CANCELLED, {"time": time.time(), "reason": reason, "try_number": entry.try_number,
                                           "host": socket.gethostname(), **entry.backend.describe(entry.handle)})
    try:
        entry.backend.stop(entry.handle, reason=reason)
    finally:
        entry.stopped = True


def stop_all(reason: str = "the task was stopped") -> None:
    """Cancel every try this process started, on any backend (the operator's on_kill), and wait for
    each to be gone."""
    with _LOCK:
        entries = list(_RUNNING)
    for entry in entries:
        cancel(entry, reason)


def was_cancelled(out_dir: Path) -> bool:
    """Whether the last try run on `out_dir` was cancelled (its CANCELLED marker exists)."""
    return (Path(out_dir) / CANCELLED).exists()


def read_cancel(out_dir: Path) -> dict | None:
    """The CANCELLED marker ({"time", "reason", "try_number", "host", and "pgid" or "job"}), or None."""
    return read_json(Path(out_dir) / CANCELLED)


def end_leftovers(backend: Callable[[], Backend], out_dir: Path, log: Any) -> dict | None:
    """End what an earlier try of this task left running (its task was killed), before this try starts:
    a process group on this machine, a job on the platform of `backend()` (made only when a job's lease
    is found). The earlier try's lease (None: it left nothing), with `leftover_processes` and `same_host`."""
    out_dir = Path(out_dir)
    found = end_group_leftovers(out_dir, log)
    lease = read_json(out_dir / JOB_LEASE)
    if lease is None:
        return found
    log.warning("ending try %s's %s job %s, left by a task that did not end it", lease.get("try_number"),
                lease.get("backend"), _job_id(lease))
    if not backend().stop(lease, reason="left by an earlier try"):
        raise LaunchError(f"{out_dir / JOB_LEASE}: try {lease.get('try_number')}'s {lease.get('backend')} job"
                          f" {_job_id(lease)} has not ended after Ballast asked it to; this try does not start"
                          f" beside it (the next one asks again; an operator can end it by hand)",
                          failure_class="communication")
    (out_dir / JOB_LEASE).unlink(missing_ok=True)
    return dict(lease, leftover_processes=None, same_host=False)


def _job_id(lease: dict) -> Any:
    return lease.get("job_id") or lease.get("name")


def _cancel_on_sigterm() -> Callable[[], Any]:
    """Where nothing else handles SIGTERM (outside Airflow, whose task runner turns it into on_kill) and
    this is the main thread: a SIGTERM while a try runs cancels it, then ends the process as SIGTERM
    would (exit 143). Returns the function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return lambda: None

    def on_sigterm(signum, frame):
        stop_all(f"signal {signal.Signals(signum).name} to the task")
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)
