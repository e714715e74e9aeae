"""Process-group primitives for a try on this machine: start torchrun in a group of its own, relay its
output, end the group, and the lease that lets the next try end what this one left. They import nothing
of Ballast above them; the try driver (`ballast.launch.driver`) owns the cancel marker, the registry
of running tries, the hang guard and the stop-all, and the local backend (`ballast.launch.local`)
puts these primitives behind the backends' interface.

Two mechanisms keep a group's processes from outliving its try, and the next try from running beside them:

- Parent death. torchrun is told the task's pid (BALLAST_PARENT_PID) and asks the kernel for SIGHUP
  when the task dies; its ranks and their loader workers die with their own parents (training.launch
  says why these signals). A SIGKILLed task therefore takes its trainers with it at once, not at their
  next log line of a broken pipe.
- The lease. While the group runs, `<out_dir>/lease.json` names it: host, process group, torchrun's pid
  and start time, the task's pid, the try, a random token that every process of the group carries in
  its environment (BALLAST_LEASE), and the boot. It is removed once the group has ended. The next try
  calls `end_leftovers` before it starts (and `start` does as a last resort): on this host, a process
  counts as a leftover only if it is in that group and carries the token, so a pid reused by an
  unrelated process, or a reboot since, is never mistaken for the old try.

`kill` ends a whole group with SIGKILL (a cancel: SIGTERM would be read by the trainers as a
preemption notice, and have them try to commit a checkpoint nobody will continue from); a group that
`wait` is asked to end (a hang, a failed cache warm-up) gets SIGTERM first and SIGKILL 30 s later: the
trainers' own watchdog writes the hang record, and a preemption checkpoint is worth having there.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ballast.training.parentdeath import proc_stat

LEASE = "lease.json"
LEASE_ENV = "BALLAST_LEASE"  # the token every process of a supervised group carries in its environment
PARENT_ENV = "BALLAST_PARENT_PID"  # read by training.launch: the process whose death ends the group
END_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed group's last process to go


@dataclass(eq=False)
class Group:
    """One started torchrun and its process group."""

    proc: subprocess.Popen
    out_dir: Path
    token: str
    try_number: int
    killed: bool = False
    """`kill` ended it (a cancel)."""
    lock: threading.RLock = field(default_factory=threading.RLock)  # re-entrant: a cancel may run in a signal handler

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: torchrun leads its own session and process group


def read_lease(out_dir: Path) -> dict | None:
    return read_json(Path(out_dir) / LEASE)


def start(argv: list[str], out_dir: Path, log: Any, *, try_number: int = 1,
          env: dict[str, str] | None = None) -> Group:
    """Start torchrun in its own process group and session, under a new lease in `out_dir` (ending
    what an earlier try left there first, if the caller has not). Its output waits in the pipe for `wait`."""
    out_dir = Path(out_dir)
    lease = read_lease(out_dir)
    if lease is not None and lease.get("host") == socket.gethostname():
        end_leftovers(out_dir, log)  # the caller should have; a second group must never train beside it
    token = uuid.uuid4().hex
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}),
                    **{PARENT_ENV: str(os.getpid()), LEASE_ENV: token})
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=full_env)
    group = Group(proc, out_dir, token, try_number)
    _write_lease(group)
    return group


def wait(group: Group, log: Any, *, on_line: Callable[[str], Any],
         should_stop: Callable[[], Any] | None = None) -> int:
    """Relay the group's output line by line to `on_line` until torchrun exits (or `kill` ended it); end
    the group when `should_stop()` returns a reason (SIGTERM, then SIGKILL 30 s later). torchrun's exit
    code. On an exception (the task is being stopped) the group is left to the caller's `kill`."""
    proc = group.proc

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(line.rstrip())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    while True:
        try:
            proc.wait(timeout=1.0)  # returns as soon as torchrun exits: the next try starts no later
            break
        except subprocess.TimeoutExpired:
            pass
        if group.killed:
            break
        why = should_stop() if should_stop is not None else None
        if why:
            log.error("ending training: %s", why if isinstance(why, str) else "its caller asked")
            _terminate_group(proc)
            break
    _finish(group, log)
    rc = proc.wait()
    reader.join(timeout=5)
    return rc


def kill(group: Group) -> None:
    """End the whole group with SIGKILL and wait (bounded) for it to be gone; its lease goes with it."""
    with group.lock:
        if group.killed:
            return
        group.killed = True
        if group.proc.returncode is None:  # torchrun not reaped yet, so `pgid` is still its group's
            try:
                os.killpg(group.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_members(group.pgid, group.token, timeout=END_TIMEOUT)
        try:
            group.proc.wait(timeout=5)  # a bounded wait: safe from a signal handler that interrupted poll()
        except subprocess.TimeoutExpired:
            return  # the lease stays, for the next try to end the group
        if not group_members(group.pgid, group.token):
            _remove_lease(group.out_dir, group.token)


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


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically (a reader sees the old file or the new one, never a part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object at `path`, or None when there is none (or it is not JSON)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- internals -----------------------------------------------------------------------------------

def _finish(group: Group, log: Any) -> None:
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


def _write_lease(group: Group) -> None:
    st = proc_stat(group.proc.pid)
    write_json(group.out_dir / LEASE, {
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
