"""A try on a cluster backend, from the train task: start it, relay its log, end it with the task.

The same guarantees as the local supervision (`ballast.supervise`), with the platform's own handles:

- The lease. While the job runs, `<out_dir>/remote.json` names it (backend, job id or name, try).
  The next try's `end_leftovers` reads it and stops that job before starting its own: a retry never
  attaches to another try's job (its names carry the try number) and never trains beside it, even when
  the task that started it was SIGKILLed and could not clean up. The lease goes only once the job is
  known to have ended: a stop that gave up waiting (scancel not obeyed, pods still in their grace
  period past it) leaves it, and the next try ends that job first or does not start.
- Cancel. The operator's on_kill (`ballast.supervise.stop_running`), an interrupt or an exception in
  the task write `<out_dir>/CANCELLED` first, then stop the job (scancel; the Job or pod deleted).
- Hang. Where the run's storage is a shared file system, the trainers' heartbeat file is read here as
  on the worker; a job with no step for the hang timeout is stopped and reported as a hang.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ballast.backends import Ending, Launch
from ballast.errors import LaunchError

LEASE = "remote.json"
_RUNNING: dict[int, tuple[Any, dict]] = {}
_LOCK = threading.Lock()


def backend_for(spec, job_dir: Path, log: Any):
    if spec.execution.backend == "slurm":
        from ballast.backends.slurm import SlurmBackend

        return SlurmBackend(spec, job_dir, log)
    if spec.execution.backend == "kubernetes":
        from ballast.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(spec, log)
    raise ValueError(f"no remote backend {spec.execution.backend!r}")


def run(backend: Any, launch: Launch, out_dir: Path, log: Any, *, hang_timeout: float, heartbeat: bool,
        tail: deque | None = None) -> Ending:
    """Start `launch`, relay its log until it ends; how it ended (`hung` when Ballast ended it). With
    `heartbeat` (a shared file system), the trainers' heartbeat in `out_dir` is watched for a hang."""
    from ballast.supervise import CANCELLED

    (out_dir / CANCELLED).unlink(missing_ok=True)
    handle = backend.start(launch)
    _write(out_dir / LEASE, {**handle, "host": socket.gethostname(), "time": time.time()})
    key = id(handle)
    state = {"cancelled": False, "hung": False}
    with _LOCK:
        _RUNNING[key] = (backend, {"handle": handle, "out_dir": out_dir, "state": state})
    beat = out_dir / "heartbeat"
    started = time.time()

    def on_line(line: str) -> None:
        log.info("%s", line)
        if tail is not None:
            tail.append(line)

    def should_stop() -> bool:
        if state["cancelled"]:
            return True
        if not heartbeat:
            return False
        last = max(started, beat.stat().st_mtime if beat.exists() else 0.0)
        if time.time() - last > hang_timeout:
            log.error("no training progress for %.0fs; ending the job", hang_timeout)
            state["hung"] = True
            return True
        return False

    try:
        end = backend.wait(handle, on_line=on_line, should_stop=should_stop)
    except BaseException as exc:
        cancel(key, f"{type(exc).__name__} in the task")
        raise
    finally:
        with _LOCK:
            _RUNNING.pop(key, None)
    if state["hung"]:
        end = Ending(end.exit_code, host=end.host, reason="hang: ended by the orchestrator", failure_class="hang",
                     hung=True, left_running=end.left_running)
    elif state["cancelled"]:
        end = Ending(end.exit_code, host=end.host, reason=end.reason, cancelled=True, left_running=end.left_running)
    if end.left_running:
        log.error("%s job %s may still be running: its lease %s stays, and the next try ends it before it starts",
                  handle.get("backend"), handle.get("job_id") or handle.get("name"), out_dir / LEASE)
    else:
        (out_dir / LEASE).unlink(missing_ok=True)
    return end


def cancel(key: int, reason: str) -> None:
    from ballast.supervise import CANCELLED

    with _LOCK:
        entry = _RUNNING.get(key)
    if entry is None:
        return
    backend, info = entry
    if info["state"]["cancelled"]:
        return
    info["state"]["cancelled"] = True
    handle = info["handle"]
    _write(info["out_dir"] / CANCELLED, {"time": time.time(), "reason": reason, "try_number": handle.get("try_number"),
                                         "host": socket.gethostname(), "job": handle.get("job_id") or handle.get("name")})
    backend.stop(handle, reason=reason)


def stop_all(reason: str) -> None:
    """Cancel every cluster job this process started (from on_kill)."""
    with _LOCK:
        keys = list(_RUNNING)
    for key in keys:
        cancel(key, reason)


def end_leftovers(spec, out_dir: Path, job_dir: Path, log: Any) -> dict | None:
    """Stop the job an earlier try of this task left running (its task was killed), before this try starts."""
    lease = _read(out_dir / LEASE)
    if lease is None:
        return None
    backend = backend_for(spec, job_dir, log)
    log.warning("ending try %s's %s job %s, left by a task that did not end it", lease.get("try_number"),
                lease.get("backend"), lease.get("job_id") or lease.get("name"))
    if not backend.stop(lease, reason="left by an earlier try"):
        raise LaunchError(f"{out_dir / LEASE}: try {lease.get('try_number')}'s {lease.get('backend')} job"
                          f" {lease.get('job_id') or lease.get('name')} has not ended after Ballast asked it to;"
                          f" this try does not start beside it (the next one asks again; an operator can end it"
                          f" by hand)", failure_class="communication")
    (out_dir / LEASE).unlink(missing_ok=True)
    return dict(lease, leftover_processes=None, same_host=False)


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
