"""The retry decision: each failure class has its own budget of new tries and its own delay.

`decide` is pure: the spec's recovery section, the class of this failure and the classes of the
task's earlier failures in, a `Decision` out. `StageRetryPolicy` is Airflow's `retry_policy` for a
stage task: it reads the failure's class from the exception (`ballast.errors.failure_class`), keeps
the task's failures in its `task_state_store` (which survives retries, unlike XComs) and answers with
Airflow's `RetryDecision`; a try the policy never saw (its task process killed) is counted and decided
by `decide_unseen`, from the next try. Only this module writes the task's failures. A policy can end
retries early, never add any: the task's `retries` is the ceiling (`recovery.ceiling`, the sum of the
budgets unless `recovery.retries` caps it).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from airflow.sdk import RetryDecision, RetryPolicy

from ballast.spec.recovery import CLASS_NAMES, RecoverySpec

FAILURES_KEY = "ballast.failures"
"""task_state_store key: {try number: failure class} of the task's failed tries."""


@dataclass(frozen=True)
class Decision:
    retry: bool
    delay_seconds: float
    reason: str


def count(failures: dict[str, str], failure_class: str) -> int:
    return sum(1 for c in failures.values() if c == failure_class)


def decide(recovery: RecoverySpec, failure_class: str, failures: dict[str, str], *, try_number: int,
           max_tries: int | None = None, stage: str = "train") -> Decision:
    """Retry or fail after a failure of `failure_class`; `failures` holds every failed try of the task
    so far, this one included ({try number: class})."""
    policy = recovery.of(failure_class)
    name = CLASS_NAMES.get(failure_class, failure_class)
    nth = count(failures, failure_class)
    field = f"recovery.policy.{failure_class if failure_class in recovery.policy else 'unknown'}.retries"
    if policy.retries == 0:
        return Decision(False, 0.0, f"{stage}: a {name} failure is not retried ({field} is 0)")
    if nth > policy.retries:
        return Decision(False, 0.0, f"{stage}: {name} failure {nth} is over its budget of {policy.retries}"
                                    f" ({field}); failing the task")
    if max_tries is not None and try_number > max_tries:
        return Decision(False, 0.0, f"{stage}: all {max_tries} retries of the task are used"
                                    f" (recovery.retries / the sum of recovery.policy budgets)")
    delay = policy.delay(nth, recovery.retry_delay_seconds)
    return Decision(True, delay, f"{stage}: {name} failure {nth} of {policy.retries} allowed; next try in"
                                 f" {delay:g}s")


def record_failure(store: Any, try_number: int, failure_class: str, *, keep: bool = False) -> dict[str, str]:
    """Count try `try_number`'s failure of `failure_class` in the task's state (`store`: its
    task_state_store, or None outside a task) and return every failed try so far; `keep`: a class
    already counted for that try stands. The one writer of FAILURES_KEY."""
    failures = dict(store.get(FAILURES_KEY) or {}) if store is not None else {}
    if keep:
        failures.setdefault(str(try_number), failure_class)
    else:
        failures[str(try_number)] = failure_class
    if store is not None:
        store.set(FAILURES_KEY, failures)
    return failures


def decide_unseen(recovery: RecoverySpec, store: Any, try_number: int, failure_class: str, *,
                  stage: str = "train") -> Decision:
    """The decision for a try whose task process was killed before this policy saw its failure (the
    next try finds it unrecorded): count it, unless the policy already did, and decide as for any
    failure."""
    failures = record_failure(store, try_number, failure_class, keep=True)
    return decide(recovery, failures[str(try_number)], failures, try_number=try_number, stage=stage)


class StageRetryPolicy(RetryPolicy):
    """Airflow's retry policy for one stage task, from the spec's recovery section."""

    def __init__(self, recovery: dict[str, Any], stage: str):
        self.recovery_data = recovery
        self.stage = stage
        self._recovery: RecoverySpec | None = None

    @property
    def recovery(self) -> RecoverySpec:
        if self._recovery is None:
            self._recovery = RecoverySpec.model_validate(self.recovery_data)
        return self._recovery

    def evaluate(self, exception: BaseException, try_number: int, max_tries: int,
                 context: Any = None) -> RetryDecision:
        from ballast.errors import Cancelled, QualityGateError, failure_class

        if isinstance(exception, QualityGateError):  # a new try trains nothing new
            return RetryDecision.fail(f"{self.stage}: below the publish threshold; not retried")
        if isinstance(exception, Cancelled):
            return RetryDecision.fail(f"{self.stage}: cancelled; not retried")
        cls = failure_class(exception)
        store = context.get("task_state_store") if context is not None else None
        failures = record_failure(store, try_number, cls)
        decision = decide(self.recovery, cls, failures, try_number=try_number, max_tries=max_tries or None,
                          stage=self.stage)
        if decision.retry:
            return RetryDecision.retry(dt.timedelta(seconds=decision.delay_seconds), decision.reason)
        return RetryDecision.fail(decision.reason)

    def serialize(self) -> dict[str, Any]:
        return {"stage": self.stage, "recovery": self.recovery_data}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> StageRetryPolicy:
        return cls(data["recovery"], data["stage"])
