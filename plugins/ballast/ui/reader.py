"""Bounded, typed reads of one run's records (`ballast.ui.summary` reads through it).

Each record is read at most `MAX_RECORD_BYTES` (an event log: its last `MAX_EVENTS_BYTES`) and gets a
state: `ok`, `missing`, `partial` (cut by the bound, or a line being written) or `corrupt` (not what its
model accepts, or unreadable), with the problem in one line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from ballast.storage import Storage

MAX_RECORD_BYTES = 4 << 20
MAX_EVENTS_BYTES = 16 << 20
log = logging.getLogger(__name__)


@dataclass
class Reader:
    """Bounded, typed reads of one run's records, noting each one's state."""

    storage: Storage
    prefix: str
    states: dict[str, str] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)

    def raw(self, name: str, limit: int | None = None) -> bytes | None:
        key, limit = f"{self.prefix}/{name}", limit or MAX_RECORD_BYTES
        try:
            if not self.storage.exists(key):
                self.states[name] = "missing"
                return None
            size = self.storage.size(key)
            with self.storage.open_read(key, max(0, size - limit)) as fh:
                data = fh.read(limit)
        except Exception as exc:  # noqa: BLE001  (a storage error is this record's state, not the page's)
            # Its cause names buckets and endpoints: the operator's log has it, the viewer's page does not.
            log.warning("Training stability view: %s could not be read: %s", key, exc)
            self.states[name], self.problems[name] = "corrupt", "could not be read (the API server's log has the cause)"
            return None
        self.states[name] = "ok" if size <= limit else "partial"
        if size > limit:
            self.problems[name] = f"only its last {_size(limit)} of {_size(size)} read"
        return data

    def record(self, name: str, model: type[BaseModel]) -> Any:
        data = self.raw(name)
        if data is None:
            return None
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top)"
            self.states[name], self.problems[name] = "corrupt", f"{where}: {first['msg']}"
            return None

    def jsonl(self, name: str) -> list[dict]:
        data = self.raw(name, MAX_EVENTS_BYTES)
        if data is None:
            return []
        lines = data.split(b"\n")
        if self.states[name] == "partial":
            lines = lines[1:]  # the first line was cut by the bounded read
        from ballast.training.outputs import parse_events  # the trainer's declared event line

        # A line being written, or damage, or one without a finite step and time, is a bad one.
        out, bad = parse_events(lines)
        if bad:
            self.states[name] = "partial"
            self.problems[name] = f"{bad} unreadable line(s) skipped"
        return out


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"
