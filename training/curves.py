"""A bounded, downsampled history of a run's curves (`curves.json`, rank 0), for the stability view.

The event log grows with the run and the view reads only its last `MAX_EVENTS_BYTES`; this history
keeps the whole run in O(`BUCKETS`) memory and file size, as TensorBoard's reservoir keeps a bounded
sample: each bucket covers `span` consecutive steps (a power of two; bucket `i` covers steps
`[i*span, (i+1)*span)`) and holds, per curve, the count, min, max and sum of the values logged in it.
When a step falls past the last bucket, adjacent pairs merge (min of mins, max of maxes, sums and
counts added: the mean stays count-weighted and exact) and the span doubles, until it fits.

Beside the curves, the marks the view must never lose to the log's lost head: the anomalies rank 0
logged (one per step and kind) and the steps each try resumed from, each list bounded (`MAX_MARKS`:
the first half and the newest half are kept, `dropped` counts the rest).

A step is recorded once, the first time it is logged: a resumed try logs the steps after its
checkpoint again, and those repeats leave the history as it was (the tail of the log has the newest).
Non-finite values are not in a bucket (the anomaly marks carry them). Written atomically
(`outputs._atomic`) every `FLUSH_SECONDS`, at each rarer event (a checkpoint, an epoch, a resume) and
when the metrics close; a new try of the run loads it and goes on.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

CURVES = "curves.json"
BUCKETS = 1024
SERIES = ("loss", "grad_norm", "lr", "loss_scale")
MAX_MARKS = 2048
FLUSH_SECONDS = 15.0
VERSION = 1


class SeriesBuckets(BaseModel):
    """One curve's buckets, index for index with `CurveHistory.time`: count, min, max, sum (empty: 0 and
    None)."""

    model_config = ConfigDict(extra="forbid")

    n: list[int] = Field(default_factory=list)
    min: list[float | None] = Field(default_factory=list)
    max: list[float | None] = Field(default_factory=list)
    sum: list[float] = Field(default_factory=list)


class Marks(BaseModel):
    """A bounded list of marks: the first half kept, then the newest; `dropped` counts those between."""

    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(default_factory=list)
    dropped: int = 0

    def add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        if len(self.items) > MAX_MARKS:
            del self.items[MAX_MARKS // 2]
            self.dropped += 1


class CurveHistory(BaseModel):
    """The file's model (`curves.json`) and the accumulator the trainer feeds (`add_step`)."""

    model_config = ConfigDict(extra="forbid")

    version: int = VERSION
    span: int = 1
    """Steps per bucket: a power of two."""
    last_step: int = -1
    """The newest step recorded; a step at or below it is a repeat and is skipped."""
    steps: int = 0
    """Steps recorded in all."""
    time: list[float | None] = Field(default_factory=list)
    """Per bucket: the unix time of its newest step."""
    first: list[int | None] = Field(default_factory=list)
    """Per bucket: its first step recorded."""
    series: dict[str, SeriesBuckets] = Field(default_factory=lambda: {k: SeriesBuckets() for k in SERIES})
    anomalies: Marks = Field(default_factory=Marks)
    resumes: Marks = Field(default_factory=Marks)
    updated: float = 0.0

    # -- feeding ---------------------------------------------------------------------------------------

    def add_step(self, step: int, at: float, values: dict[str, Any]) -> bool:
        """Record one logged step's values (names of SERIES; others ignored); False for a repeat."""
        if step <= self.last_step or step < 0:
            return False
        while step // self.span >= BUCKETS:
            self._halve()
        i = step // self.span
        if i >= len(self.time):
            grow = i + 1 - len(self.time)
            self.time.extend([None] * grow)
            self.first.extend([None] * grow)
            for s in self.series.values():
                s.n.extend([0] * grow)
                s.min.extend([None] * grow)
                s.max.extend([None] * grow)
                s.sum.extend([0.0] * grow)
        self.time[i] = at
        if self.first[i] is None:
            self.first[i] = step
        for name in SERIES:
            v = values.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            s = self.series.get(name)
            if s is None:  # a file from a trainer that had not this curve
                m = len(self.time)
                s = self.series[name] = SeriesBuckets(n=[0] * m, min=[None] * m, max=[None] * m, sum=[0.0] * m)
            v = float(v)
            s.n[i] += 1
            s.sum[i] += v
            s.min[i] = v if s.min[i] is None else min(s.min[i], v)
            s.max[i] = v if s.max[i] is None else max(s.max[i], v)
        self.last_step, self.steps = step, self.steps + 1
        return True

    def _halve(self) -> None:
        """Merge adjacent bucket pairs and double the span."""
        def pairs(xs: list) -> list[tuple]:
            padded = xs + [None] * (len(xs) % 2)
            return list(zip(padded[0::2], padded[1::2]))

        def lo(a, b):
            return b if a is None else a if b is None else min(a, b)

        def hi(a, b):
            return b if a is None else a if b is None else max(a, b)

        self.time = [hi(a, b) for a, b in pairs(self.time)]
        self.first = [lo(a, b) for a, b in pairs(self.first)]
        for s in self.series.values():
            s.n = [a + (b or 0) for a, b in pairs(s.n)]
            s.sum = [a + (b or 0.0) for a, b in pairs(s.sum)]
            s.min = [lo(a, b) for a, b in pairs(s.min)]
            s.max = [hi(a, b) for a, b in pairs(s.max)]
        self.span *= 2

    def add_anomaly(self, step: int, kind: Any, loss: Any = None, zscore: Any = None) -> None:
        kind = kind if isinstance(kind, str) else None
        if any(m.get("step") == step and m.get("kind") == kind for m in self.anomalies.items[-8:]):
            return  # one mark per step and kind
        self.anomalies.add({"step": step, "kind": kind, "loss": _finite(loss), "zscore": _finite(zscore)})

    def add_resume(self, step: int) -> None:
        self.resumes.add({"step": step})  # the steps it logs again, up to `last_step`, are repeats

    # -- reading ---------------------------------------------------------------------------------------

    def buckets(self, *, before: int | None = None) -> list[dict[str, Any]]:
        """The non-empty buckets in step order (those with a step before step `before`, when given):
        first and last step recorded, time, and per curve n, min, max and mean."""
        out = []
        for i, at in enumerate(self.time):
            first = self.first[i] if i < len(self.first) else None
            if first is None:
                continue
            if before is not None and first >= before:
                break
            row: dict[str, Any] = {"first": first, "last": min((i + 1) * self.span - 1, self.last_step), "time": at}
            for name, s in self.series.items():
                if i < len(s.n) and s.n[i]:
                    row[name] = {"n": s.n[i], "min": s.min[i], "max": s.max[i], "mean": s.sum[i] / s.n[i]}
            out.append(row)
        return out


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def parse_history(data: bytes | str | None) -> CurveHistory | None:
    """A `curves.json`; None when missing or not one (the view then has the log's tail alone)."""
    if not data:
        return None
    try:
        return CurveHistory.model_validate_json(data)
    except (ValidationError, ValueError):
        return None


def read_history(out_dir: Path) -> CurveHistory | None:
    try:
        return parse_history((Path(out_dir) / CURVES).read_bytes())
    except OSError:
        return None


def write_history(out_dir: Path, history: CurveHistory) -> None:
    from ballast.training.outputs import _atomic

    history.updated = time.time()
    _atomic(Path(out_dir) / CURVES, json.dumps(history.model_dump(), separators=(",", ":")))


class CurveRecorder:
    """Rank 0's history, fed from its events (`monitor.Metrics.event`) and flushed to `out_dir`."""

    def __init__(self, out_dir: Path, *, flush_seconds: float = FLUSH_SECONDS):
        self.out_dir = Path(out_dir)
        self.history = read_history(self.out_dir) or CurveHistory()
        self.flush_seconds = flush_seconds
        self._flushed = time.monotonic()
        self._dirty = False

    def event(self, name: str, step: int, at: float, fields: dict[str, Any]) -> None:
        if name == "step":
            self._dirty |= self.history.add_step(int(step), at, fields)
            if time.monotonic() - self._flushed >= self.flush_seconds:
                self.flush()
            return
        if name == "anomaly":
            self.history.add_anomaly(int(step), fields.get("kind"), fields.get("loss"), fields.get("zscore"))
        elif name == "resume":
            self.history.add_resume(int(step))
        elif not self._dirty:
            return
        self._dirty = True
        self.flush()

    def flush(self) -> None:
        """Write the history now (a failure to is a warning: training goes on without the view's history)."""
        self._flushed = time.monotonic()
        if not self._dirty:
            return
        try:
            write_history(self.out_dir, self.history)
            self._dirty = False
        except OSError as exc:
            import sys

            print(f"[train] could not write {self.out_dir / CURVES}: {exc}", flush=True, file=sys.stderr)
