"""Supervision of a training process group from the task that started it: nothing of a try outlives it.

`supervise` runs torchrun (training.launch) in its own process group, relays its output into the task
log, watches the heartbeat and ends the group when it stalls or when the caller asks. Three mechanisms
keep a try's processes from outliving it, and the next try from running beside them:

- Parent death. torchrun is told the task's pid (BALLAST_PARENT_PID) and asks the kernel for SIGHUP
  when the task dies; its ranks and their loader workers die with their own parents (training.launch
  says why these signals). A SIGKILLed task therefore takes its trainers with it at once, not at their
  next log line of a broken pipe.
- The lease. While the group runs, `<out_dir>/lease.json` names it: host, process group, torchrun's pid
  and start time, the task's pid, the try, a random token that every process of the group carries in
  its environment (BALLAST_LEASE), and the boot. It is removed once the group has ended. The next try
  calls `end_leftovers` before it starts (and `supervise` does as a last resort): on this host, a
  process counts as a leftover only if it is in that group and carries the token, so a pid reused by
  an unrelated process, or a reboot since, is never mistaken for the old try.
- Cancel. When the task is stopped (the operator's on_kill calls `stop_running`; an interrupt or, when
  nothing else handles it, a SIGTERM reaches the task while `supervise` runs), `<out_dir>/CANCELLED`
  records it first (time, reason, try), then the whole group is SIGKILLed: SIGTERM would be read by the
  trainers as a preemption notice and have them try to commit a checkpoint for up to
  `recovery.preempt_grace_seconds` (a rank waiting for a peer already gone, loader workers printing
  tracebacks) for a try nobody will continue. A SIGKILLed trainer writes no failure record, so a cancel
  is never read as a failure class; `was_cancelled(out_dir)` tells the caller after `supervise` returns.
  The next try's `supervise` clears the marker.

A stalled group (the hang guard) and a failed cache warm-up still get SIGTERM first, SIGKILL 30 s later:
the trainers' own watchdog writes the hang record, and a preemption checkpoint is worth having there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ballast.training.parentdeath import proc_stat

if TYPE_CHECKING:
    from ballast.context import RunContext

LEASE = "lease.json"
CANCELLED = "CANCELLED"
LEASE_ENV = "BALLAST_LEASE"  # the token every process of a supervised group carries in its environment
PARENT_ENV = "BALLAST_PARENT_PID"  # read by training.launch: the process whose death ends the group
END_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed group's last process to go


@dataclass(eq=False)
class _Group:
    proc: subprocess.Popen
    out_dir: Path
    token: str
    try_number: int
    cancelled: bool = False
    restore: Any = None
    """Puts back the SIGTERM handler `start` installed (called when `wait` ends)."""
    lock: threading.RLock = field(default_factory=threading.RLock)  # re-entrant: on_kill runs in a signal handler

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: torchrun leads its own session and process group


_RUNNING: set[_Group] = set()


def stop_running(reason: str = "the task was stopped") -> None:
    """Cancel every torchrun this process started (the operator's on_kill): record the cancel, then end
    each whole group with SIGKILL and wait for it to be gone."""
    for group in list(_RUNNING):
        _cancel(group, reason)
    from ballast.backends import remote

    remote.stop_all(reason)  # and every cluster job (a Slurm job, a Kubernetes Job or pod)


def was_cancelled(out_dir: Path) -> bool:
    """Whether the last `supervise` on `out_dir` was cancelled (its CANCELLED marker exists)."""
    return (Path(out_dir) / CANCELLED).exists()


def read_cancel(out_dir: Path) -> dict | None:
    """The CANCELLED marker ({"time", "reason", "try_number", "host", "pgid"}), or None."""
    return _read_json(Path(out_dir) / CANCELLED)


def read_lease(out_dir: Path) -> dict | None:
    return _read_json(Path(out_dir) / LEASE)


def supervise(argv: list[str], out_dir: Path, ctx: RunContext, *, hang_timeout: float,
              abort=None, try_number: int = 1, tail: deque | None = None) -> tuple[int, bool]:
    """Run torchrun in its own process group, relaying its output (its last lines also into `tail`,
    for classifying a failure); end it if the heartbeat stalls, or when `abort()` returns something
    (the background cache warm-up failed). (rc, hung). `start` then `wait`, in one call."""
    group = start(argv, out_dir, ctx.log, try_number=try_number)

    def on_line(line: str) -> None:
        ctx.log.info("%s", line)
        if tail is not None:
            tail.append(line)

    return wait(group, ctx.log, hang_timeout=hang_timeout, on_line=on_line,
                should_stop=(lambda: _warm_up_failed(abort())) if abort is not None else None)


def _warm_up_failed(error: BaseException | None) -> str | None:
    return None if error is None else f"the cache warm-up failed ({error})"


def start(argv: list[str], out_dir: Path, log: Any, *, try_number: int = 1,
          env: dict[str, str] | None = None) -> _Group:
    """Start torchrun in its own process group and session, under a new lease in `out_dir` (ending
    what an earlier try left there first, if the caller has not). Its output waits in the pipe for `wait`."""
    out_dir = Path(out_dir)
    lease = read_lease(out_dir)
    if lease is not None and lease.get("host") == socket.gethostname():
        end_leftovers(out_dir, log)  # the caller should have; a second group must never train beside it
    (out_dir / CANCELLED).unlink(missing_ok=True)  # an earlier try's cancel; this marker is this try's
    token = uuid.uuid4().hex
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}),
                    **{PARENT_ENV: str(os.getpid()), LEASE_ENV: token})
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=full_env)
    group = _Group(proc, out_dir, token, try_number)
    _RUNNING.add(group)
    _write_lease(group)
    group.restore = _cancel_on_sigterm()
    return group


def wait(group: _Group, log: Any, *, hang_timeout: float, on_line, should_stop=None) -> tuple[int, bool]:
    """Relay the group's output line by line to `on_line` until torchrun exits; end the group when its
    heartbeat stalls for `hang_timeout` (hung) or when `should_stop()` returns a reason (SIGTERM, then SIGKILL
    30 s later), or on an exception in the task (a cancel). (rc, hung)."""
    proc, out_dir = group.proc, group.out_dir

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(line.rstrip())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    heartbeat = out_dir / "heartbeat"
    started = time.time()
    hung = False
    try:
        while True:
            try:
                proc.wait(timeout=1.0)  # returns as soon as torchrun exits: the next try starts no later
                break
            except subprocess.TimeoutExpired:
                pass
            if group.cancelled:
                break
            last = max(started, heartbeat.stat().st_mtime if heartbeat.exists() else 0.0)
            if time.time() - last > hang_timeout:
                hung = True
                log.error("no training progress for %.0fs; ending the process group", hang_timeout)
                _terminate_group(proc)
                break
            why = should_stop() if should_stop is not None else None
            if why:
                log.error("ending training: %s", why if isinstance(why, str) else "its caller asked")
                _terminate_group(proc)
                break
    except BaseException as exc:
        # The task itself is being stopped (an interrupt, a timeout, SIGTERM): a cancel.
        _cancel(group, f"{type(exc).__name__} in the task")
        raise
    finally:
        group.restore()
        _RUNNING.discard(group)
        _finish(group, log)
    rc = proc.wait()
    reader.join(timeout=5)
    if group.cancelled:
        log.warning("training cancelled: %s", (read_cancel(out_dir) or {}).get("reason"))
    return rc, hung


def stop(group: _Group, reason: str) -> None:
    """Cancel one group (record the cancel, then SIGKILL all of it)."""
    _cancel(group, reason)


def end_leftovers(out_dir: Path, log: Any) -> dict | None:
    """End what an earlier try left running under `out_dir`, before this try starts.

    Reads the earlier try's lease. None when there is none. On this host, SIGKILLs every process still
    in its group (those carrying its token; none after a reboot) and waits until none remains (at most
    10 s), logging one line naming the try, group and host, and removes the lease once they are gone.
    On another host it can only warn (the backend that placed it there ends it). Returns the lease, with
    `leftover_processes` (how many were still running: 0 when the group had already ended) and
    `same_host`: the caller records that the earlier try ended without recording itself.
    """
    out_dir = Path(out_dir)
    lease = read_lease(out_dir)
    if lease is None:
        return None
    host, pgid, token = lease.get("host"), int(lease.get("pgid", 0)), str(lease.get("token", ""))
    try_number = lease.get("try_number")
    if host != socket.gethostname():
        log.warning("try %s's training (process group %s) ran on %s, not here: it cannot be ended from this"
                    " host", try_number, pgid, host)
        return dict(lease, leftover_processes=None, same_host=False)
    leftover, gone = 0, True
    if pgid > 0 and token and lease.get("boot_id") in (None, _boot_id()):
        leftover = len(group_members(pgid, token))
        if leftover:
            gone = _kill_members(pgid, token, timeout=END_TIMEOUT)
            log.warning("ended the leftovers of try %s: %d process(es) of process group %d on %s%s", try_number,
                        leftover, pgid, host, "" if gone else " (some did not go within 10 s)")
    if gone:  # else it stays, naming what is still there
        _remove_lease(out_dir, token)
    return dict(lease, leftover_processes=leftover, same_host=True)


def group_members(pgid: int, token: str | None = None) -> list[int]:
    """Live (not zombie) processes of process group `pgid`; with `token`, only those carrying it as
    BALLAST_LEASE in their environment (the processes of one supervised try)."""
    members = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        st = proc_stat(int(name))
        if st is None or st[2] != pgid or st[0] in ("Z", "X"):
            continue
        if token is not None and not _carries(int(name), token):
            continue
        members.append(int(name))
    return members


# --- internals -----------------------------------------------------------------------------------

def _cancel(group: _Group, reason: str) -> None:
    with group.lock:
        if group.cancelled:
            return
        group.cancelled = True
        # Recorded before any signal: whoever looks after the group is gone must find why.
        _write_json(group.out_dir / CANCELLED, {"time": time.time(), "reason": reason, "try_number": group.try_number,
                                                "host": socket.gethostname(), "pgid": group.pgid})
        if group.proc.returncode is None:  # torchrun not reaped yet, so `pgid` is still its group's
            try:
                os.killpg(group.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_members(group.pgid, group.token, timeout=END_TIMEOUT)
        try:
            group.proc.wait(timeout=5)  # a bounded wait: safe from a signal handler that interrupted poll()
        except subprocess.TimeoutExpired:
            pass


def _finish(group: _Group, log: Any) -> None:
    """After torchrun has ended (or is being ended): anything of its group still running is a leftover of
    this try. Give it 5 s to go by itself (torchrun ends its forkserver as it exits), then SIGKILL it;
    the lease goes once nothing of the group remains."""
    try:
        group.proc.wait(timeout=10)  # already over, or just sent SIGKILL
    except subprocess.TimeoutExpired:
        return  # nothing could end it: the lease stays, for the next try to end the group
    deadline = time.monotonic() + 5.0
    while group_members(group.pgid, group.token) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_members(group.pgid, group.token):
        log.warning("processes of the training's group outlived torchrun; ending them")
        if not _kill_members(group.pgid, group.token, timeout=END_TIMEOUT):
            return
    _remove_lease(group.out_dir, group.token)


def _terminate_group(proc: subprocess.Popen) -> None:
    """SIGTERM first (trainers checkpoint on it), SIGKILL 30 s later."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    except ProcessLookupError:
        pass


def _kill_members(pgid: int, token: str, *, timeout: float) -> bool:
    """SIGKILL the group's processes carrying `token` until none is left; False if some outlast `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        members = group_members(pgid, token)
        if not members:
            return True
        if time.monotonic() > deadline:
            return False
        try:
            # Members carrying the token exist, so `pgid` is still this group's (a pid is not reused
            # while a process group of that id has members): one call stops them all at once, before any
            # can notice another's death and write about it.
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        time.sleep(0.05)


def _carries(pid: int, token: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{LEASE_ENV}={token}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _cancel_on_sigterm():
    """Where nothing else handles SIGTERM (outside Airflow, whose task runner turns it into on_kill) and
    this is the main thread: a SIGTERM during `supervise` cancels the training, then ends the process
    as SIGTERM would (exit 143). Returns the function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return lambda: None

    def on_sigterm(signum, frame):
        stop_running(f"signal {signal.Signals(signum).name} to the task")
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _write_lease(group: _Group) -> None:
    st = proc_stat(group.proc.pid)
    _write_json(group.out_dir / LEASE, {
        "version": 1, "host": socket.gethostname(), "boot_id": _boot_id(), "pgid": group.pgid,
        "pid": group.proc.pid, "pid_start": st[3] if st else None, "task_pid": os.getpid(),
        "try_number": group.try_number, "started": time.time(), "token": group.token,
    })


def _remove_lease(out_dir: Path, token: str) -> None:
    """Remove the lease if it is still the one naming `token` (a later try may have replaced it)."""
    lease = read_lease(out_dir)
    if lease is not None and lease.get("token") == token:
        (out_dir / LEASE).unlink(missing_ok=True)


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
