"""A training process's dealings with its supervisor: the heartbeat, the hang watchdog and the
preemption notice.

- heartbeat: the watchdog is fed every step; at most once a second the heartbeat file the orchestrator
  watches is replaced and the slower gauges (process memory, NVML) are read;
- watchdog: no progress for `execution.hang_timeout_seconds` dumps every thread's stack, writes a
  `hang` failure record and ends the process with its code;
- SIGTERM (spot reclaim, node drain): noted for the training loop, which agrees on it with the other
  ranks and commits a checkpoint; past `recovery.preempt_grace_seconds` the process ends with the
  preempted code and the last committed checkpoint stands.

SIGTERM is only ever a preemption notice (the orchestrator sends it too when it ends a stalled group or
one whose cache warm-up failed, where a checkpoint is worth having). A cancel SIGKILLs the whole
process group instead (ballast.launch.process), and a task that dies takes its ranks with it by their
parent-death signals (training.launch), so a rank never waits out the grace for a peer, or an agent,
that is already gone. Should the grace still expire after the task that reads this try has died
(nobody reads the output any more), the rank ends without a record: the try is abandoned, not preempted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ballast.training.failure import EXIT_CODES, Preempted, TrainingFailure, write_record
from ballast.training.monitor import Nvml, Watchdog, memory_bytes
from ballast.training.outputs import Heartbeat, write_heartbeat


class Supervision:
    def __init__(self, *, out: Path, rank: int, device: Any, metrics: Any, hang_timeout: float,
                 preempt_grace: float, step: Callable[[], int]):
        self.out, self.rank, self.device, self.metrics = out, rank, device, metrics
        self.hang_timeout, self.preempt_grace, self.step = hang_timeout, preempt_grace, step
        self.preempt_at: float | None = None
        self._slow_at = 0.0  # last heartbeat-file write and slow-gauge read
        self.nvml = Nvml(device if device.type == "cuda" else None)
        self.watchdog = Watchdog(hang_timeout, out_dir=out, rank=rank, on_hang=self._on_hang).start()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        (out / f"pid-rank{rank}").write_text(str(os.getpid()))  # which process is which rank, for the outside

    @property
    def preempted(self) -> bool:
        return self.preempt_at is not None

    def heartbeat(self, force: bool = True) -> None:
        """Progress for the watchdog (every step) and, at most once a second unless forced, for the
        outside: the heartbeat file the orchestrator watches and the slower gauges (process memory from
        /proc, NVML), which cost more than a step's other bookkeeping together."""
        self.watchdog.beat()
        now = time.monotonic()
        if not force and now - self._slow_at < 1.0:
            return
        self._slow_at = now
        self.metrics.set(memory_bytes=memory_bytes(self.device), **self.nvml.read())
        if self.rank == 0:  # replaced atomically so readers never see it half written
            write_heartbeat(self.out, Heartbeat(step=self.step(), time=time.time()))

    def stop(self) -> None:
        self.watchdog.stop()

    def _on_sigterm(self, signum, frame) -> None:
        if self.preempt_at is None:
            self.preempt_at = time.monotonic()
            # Past the grace period the process goes without a checkpoint; the last committed one stands.
            timer = threading.Timer(self.preempt_grace, self._grace_expired)
            timer.daemon = True
            timer.start()

    def _grace_expired(self) -> None:
        from ballast.training.parentdeath import output_orphaned

        if output_orphaned():
            os._exit(EXIT_CODES["preempted"])
        write_record(self.out, Preempted(f"SIGTERM grace period of {self.preempt_grace:.0f}s expired before a"
                                         f" checkpoint was committed"), step=self.step(), rank=self.rank)
        os._exit(EXIT_CODES["preempted"])

    def _on_hang(self) -> None:
        write_record(self.out, TrainingFailure(f"no progress for {self.hang_timeout:.0f}s (watchdog); stacks in"
                                               f" stacks-rank{self.rank}.txt", failure_class="hang"),
                     step=self.step(), rank=self.rank)
        os._exit(EXIT_CODES["hang"])
