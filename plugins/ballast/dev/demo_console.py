"""What `ballast demo` shows while a run works: one line per stage as it finishes, the progress of long
stages (conversion, cache warm-up, training epochs), then the summary. Airflow's own output (thousands of
log lines from dag.test, the task runner and the training processes) goes to a file whose path is
printed first; `--verbose` keeps it on the console instead.

The console reads what the run writes to its storage directory anyway (stage records, progress
records, the trainer's event log), so it needs no hook into Airflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, TextIO


@contextlib.contextmanager
def output_to(log_path: Path) -> Iterator[TextIO]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so the subprocesses it starts
    too) to `log_path`; yield a stream to the real console."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield console
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
        console.close()


class StageWatcher(threading.Thread):
    """Prints each stage record as it appears under `runs_dir` (the DAG's runs, local storage), and
    the progress of the stage at work at most every `every` seconds."""

    def __init__(self, runs_dir: Path, console: TextIO, *, started: float, every: float = 10.0):
        super().__init__(name="demo-console", daemon=True)
        self.runs_dir, self.console, self.started, self.every = runs_dir, console, started, every
        self._done = threading.Event()
        self._seen: set[str] = set()
        self._last_progress: dict[str, float] = {}
        self._shown: dict[str, object] = {}
        self._events_at = 0
        self._last = time.monotonic()
        self.run_dir: Path | None = None

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)
        self.poll()  # what finished in the last interval

    def run(self) -> None:
        while not self._done.wait(1.0):
            try:
                self.poll()
            except (OSError, ValueError):
                continue  # a record being replaced: read it next time

    def _find_run(self) -> Path | None:
        if self.run_dir is None and self.runs_dir.is_dir():
            mine = [p for p in self.runs_dir.iterdir() if (p / "spec.json").is_file()
                    and (p / "spec.json").stat().st_mtime >= self.started - 1]
            self.run_dir = max(mine, key=lambda p: (p / "spec.json").stat().st_mtime) if mine else None
        return self.run_dir

    def poll(self) -> None:
        run = self._find_run()
        if run is None:
            return
        self._epochs(run)  # before the stage records: train's last epoch comes before its "done" line
        stages = run / "stages"
        records = sorted(stages.glob("*.json"), key=lambda p: p.stat().st_mtime) if stages.is_dir() else []
        for path in records:
            if path.stem not in self._seen:
                self._seen.add(path.stem)
                now = time.monotonic()
                self.say(f"  done  {path.stem:<28} {now - self._last:6.1f}s  {_summary(path)}")
                self._last = now
        progress = run / "progress"
        for path in sorted(progress.glob("*.json")) if progress.is_dir() else []:
            if path.stem in self._seen or time.monotonic() - self._last_progress.get(path.stem, 0) < self.every:
                continue
            p = json.loads(path.read_text())
            if p.get("finished") or not p.get("total") or self._shown.get(path.stem) == p.get("done"):
                continue  # done, empty, or no further than the line already printed
            self._shown[path.stem] = p.get("done")
            self._last_progress[path.stem] = time.monotonic()
            eta = f", ETA {p['eta_seconds']:.0f}s" if p.get("eta_seconds") is not None else ""
            self.say(f"        {p['what']}: {p['done']:,}/{p['total']:,} {p['unit']}"
                     f" ({100 * p['done'] / p['total']:.0f}%, {p['rate_per_second']:,.0f} {p['unit']}/s{eta})")

    def _epochs(self, run: Path) -> None:
        events = run / "train" / "metrics.jsonl"
        if not events.is_file() or events.stat().st_size <= self._events_at:
            return
        with events.open("rb") as f:
            f.seek(self._events_at)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self._events_at += end
        last_step = None
        for line in chunk[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "step" and e.get("rank", 0) == 0:
                last_step = e
            if e.get("event") == "epoch" and e.get("rank", 0) == 0:
                scores = ", ".join(f"{k} {v:.4f}" for k, v in e.items()
                                   if isinstance(v, float) and k not in ("time", "lr", "samples", "step"))
                self.say(f"        train epoch {e.get('epoch', 0) + 1}: validation {scores}")
                last_step = None
        now = time.monotonic()
        if last_step is not None and now - self._last_progress.get("train", 0) >= self.every \
                and self._shown.get("train") != last_step.get("step"):
            self._shown["train"] = last_step.get("step")
            self._last_progress["train"] = now
            loss = last_step.get("loss")
            self.say(f"        train: step {last_step.get('step')}, epoch {last_step.get('epoch', 0) + 1}"
                     + (f", loss {loss:.4f}" if isinstance(loss, float) else ""))

    def say(self, line: str) -> None:
        self.console.write(line + "\n")


def _summary(path: Path) -> str:
    """A few words on what a stage record says."""
    try:
        r = json.loads(path.read_text())
    except ValueError:
        return ""
    stage = path.stem.split(".")[-1]
    if stage == "validate":
        return f"{r.get('rows', '?')} rows valid" + (f", {r['quarantine']['rows']} quarantined"
                                                     if r.get("quarantine") else "")
    if stage == "convert":
        return f"{'reused ' if r.get('reused') else ''}dataset {r.get('dataset_id')}: {r.get('rows')}"
    if stage == "train":
        early = ", stopped early" if r.get("stopped_early") else ""
        return f"{r.get('epochs')} epochs, {r.get('steps')} steps{early}"
    if stage == "evaluate":
        return f"test {r.get('metric')} {r.get('value', float('nan')):.4f}"
    if stage == "publish":
        return f"published {r.get('published_version')}" if r.get("published") else "not published"
    return ""
