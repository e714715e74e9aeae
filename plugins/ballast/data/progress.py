"""Progress of long stage work (a conversion, a cache warm-up phase): logged in the task log (done,
total, rate, ETA) and recorded for the stability view, which shows a run in progress with the same
numbers (`StageProgress` at `runs/<dag>/<run>/progress/<stage>.json`). Both at most every `every`
seconds, and once when the work is done. Thread-safe: the warm-up counts from its download threads.

A progress record that cannot be written is one warning in the log: the work itself goes on."""

from __future__ import annotations

import threading
import time
from typing import Any

from ballast.records import StageProgress


class Progress:
    def __init__(self, log: Any, what: str, total: int, *, unit: str = "rows", every: float = 5.0,
                 ctx: Any = None, stage: str | None = None, files: int | None = None):
        """`ctx` and `stage`: where to record (a RunContext; none: the log only). `files`: with unit
        bytes, how many files the bytes are in (the log says files and MB)."""
        self.log, self.what, self.total, self.unit, self.every = log, what, total, unit, every
        self.ctx, self.stage, self.files_total = ctx, stage, files
        self.done = self.files = 0
        self.started = time.time()
        self.t0 = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._record_failed = False

    def start(self) -> Progress:
        """Record the work as begun (0 done), so the view shows it before the first report."""
        self._report(time.monotonic(), quiet=True)
        return self

    def add(self, n: int, *, files: int = 0) -> None:
        with self._lock:
            self.done += n
            self.files += files
            now = time.monotonic()
            if now - self._last >= self.every or self.done >= self.total:
                self._last = now
                self._report(now)

    def _report(self, now: float, *, quiet: bool = False) -> None:
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate else None
        if not quiet:
            if self.unit == "bytes":
                self.log.info("%s: %d/%d files, %.1f/%.1f MB, %.1f MB/s, ETA %.0fs", self.what, self.files,
                              self.files_total or 0, self.done / 1e6, self.total / 1e6, rate / 1e6, eta or 0.0)
            else:
                self.log.info("%s: %d/%d %s (%.0f%%), %.0f %s/s, ETA %.0fs", self.what, self.done, self.total,
                              self.unit, 100.0 * self.done / max(self.total, 1), rate, self.unit, eta or 0.0)
        if self.ctx is None or self.stage is None:
            return
        record = StageProgress(stage=self.stage, what=self.what, unit=self.unit, done=self.done, total=self.total,
                               rate_per_second=round(rate, 3), eta_seconds=None if eta is None else round(eta, 1),
                               started=self.started, updated=time.time(), finished=self.done >= self.total)
        try:
            self.ctx.storage.write_bytes(progress_key(self.ctx.run_key, self.stage), record.model_dump_json().encode())
        except Exception as exc:  # noqa: BLE001  (progress is for the view; the work goes on without it)
            if not self._record_failed:
                self._record_failed = True
                self.log.warning("progress of %s not recorded for the stability view: %s", self.what, exc)


def progress_key(run_key: str, stage: str) -> str:
    return f"{run_key}/progress/{stage}.json"
