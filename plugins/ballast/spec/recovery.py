"""The spec's `recovery` section: what each failure class may cost the run in new tries, after what
delay, and how a try adapts to the failure before it.

Airflow's retries are the mechanism (`ballast.recovery.policy` decides each one); torchrun's group
restarts (`max_restarts`) recover a crashed rank inside one try, before Airflow sees anything.

    recovery:
      policy:
        oom: 3                                   # shorthand for {retries: 3}
        communication: {per_hour: 20, delay_seconds: 10, backoff: 2}
      on_demand_after_preemptions: 2

Two kinds of budget, as a run that lasts weeks needs. The infrastructure's classes (a lost rank or
node, hardware, communication, preemption, a hang) are the weather of a large cluster: hundreds in a
long run. They have no lifetime count (`retries: null`); a task fails when they come faster than
`per_hour`, or when `stalled_tries` tries in a row end without a step past the furthest reached
before them. The classes a new try cannot fix or only adapts to (a bug, a bad config, bad data, an
out-of-memory, a divergence, the unknown) keep small counts. An entry names only what it changes; the
rest comes from the class's default (`DEFAULT_POLICY`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from ballast.training.config.sections import RecoverySettings, Section
from ballast.training.failure import FAILURE_CLASSES

FailureClass = Literal[FAILURE_CLASSES]  # type: ignore[valid-type]
"""What the orchestrator concludes a try died of (training.failure_patterns classifies it)."""

CLASS_NAMES: dict[str, str] = {
    "oom": "out-of-memory", "preempted": "preemption", "hang": "hang", "communication": "communication",
    "hardware": "hardware", "lost": "lost rank", "data": "bad data", "divergence": "divergence",
    "config": "config", "user_code": "user error", "unknown": "unknown",
}


class ClassPolicy(Section):
    """The budget and delay of one failure class."""

    retries: int | None = Field(ge=0, le=100)
    """New tries this class may cause in one task (0: the task fails at once); null: no count, the
    class is bounded by `per_hour` and by progress (`recovery.stalled_tries`)."""
    per_hour: float | None = Field(None, gt=0.0, le=3600.0)
    """Most failures of this class within any hour of the task: a class that comes faster fails it
    (training would spend its time restarting). None: no rate bound."""
    delay_seconds: float | None = Field(None, ge=0.0, le=86_400)
    """Wait before the first retry for this class; default recovery.retry_delay_seconds."""
    backoff: float = Field(1.0, ge=1.0, le=10.0)
    """Each further failure of this class multiplies the delay by this (2: exponential backoff)."""
    max_delay_seconds: float = Field(3600.0, ge=0.0, le=86_400)
    """Upper bound on the delay, whatever the backoff."""

    @model_validator(mode="after")
    def _bounded(self) -> ClassPolicy:
        if self.retries is None and self.per_hour is None:
            raise ValueError("retries: null needs per_hour (a class with no count is bounded by its rate)")
        return self

    def delay(self, nth: int, default: float) -> float:
        """Seconds to wait before the retry after this class's `nth` failure (1-based)."""
        base = self.delay_seconds if self.delay_seconds is not None else default
        return min(self.max_delay_seconds, base * self.backoff ** max(0, nth - 1))


# The seed documents: out-of-memory retried at most 3 times; preemptions are the cloud's weather (no
# delay, fall back to on-demand); errors a new try cannot fix fail at once. The infrastructure's
# classes are budgeted for a run of a month on a cluster (rates per hour, progress), never by a
# lifetime count that a long run is sure to use up: at the seeds' scale (an interruption every few
# hours, hundreds in a run) a count of 2 or 5 ends every long run.
DEFAULT_POLICY: dict[str, dict[str, Any]] = {
    "lost": {"retries": None, "per_hour": 30, "delay_seconds": 0.0},
    "preempted": {"retries": None, "per_hour": 30, "delay_seconds": 0.0},
    "communication": {"retries": None, "per_hour": 20, "backoff": 2.0, "max_delay_seconds": 600.0},
    "hardware": {"retries": None, "per_hour": 6},
    "hang": {"retries": None, "per_hour": 6},
    "oom": {"retries": 3, "delay_seconds": 0.0},
    "divergence": {"retries": 1, "delay_seconds": 0.0},
    "unknown": {"retries": 1},
    "data": {"retries": 0},
    "config": {"retries": 0},
    "user_code": {"retries": 0},
}
UNBOUNDED_TRIES = 10_000
"""The task's Airflow retries where a class has no count (`retries: null`): the policy ends it first,
by rate or by progress; `recovery.retries` sets a lower ceiling."""


def _default_policy() -> dict[str, ClassPolicy]:
    return {name: ClassPolicy(**entry) for name, entry in DEFAULT_POLICY.items()}


class RecoverySpec(RecoverySettings):
    policy: dict[FailureClass, ClassPolicy] = Field(default_factory=_default_policy)
    """Per failure class: retries (its count, or null), per_hour (its rate bound), delay_seconds,
    backoff, max_delay_seconds. Classes: oom, preempted, hang, communication, hardware, lost, data,
    divergence, config, user_code, unknown. An entry names what it changes (`oom: 1` is `oom: {retries: 1}`); the rest keeps the class's default."""
    retries: int | None = Field(None, ge=0, le=100)
    """Ceiling on a task's retries, whatever the classes; default the sum of the policy's budgets."""
    retry_delay_seconds: float = Field(30.0, ge=0.0, le=86_400)
    """Delay before a retry, for classes that set none of their own."""
    max_restarts: int = Field(3, ge=0, le=100)
    """torchrun restarts of the process group within one try: a rank killed outright and its peers'
    broken connections, seconds each, before Airflow sees anything (any other class ends the try)."""
    stalled_tries: int = Field(3, ge=1, le=100)
    """The task fails after this many failed tries in a row that reached no step past the furthest
    any earlier try reached (for the classes without a count: a fault that recurs before any progress
    is no weather)."""
    oom_micro_batch_factor: float = Field(0.5, gt=0.0, lt=1.0)
    """After an out-of-memory failure the next try multiplies the micro-batch by this factor
    (global batch kept through gradient accumulation)."""
    on_demand_after_preemptions: int = Field(2, ge=1, le=100)
    """After this many preemptions the next try asks the backend for the on-demand pool."""
    avoid_failed_hosts: bool = True
    """After a hang, communication or hardware failure, the next try asks the backend to avoid that host."""

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("policy"), dict):
            return data
        merged: dict[Any, Any] = {}
        for name, entry in data["policy"].items():
            if isinstance(entry, int) and not isinstance(entry, bool):
                entry = {"retries": entry}
            if isinstance(entry, dict):
                entry = {**DEFAULT_POLICY.get(name, {}), **entry}
            merged[name] = entry
        return {**data, "policy": {**DEFAULT_POLICY, **merged}}

    def of(self, failure_class: str) -> ClassPolicy:
        """The policy of `failure_class`; a class the table lacks is treated as unknown."""
        return self.policy.get(failure_class) or self.policy["unknown"]  # type: ignore[index]

    @property
    def stage_ceiling(self) -> int:
        """Retries of a stage other than train, whose killed task process no policy counts (train's next
        try does, `decide_unseen`): the counts, and an hour's worth of each class bounded by its rate."""
        total = sum(p.retries if p.retries is not None else math.ceil(p.per_hour or 0) for p in self.policy.values())
        return total if self.retries is None else min(total, self.retries)

    @property
    def ceiling(self) -> int:
        """Retries of a task: the sum of the budgets (UNBOUNDED_TRIES where a class has no count),
        capped by `retries` where set."""
        counts = [p.retries for p in self.policy.values()]
        total = UNBOUNDED_TRIES if None in counts else sum(counts)  # type: ignore[arg-type]
        return total if self.retries is None else min(total, self.retries)
