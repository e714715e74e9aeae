"""The attempt history: one record per try of a task, and what a run's tries add up to.

A try's time splits into what survived and what was lost. Lost: the restart (from the try's start to
its first training step: launch, rendezvous, checkpoint load; the first try's start-up is not a
failure's cost), torchrun's group restarts inside the try (each from the save of the checkpoint it
resumed from to its first step), the work since the last checkpoint the try committed (for a failed
try), and Airflow's own retry latency (the gap between one try's end and the next one's start). The rest is
productive. The stability view and the run report read these records.
"""

from __future__ import annotations

from typing import Any, Literal

from ballast.records.base import Record

Outcome = Literal["success", "failed", "cancelled", "running"]


class Attempt(Record):
    """One try of a task (`runs/<dag>/<run>/attempts/<task>.json` holds a task's tries in order)."""

    try_number: int
    """Airflow's try number (1-based)."""
    outcome: Outcome
    """success, failed, cancelled, or running (a try that ended without recording itself: its next try
    found it so, and completed the record from what it left)."""
    failure_class: str | None = None
    """What the try died of (training.failure_patterns classes); None on success or cancel."""
    reason: str | None = None
    """One line: the failure, or why the class was concluded."""
    exit_code: int | None = None
    """torchrun's exit status (a trainer's class code, or a negative signal number)."""
    host: str
    """The host the try ran on (the failing rank's where known)."""
    started: float
    """Unix time the try started."""
    ended: float | None = None
    """Unix time the try ended."""
    first_step_at: float | None = None
    """Unix time of the try's first training step."""
    step_reached: int | None = None
    """The last optimizer step the try completed."""
    resumed_from: str | None = None
    """The checkpoint the try resumed from (None: from scratch)."""
    resumed_step: int | None = None
    """That checkpoint's step."""
    last_commit_step: int | None = None
    """The newest checkpoint the try committed (None: it committed none)."""
    last_commit_at: float | None = None
    """Unix time that checkpoint was committed."""
    adaptation: list[str] = []
    """What this try changed because of the tries before it, one line each."""
    settings: dict[str, Any] = {}
    """The adapted settings the try ran with (micro_batch_size, pool, avoid_hosts)."""
    group_restarts: int = 0
    """torchrun's restarts of the process group inside this try (a rank killed outright)."""
    group_restart_lost_seconds: float = 0.0
    """What those restarts cost: for each, its resumed checkpoint's save to the group's first step."""
    last_group_first_step_at: float | None = None
    """Unix time of the last group's first step (after the last restart)."""
    warmup_lost_seconds: float = 0.0
    """What each group after a restart (or a new try) took over the try's steady pace for its first
    steps: the writer process, the loader workers and the page cache starting again (0.5-1 s each on
    this project's 2-core machine; a clean run pays it once, at its start, which is not counted)."""
    restart_seconds: float = 0.0
    """Start of the try to its first step (0 for the first try: start-up is no failure's cost)."""
    lost_seconds: float = 0.0
    """Restart time, the group restarts' cost, the warm-ups after them, and, for a failed try, the work
    since its last commit (or since its last group's first step)."""

    @property
    def seconds(self) -> float:
        return max(0.0, (self.ended or self.started) - self.started)


class AttemptHistory(Record):
    """A task's tries, oldest first."""

    version: int = 1
    """Record format version."""
    task_id: str
    """The Airflow task."""
    attempts: list[Attempt] = []
    """One per try, oldest first."""


class RecoverySummary(Record):
    """What a run's tries add up to (the run report's `recovery`)."""

    tries: int
    """Tries of the training tasks, all together."""
    failures_by_class: dict[str, int]
    """Failed tries per failure class."""
    cancelled: int
    """Tries ended by a cancel (not failures)."""
    wall_seconds: float
    """From the first try's start to the last one's end."""
    productive_seconds: float
    """Wall time whose training survived."""
    lost_seconds: float
    """Restarts and work lost since the last checkpoint."""
    retry_wait_seconds: float
    """Time between a try's end and the next one's start (Airflow's retry delay and scheduling)."""
    effective_ratio: float
    """productive / wall (1.0: nothing lost)."""
    mtbf_seconds: float | None
    """Wall time per failure, group restarts counted (None without failures)."""
    group_restarts: int = 0
    """torchrun's in-try group restarts, all tries together (each a failure the try survived)."""

    @classmethod
    def of(cls, histories: list[AttemptHistory]) -> RecoverySummary:
        tries = [a for h in histories for a in h.attempts]
        by_class: dict[str, int] = {}
        for a in tries:
            if a.outcome == "failed":
                key = a.failure_class or "unknown"
                by_class[key] = by_class.get(key, 0) + 1
        wait = 0.0
        for h in histories:
            for before, after in zip(h.attempts, h.attempts[1:]):
                if before.ended is not None:
                    wait += max(0.0, after.started - before.ended)
        if not tries:
            return cls(tries=0, failures_by_class={}, cancelled=0, wall_seconds=0.0, productive_seconds=0.0,
                       lost_seconds=0.0, retry_wait_seconds=0.0, effective_ratio=1.0, mtbf_seconds=None)
        start = min(a.started for a in tries)
        end = max((a.ended or a.started) for a in tries)
        wall = max(0.0, end - start)
        lost = sum(a.lost_seconds for a in tries)
        productive = max(0.0, sum(a.seconds for a in tries) - lost)
        restarts = sum(a.group_restarts for a in tries)
        failures = sum(by_class.values()) + restarts
        return cls(group_restarts=restarts, tries=len(tries), failures_by_class=by_class,
                   cancelled=sum(a.outcome == "cancelled" for a in tries), wall_seconds=round(wall, 3),
                   productive_seconds=round(productive, 3), lost_seconds=round(lost, 3),
                   retry_wait_seconds=round(wait, 3), effective_ratio=round(productive / wall, 4) if wall else 1.0,
                   mtbf_seconds=round(wall / failures, 3) if failures else None)
