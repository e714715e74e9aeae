"""The background checkpoint writer: one save in flight, at idle CPU priority where asked.

Kept apart from the commit protocol: this module decides *when and on which thread* a checkpoint is
written; commit.py decides what a written checkpoint is. Importing it does not import torch.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast.training.checkpoint import arena, writer_process
from ballast.training.checkpoint.commit import Writer, prune
from ballast.training.checkpoint.fileio import helper_cpu_seconds, offloading, staging_buffer
from ballast.training.failure import CheckpointFailure, TrainingFailure, classify
from ballast.training.forkgate import GATE

SWITCH_INTERVAL = 0.0005
"""The interpreter's thread switch interval while a background write runs (Python's default: 5 ms).
The writer spends much of a save in Python (DCP's planning and serialisation, holding the GIL), and
the training thread, each time it comes back from an op that released the GIL, waits up to one interval
for it: many times a step. Shorter slices cost only more frequent switches. Measured by
`ballast bench sharded-checkpoint` on one rank with a core of its own (README)."""


@contextlib.contextmanager
def _short_switch_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class AsyncSaver:
    """Writes checkpoint snapshots in a background thread, one save in flight at a time.

    Training is blocked only while the snapshot is taken (a CPU copy of the state). The writer's
    barriers run on a process group of their own (`barrier`), never on the training group, so its
    collectives cannot interleave with training's (the hang seen with async_save on the training group).

    With `idle`, the background writer runs in Linux's SCHED_IDLE class: it gets a core only when
    nothing else wants it, so hashing and serialising ~1 GB does not take CPU time from training (on
    a 2-core machine running two ranks, a save at normal priority cost each step loop ~0.5 s). A
    caller that waits for the write (the next save, the end of the run) leaves its own core idle,
    which the writer then gets; the writer is also put back to normal priority where the process is
    allowed to (raising a priority may need CAP_SYS_NICE). Synchronous saves run in the caller's
    thread at its priority.
    """

    def __init__(self, root: Path, *, rank: int, barrier: Callable[[], Any], keep_last: int,
                 log: Callable[[str], Any] = print, idle: bool = False, process: bool = False,
                 on_written: Callable[[int, float, float], Any] | None = None, **writer: Any):
        self.root = Path(root)
        self.writer = writer  # the Writer's node_local, local_rank and gather (commit.Writer)
        self.rank = rank
        self.barrier = barrier
        self.keep_last = keep_last
        self.log = log
        self.idle = idle
        # (step, seconds, cpu_seconds), from the writer once a checkpoint is committed: the time since its
        # write began, and the CPU time the writing thread used in it (what it takes from training on a
        # machine whose cores training keeps busy).
        self.on_written = on_written
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self.staging = staging_buffer()  # one save at a time: the writer's staging buffer is reused (DCP's shards too)
        self._verified: dict[Path, tuple] = {}  # what prune has verified (commit.prune's memo)
        # Background writes' bytes written by a process of their own (checkpoint.writer_process), started
        # at the first one; None until then, and for good where it could not be started.
        self.use_process = process and arena.available()
        self.process: writer_process.WriterProcess | None = None

    def save(self, step: int, tensors: dict[str, Any], jsons: dict[str, Any], *, keep: set[int],
             asynchronous: bool = True, shards: Callable[[Path], dict[str, Any]] | None = None) -> None:
        """`shards`: writes this rank's part of a sharded state into the given directory, collectively
        (checkpoint.dcp.write), and returns the files it wrote, each with its (sha256, size) or None."""
        self.wait()
        args = (step, tensors, jsons, keep, shards)
        if not asynchronous:
            # Written and committed here; the pruning of older ones goes on in the background (the next
            # save, or the end of training, waits for it).
            leader = self._write(*args, prune_after=False)
            self.wait()  # raises what the write raised
            if leader:
                self._start(self._prune, (keep,), f"ckpt-{step}-prune")
            return
        self.start_process()
        self._start(self._write, args, f"ckpt-{step}")

    def start_process(self) -> None:
        """Start the writer process, from the thread that saves (its parent-death signal is tied to the
        thread that started it: the training thread, which outlives every save)."""
        if not self.use_process or (self.process is not None and self.process.alive()):
            return
        if self.process is not None:  # it died: the write of that save fell back to this process
            self.process.close()
        try:
            self.process = writer_process.WriterProcess(idle=self.idle, log=self.log)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self.use_process, self.process = False, None
            self.log(f"checkpoint writer process not started ({exc}); background saves are written by a thread")

    def close(self) -> None:
        """Wait for the save in flight, then end the writer process (also when the saver is collected)."""
        try:
            self.wait()
        finally:
            if self.process is not None:
                self.process.close()

    def _start(self, target: Callable[..., Any], args: tuple, name: str) -> None:
        self._thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._thread.start()

    def _prune(self, keep: set[int]) -> None:
        """Remove the checkpoints past keep_last (not the newest, nor `keep`), on the node's leader."""
        if self.idle:
            _set_policy(0, "SCHED_IDLE")
        try:
            prune(self.root, keep_last=self.keep_last, keep=keep, log=self.log, memo=self._verified)
        except BaseException as exc:  # surfaced to the training thread by wait()
            self._error = exc

    def _write(self, step: int, tensors: dict[str, Any], jsons: dict[str, Any], keep: set[int],
               shards: Callable[[Path], dict[str, Any]] | None, prune_after: bool = True) -> bool:
        """Write and commit a checkpoint (then prune, with `prune_after`); whether it committed and this
        rank is its node's leader (the one that prunes)."""
        t0, cpu0 = time.monotonic(), time.thread_time() + helper_cpu_seconds()  # with its hashing threads'
        background = threading.current_thread() is self._thread
        process = self.process if background and self.process is not None and self.process.alive() else None
        if self.idle and background:
            _set_policy(0, "SCHED_IDLE")
            if process is not None:
                process.set_idle(True)
        # A shorter switch interval while this thread writes (SWITCH_INTERVAL): training waits less for the
        # GIL. The files' bytes are written by the writer process where there is one (fileio.offloading).
        with _short_switch_interval() if background else contextlib.nullcontext(), offloading(process):
            try:
                w = Writer(self.root, step, rank=self.rank, barrier=self.barrier, staging=self.staging, **self.writer)
                w.begin()
                if shards is not None:
                    with GATE:
                        written = shards(w.tmp)
                    for name, digest in written.items():
                        w.adopt(name, digest)
                for name, obj in tensors.items():
                    with GATE:  # no loader worker is forked while torch.save runs here (training.forkgate)
                        w.write_tensors(name, obj, zip_crc=name == "model.pt")
                for name, obj in jsons.items():
                    with GATE:
                        w.write_json(name, obj)
                self.last_path = w.commit()
                if self.on_written is not None:
                    self.on_written(step, time.monotonic() - t0, time.thread_time() + helper_cpu_seconds() - cpu0)
                if w.leader:  # each node prunes its own disk where the directories are node-local
                    _remember_verified(self._verified, self.last_path)
                    if prune_after:
                        prune(self.root, keep_last=self.keep_last, keep=keep, log=self.log, memo=self._verified)
                return w.leader
            except BaseException as exc:  # surfaced to the training thread by wait()
                self._error = exc
                return False

    def wait(self) -> None:
        if self._thread is not None:
            if self.idle and self._thread.is_alive() and self._thread.native_id is not None:
                _set_policy(self._thread.native_id, "SCHED_OTHER")  # someone waits for it now
                if self.process is not None:
                    self.process.set_idle(False)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            # A save that failed because a peer went away (the writer's barrier) is that, not bad files.
            cls = classify(exc)
            if cls in ("communication", "hang", "oom", "hardware"):
                raise TrainingFailure(f"{self.root}: checkpoint save failed: {exc}", failure_class=cls) from exc
            raise CheckpointFailure(f"{self.root}: checkpoint save failed: {exc}") from exc


def _remember_verified(memo: dict[Path, tuple], path: Path) -> None:
    """Enter a checkpoint this writer has just committed into prune's memo of verified ones: its manifest
    holds the sha256 of the bytes this save wrote (hashed as written, or read back once by the rank that
    wrote them), so prune's `verify` would only hash the same bytes again (~0.7 s per GB on the leader,
    inside every synchronous save; measured by `ballast bench sharded-checkpoint`). Keyed as
    commit._verify_once keys its memo (the marker's and manifest's inode, mtime and size): a checkpoint
    whose marker or manifest changes afterwards is verified again."""
    from ballast.training.checkpoint.commit import COMMIT_MARKER, MANIFEST

    try:
        memo[path] = tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in ((path / COMMIT_MARKER).stat(),
                                                                          (path / MANIFEST).stat()))
    except OSError:
        memo.pop(path, None)  # prune verifies it


def _set_policy(tid: int, policy: str) -> bool:
    """Set a thread's scheduling policy (Linux: per thread; 0 = the calling thread); False where the
    OS has no such policy or refuses the change."""
    try:
        os.sched_setscheduler(tid, getattr(os, policy), os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False
