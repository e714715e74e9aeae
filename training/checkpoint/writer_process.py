"""The checkpoint writer process: a background save's bytes written and hashed outside the trainer's process.

Why a process. A background save written by a thread of the trainer shares the trainer's interpreter
lock: every slice it copies and every record it serialises holds the lock that the training loop needs
each time it comes back from an op. Measured on this project's 2-core machine (a loop of small torch ops
on one core, a ~300 MB save through `checkpoint.dcp` on the other): the loop kept 0.67x its speed while
a thread saved and 0.90-0.94x while a process did. PyTorch's own DCP offers a process-based async save
for the same reason; this one keeps Ballast's writer (O_DIRECT, sha256 while writing, the commit
protocol) and sends no tensor through a pipe.

How. The snapshot buffers an asynchronous save copies the state into live in shared memory (`arena`:
memfd regions mapped by both processes; `Snapshot(shared=True)`). The trainer's writing thread still
runs the serialisation (torch.save's records, DCP's planning: small work), but what it writes to a
checkpoint file becomes a plan (`PlanWriter`): ranges of the shared buffers, and the few small bytes
between them (zip headers, small tensors). The plan goes over a Unix socket to the writer process
(`writer_child.main`, in a Python of its own), which writes it through the same writer a
thread would (fileio._FileWriter: O_DIRECT, hashed as it goes, fsynced) and answers with the file's
sha256 and size. The trainer's thread waits for that answer without the lock.

The writer process is started by the thread that saves (the training thread), dies with it (Linux's
parent-death signal, and the socket's end) and of nothing else (a SIGTERM or SIGINT to the whole group
leaves it writing the save in flight; the trainer ending at any point ends it without a word), runs at
the writer's CPU priority (SCHED_IDLE by default, raised when training waits for it), and gets no
secret: its environment is only what Python needs to start. Where it cannot be started or dies, the
trainer's thread writes the same plan itself from the same buffers: a save never fails for want of it.
Linux only (memfd); elsewhere saves are written by a thread. Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast.training.checkpoint import fileio
from ballast.training.checkpoint.arena import arena
from ballast.training.parentdeath import stop_signals_blocked

INLINE_MAX = 64 << 10
"""Written bytes of fewer than this go to the writer process inline in the plan, whatever memory they
are in; larger ones are sent as references when they lie in the arena."""
INLINE_LIMIT = 64 << 20
"""A file whose inline bytes pass this (a state whose tensors are not in the arena) is written by the
trainer's thread instead: the plan never holds a copy of a large state."""
_HEAD = struct.Struct("!II")


# --- the socket protocol: a tag byte (carrying descriptors), then lengths, JSON head, payload -------------


def send_message(sock: socket.socket, head: dict[str, Any], payload: bytes | bytearray | memoryview = b"",
                 fds: list[int] | None = None) -> None:
    data = json.dumps(head).encode()
    if fds:
        socket.send_fds(sock, [b"M"], fds)
    else:
        sock.sendall(b"M")
    sock.sendall(_HEAD.pack(len(data), len(payload)) + data)
    if len(payload):
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the checkpoint writer's socket closed")
        got += k
    return out


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], bytearray, list[int]]:
    tag, fds, _, _ = socket.recv_fds(sock, 1, 4)
    if not tag:
        raise EOFError("the checkpoint writer's socket closed")
    head_len, payload_len = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    head = json.loads(_recv_exact(sock, head_len))
    return head, (_recv_exact(sock, payload_len) if payload_len else bytearray()), list(fds)


# --- a file's plan -------------------------------------------------------------------------------------


def run_plan(path: Path, items: list[list[Any]], inline: bytes | bytearray | memoryview, staging: Any,
             resolve: Callable[[int, int, int], memoryview]) -> fileio._FileWriter:
    """Write a plan through fileio._FileWriter (hashed, fsynced); the closed writer. `resolve(region id,
    offset, n)`: the referenced bytes."""
    size = sum(item[3] if item[0] == "r" else item[1] for item in items)
    w = _replay(fileio._FileWriter(Path(path), staging, size), items, inline, resolve)
    w.close()
    return w


def _replay(w: fileio._FileWriter, items: list[list[Any]], inline: bytes | bytearray | memoryview,
            resolve: Callable[[int, int, int], memoryview]) -> fileio._FileWriter:
    """Write a plan's bytes, in order, into `w` (abandoned if that fails)."""
    try:
        pos = 0
        src = memoryview(inline)
        for item in items:
            if item[0] == "r":
                w.write(resolve(item[1], item[2], item[3]))
            else:
                w.write(src[pos:pos + item[1]])
                pos += item[1]
    except BaseException:
        w.abandon()
        raise
    return w


class _Digest:
    def __init__(self, hexdigest: str):
        self._hex = hexdigest

    def hexdigest(self) -> str:
        return self._hex


class PlanWriter:
    """A checkpoint file's stream (what fileio._FileWriter offers its callers: write, tell, fileno,
    flush, close, abandon, digest, size, error) whose bytes the writer process writes at close.
    Bytes in the arena are recorded as references; the rest is kept inline. The file exists (empty)
    from the start; a file whose inline bytes pass INLINE_LIMIT, or whose writer process is gone, is
    written by this thread instead, from the same plan."""

    def __init__(self, path: Path, staging: Any, process: WriterProcess):
        self.path, self.staging, self.process = Path(path), staging, process
        self.items: list[list[Any]] = []
        self.inline = bytearray()
        self.size = 0
        self.error: BaseException | None = None
        self.digest: Any = None
        self.closed = False
        self.local: fileio._FileWriter | None = None  # this thread writes the file (the fallbacks)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # DCP fsyncs fileno()

    def write(self, data: Any) -> int:
        try:
            return self._write(data)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def _write(self, data: Any) -> int:
        if self.local is not None:
            n = self.local.write(data)
            self.size += n
            return n
        src = memoryview(data).cast("B")
        n = src.nbytes
        found = self.process.arena.find(fileio._address(src), n) if n >= INLINE_MAX else None
        if found is not None:
            region, off = found
            last = self.items[-1] if self.items else None
            if last is not None and last[0] == "r" and last[1] == region.id and last[2] + last[3] == off:
                last[3] += n
            else:
                self.items.append(["r", region.id, off, n])
        else:
            self.inline += src
            if self.items and self.items[-1][0] == "b":
                self.items[-1][1] += n
            else:
                self.items.append(["b", n])
        self.size += n
        if len(self.inline) > INLINE_LIMIT:
            self._write_here()
        return n

    def _write_here(self) -> None:
        """From now on this thread writes the file: what is planned so far first."""
        self.local = _replay(fileio._FileWriter(self.path, self.staging), self.items, self.inline, self.process.resolve)
        self.items, self.inline = [], bytearray()

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.fd

    def flush(self) -> None:
        pass

    def abandon(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            if self.local is not None:
                self.local.abandon()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        os.close(self.fd)
        try:
            if self.local is None:
                done = self.process.write_file(self.path, self.items, self.inline)
                if done is not None:
                    self.digest, self.size = _Digest(done[0]), done[1]
                    return
                self._write_here()  # the writer process is gone: this thread writes the plan
            assert self.local is not None
            self.local.close()
            self.digest = self.local.digest
        except BaseException as exc:
            self.error = self.error or exc
            raise


# --- the trainer's side ----------------------------------------------------------------------------------

_CHILD = "import sys; from ballast.training.checkpoint.writer_child import main; main(sys.argv[1:])"
_KEEP_ENV = ("PATH", "HOME", "LANG", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH")


def _child_env() -> dict[str, str]:
    """What the writer process needs of the environment to start Python: no credential reaches it."""
    return {k: v for k, v in os.environ.items()
            if k in _KEEP_ENV or k.startswith(("PYTHON", "LC_"))}


class WriterProcess:
    """The trainer's handle on its checkpoint writer process (one per training process, started at the
    first asynchronous save by the thread that saves, which must outlive it: the training thread)."""

    def __init__(self, *, idle: bool, log: Callable[[str], Any] = print):
        a = arena()
        if a is None:
            raise OSError("no shared memory (memfd) here")
        self.arena, self.idle, self.log = a, idle, log
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Started with the stop signals blocked (the mask survives exec), which `main` then ignores: a
        # SIGTERM to the whole group (a preemption notice, the end of a stalled group) must leave the
        # writer to finish the save in flight; it ends with its trainer, not with the group's signal.
        try:
            with stop_signals_blocked():
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid()),
                     "idle" if idle else "normal"],
                    pass_fds=[theirs.fileno()], env=_child_env(), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.sock = mine
        self.started = False  # its greeting (imports done) received
        self.mapped: set[int] = set()
        self.lock = threading.Lock()
        self.gone: str | None = None
        self._finalizer = weakref.finalize(self, _shutdown, mine, self.proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def open(self, path: Path, staging: Any) -> PlanWriter:
        """A checkpoint file's stream whose bytes this process writes (fileio.open_file)."""
        return PlanWriter(path, staging, self)

    def resolve(self, rid: int, off: int, n: int) -> memoryview:
        return self.arena.by_id(rid).view[off:off + n]

    def ready(self, timeout: float | None = None) -> bool:
        """Wait (up to `timeout` seconds) until the writer process has started and greeted; whether it has.
        A bench waits so that the process's start does not share the CPU with what it times."""
        with self.lock:
            if not self.started and self.gone is None:
                try:
                    self.sock.settimeout(timeout)
                    head, _, _ = recv_message(self.sock)
                    self.started = head.get("ready") is True
                except TimeoutError:
                    pass
                except (OSError, EOFError, ValueError) as exc:
                    self._lost(exc)
                finally:
                    if self.gone is None:
                        self.sock.settimeout(None)
            return self.started

    def write_file(self, path: Path, items: list[list[Any]], inline: bytearray) -> tuple[str, int] | None:
        """Have the writer process write a file's plan: (sha256, size), its CPU time added to this thread's
        helper time (the saver's write_cpu_seconds); None where the process is gone (the caller writes
        it). An I/O error of the write (a full disk) is raised as the OSError it was."""
        self.ready()
        with self.lock:
            if self.gone is None:
                try:
                    for rid in sorted({i[1] for i in items if i[0] == "r"} - self.mapped):
                        region = self.arena.by_id(rid)
                        send_message(self.sock, {"op": "map", "id": rid, "size": region.size}, fds=[region.fd])
                        self.mapped.add(rid)
                    send_message(self.sock, {"op": "write", "path": str(path), "items": items}, inline)
                    reply, _, _ = recv_message(self.sock)
                except (OSError, EOFError, ValueError) as exc:
                    self._lost(exc)
                else:
                    fileio._HELPERS.seconds = fileio.helper_cpu_seconds() + float(reply.get("cpu", 0.0))
                    if reply.get("ok"):
                        return reply["sha256"], int(reply["size"])
                    raise OSError(int(reply.get("errno") or 0), reply.get("error", "write failed"), str(path))
        return None

    def _lost(self, exc: BaseException) -> None:
        code = self.proc.poll()
        self.gone = f"{type(exc).__name__}: {exc}" + (f" (exit code {code})" if code is not None else "")
        self.log(f"checkpoint writer process {self.proc.pid} is gone ({self.gone}); this save and the next"
                 " are written by the trainer")
        self.close()

    def set_idle(self, idle: bool) -> None:
        """The writer process's CPU class: SCHED_IDLE while training runs beside it, normal while
        training waits for it (where the OS lets this process change it)."""
        if not self.idle or self.gone is not None:
            return
        with contextlib.suppress(AttributeError, OSError):
            policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
            os.sched_setscheduler(self.proc.pid, policy, os.sched_param(0))

    def alive(self) -> bool:
        return self.gone is None and self.proc.poll() is None

    def close(self) -> None:
        self._finalizer()


def _shutdown(sock: socket.socket, proc: subprocess.Popen) -> None:
    """End the writer process: its socket's end is its signal to exit; killed if it does not."""
    with contextlib.suppress(OSError):
        sock.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
