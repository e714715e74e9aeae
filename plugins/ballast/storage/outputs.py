"""A try's progress files to remote storage, for readers that only see storage (the stability view).

Where the run's storage is a file system, the trainers write their event log and heartbeat there and
nothing is copied. With S3, `OutputsUpload` copies `metrics.jsonl`, `curves.json`, `heartbeat` and `summary.json` from
the try's local output directory to `runs/<dag>/<run>/train/` every `interval` seconds while it trains,
and once more when it stops.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ballast.training.curves import CURVES
from ballast.training.outputs import EVENTS, HEARTBEAT, SUMMARY

FILES = (EVENTS, CURVES, HEARTBEAT, SUMMARY)  # what the view reads of a try, named by the trainer's contract


def upload_outputs(ctx: Any, out_dir: Path) -> list[str]:
    """Copy what exists of FILES to storage; the keys written. Errors are the caller's to log."""
    if ctx.storage.local_path(ctx.run_key) is not None:
        return []
    written = []
    for name in FILES:
        path = Path(out_dir) / name
        if path.is_file():
            key = f"{ctx.run_key}/train/{name}"
            ctx.storage.upload(path, key)
            written.append(key)
    return written


def copy_outputs(ctx: Any, out_dir: Path) -> None:
    """`upload_outputs`, a failure only logged: progress for the view; training goes on without it."""
    try:
        upload_outputs(ctx, out_dir)
    except Exception as exc:  # noqa: BLE001
        ctx.log.warning("could not copy training progress to storage: %s", exc)


class OutputsUpload(threading.Thread):
    def __init__(self, ctx: Any, out_dir: Path, *, interval: float = 15.0):
        super().__init__(name="outputs-upload", daemon=True)
        self.ctx, self.out_dir, self.interval = ctx, Path(out_dir), interval
        self._done = threading.Event()
        self._lock = threading.Lock()  # one copy at a time: the final one is never overtaken by an older

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self._once()

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=self.interval + 30)
        self._once()

    def _once(self) -> None:
        with self._lock:
            copy_outputs(self.ctx, self.out_dir)
