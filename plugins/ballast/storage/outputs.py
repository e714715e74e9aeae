"""A try's progress files to remote storage, for readers that only see storage (the stability view).

Where the run's storage is a file system, the trainers write their event log and heartbeat there and
nothing is copied. With S3, `OutputsUpload` copies `metrics.jsonl`, `curves.json`, `heartbeat` and `summary.json` from
the try's local output directory to `runs/<dag>/<run>/train/` every `interval` seconds while it trains,
and once more when it stops. The event log only grows: each copy sends its new bytes (S3Storage.append),
not the whole log again.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ballast.training.curves import CURVES
from ballast.training.outputs import EVENTS, HEARTBEAT, SUMMARY

FILES = (EVENTS, CURVES, HEARTBEAT, SUMMARY)  # what the view reads of a try, named by the trainer's contract


def upload_outputs(ctx: Any, out_dir: Path, stored: dict[str, int] | None = None) -> list[str]:
    """Copy what exists of FILES to storage; the keys written. Errors are the caller's to log.
    `stored`: the event log's bytes already in storage from earlier calls (kept by the caller): only its
    new bytes are sent (the storage's `append`, where it has one), so copying it every few seconds
    costs what it grew by, not its whole length again."""
    if ctx.storage.local_path(ctx.run_key) is not None:
        return []
    written = []
    for name in FILES:
        path = Path(out_dir) / name
        if path.is_file():
            key = f"{ctx.run_key}/train/{name}"
            if name == EVENTS and stored is not None and hasattr(ctx.storage, "append"):
                before = stored.get(key, 0)
                stored[key] = ctx.storage.append(path, key, before)
                if stored[key] == before:
                    continue  # unchanged
            else:
                ctx.storage.upload(path, key)
            written.append(key)
    return written


def copy_outputs(ctx: Any, out_dir: Path, stored: dict[str, int] | None = None) -> None:
    """`upload_outputs`, a failure only logged: progress for the view; training goes on without it."""
    try:
        upload_outputs(ctx, out_dir, stored)
    except Exception as exc:  # noqa: BLE001
        if stored is not None:
            stored.clear()  # what is stored is not known now: the next copy checks it
        ctx.log.warning("could not copy training progress to storage: %s", exc)


class OutputsUpload(threading.Thread):
    def __init__(self, ctx: Any, out_dir: Path, *, interval: float = 15.0):
        super().__init__(name="outputs-upload", daemon=True)
        self.ctx, self.out_dir, self.interval = ctx, Path(out_dir), interval
        self._done = threading.Event()
        self._lock = threading.Lock()  # one copy at a time: the final one is never overtaken by an older
        self._stored: dict[str, int] = {}  # the event log's bytes in storage: each copy sends what is new

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self._once()

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=self.interval + 30)
        self._once()

    def _once(self) -> None:
        with self._lock:
            copy_outputs(self.ctx, self.out_dir, self._stored)
