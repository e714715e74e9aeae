"""The retry decision: each failure class has its own budget of new tries and its own delay.

`decide` is pure: the spec's recovery section, the class of this failure and the task's earlier
failures (class, time, the furthest step each try reached) in, a `Decision` out. `StageRetryPolicy` is Airflow's `retry_policy` for a
stage task: it reads the failure's class from the exception (`ballast.errors.failure_class`), keeps
the task's failures in its `task_state_store` (which survives retries, unlike XComs) and answers with
Airflow's `RetryDecision`; a try the policy never saw (its task process killed) is counted and decided
by `decide_unseen`, from the next try. Only this module writes the task's failures. A policy can end
retries early, never add any: the task's `retries` is the ceiling (`recovery.ceiling`, the sum of the
budgets unless `recovery.retries` caps it).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

from airflow.sdk import RetryDecision, RetryPolicy

from ballast.spec.recovery import CLASS_NAMES, RecoverySpec

FAILURES_KEY = "ballast.failures"
"""task_state_store key: {try number: {"class", "at" (unix time), "step" (the furthest step the try
reached, or None)}} of the task's failed tries (a bare class string: a record from before the times)."""
HOUR = 3600.0


@dataclass(frozen=True)
class Decision:
    retry: bool
    delay_seconds: float
    reason: str


@dataclass(frozen=True)
class Failure:
    failure_class: str
    at: float | None = None
    step: int | None = None


def failures_of(stored: dict[str, Any]) -> dict[int, Failure]:
    """The task's failed tries as the store holds them, by try number."""
    out = {}
    for key, v in stored.items():
        if isinstance(v, str):
            out[int(key)] = Failure(v)
        elif isinstance(v, dict):
            out[int(key)] = Failure(str(v.get("class", "unknown")), v.get("at"), v.get("step"))
    return out


def stalled(failures: dict[str, Any]) -> tuple[int, int | None]:
    """(failed tries in a row, the newest last, that reached no step past the furthest any earlier try
    reached; that furthest step, None if no try reached one)."""
    best, run = None, 0
    for _, f in sorted(failures_of(failures).items()):
        if f.step is not None and (best is None or f.step > best):
            best, run = f.step, 0
        else:
            run += 1
    return run, best


def decide(recovery: RecoverySpec, failure_class: str, failures: dict[str, Any], *, try_number: int,
           max_tries: int | None = None, stage: str = "train", now: float | None = None) -> Decision:
    """Retry or fail after a failure of `failure_class`; `failures` holds every failed try of the task
    so far, this one included (the store's {try number: failure}). A class with a count
    (`retries`) fails the task past it; one without (the infrastructure's weather) when it comes more
    than `per_hour` times within the hour before `now`, or when `recovery.stalled_tries` tries in a row
    made no progress."""
    policy = recovery.of(failure_class)
    name = CLASS_NAMES.get(failure_class, failure_class)
    seen = failures_of(failures)
    nth = sum(1 for f in seen.values() if f.failure_class == failure_class)
    entry = f"recovery.policy.{failure_class if failure_class in recovery.policy else 'unknown'}"
    if policy.retries == 0:
        return Decision(False, 0.0, f"{stage}: a {name} failure is not retried ({entry}.retries is 0)")
    if policy.retries is not None and nth > policy.retries:
        return Decision(False, 0.0, f"{stage}: {name} failure {nth} is over its budget of {policy.retries}"
                                    f" ({entry}.retries); failing the task")
    now = time.time() if now is None else now
    if policy.per_hour is not None:
        hour = sum(1 for f in seen.values() if f.failure_class == failure_class and f.at is not None
                   and now - f.at <= HOUR)
        if hour > policy.per_hour:
            return Decision(False, 0.0, f"{stage}: {hour} {name} failures within the last hour, over the"
                                        f" {policy.per_hour:g} allowed ({entry}.per_hour): they come faster than"
                                        f" training can make use of a try; failing the task")
    if policy.retries is None:
        run, best = stalled(failures)
        if run >= recovery.stalled_tries:
            past = f"past step {best}" if best is not None else "at all"
            return Decision(False, 0.0, f"{stage}: the last {run} tries made no progress (none trained {past});"
                                        f" failing the task after {recovery.stalled_tries} such tries"
                                        f" (recovery.stalled_tries)")
    if max_tries is not None and try_number > max_tries:
        return Decision(False, 0.0, f"{stage}: all {max_tries} retries of the task are used"
                                    f" (recovery.retries / the sum of recovery.policy budgets)")
    delay = policy.delay(nth, recovery.retry_delay_seconds)
    budget = f"{nth} of {policy.retries} allowed" if policy.retries is not None else \
        f"{nth} in this task, at most {policy.per_hour:g} an hour"
    return Decision(True, delay, f"{stage}: {name} failure {budget}; next try in {delay:g}s")


def record_failure(store: Any, try_number: int, failure_class: str, *, keep: bool = False,
                   step: int | None = None, at: float | None = None) -> dict[str, Any]:
    """Count try `try_number`'s failure of `failure_class` (at unix time `at`, now by default, having
    reached `step`) in the task's state (`store`: its task_state_store, or None outside a task) and
    return every failed try so far; `keep`: a failure already counted for that try stands. The one
    writer of FAILURES_KEY."""
    failures = dict(store.get(FAILURES_KEY) or {}) if store is not None else {}
    entry = {"class": failure_class, "at": time.time() if at is None else at, "step": step}
    if keep:
        failures.setdefault(str(try_number), entry)
    else:
        failures[str(try_number)] = entry
    if store is not None:
        store.set(FAILURES_KEY, failures)
    return failures


def decide_unseen(recovery: RecoverySpec, store: Any, try_number: int, failure_class: str, *,
                  stage: str = "train", step: int | None = None, at: float | None = None) -> Decision:
    """The decision for a try whose task process was killed before this policy saw its failure (the
    next try finds it unrecorded): count it, unless the policy already did, and decide as for any
    failure."""
    failures = record_failure(store, try_number, failure_class, keep=True, step=step, at=at)
    return decide(recovery, failures_of(failures)[try_number].failure_class, failures, try_number=try_number,
                  stage=stage)


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
        failures = record_failure(store, try_number, cls, step=getattr(exception, "step_reached", None))
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
