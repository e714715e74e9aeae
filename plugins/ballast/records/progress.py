"""Where a long stage is while it works: the numbers its task log prints, for the stability view."""

from __future__ import annotations

from ballast.records.base import Record


class StageProgress(Record):
    """`runs/<dag>/<run>/progress/<stage>.json`, rewritten at most every few seconds while the stage
    works (and once when it is done): done of total, the rate and the ETA, as the task log says them."""

    version: int = 1
    """Record format version."""
    stage: str
    """The pipeline stage (convert, warm_cache)."""
    what: str
    """The piece of work: 'convert', or 'cache phase <name>'."""
    unit: str
    """What `done` and `total` count: rows or bytes."""
    done: int
    """Units done so far."""
    total: int
    """Units the work has in all."""
    rate_per_second: float
    """Units per second since the work started."""
    eta_seconds: float | None
    """Seconds left at that rate (None before any unit is done)."""
    started: float
    """When the work started (Unix time)."""
    updated: float
    """When this record was written (Unix time): a stale one belongs to a task that stopped."""
    finished: bool = False
    """The work is done (the stage may still be saving its result)."""
