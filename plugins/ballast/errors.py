"""One exception family for everything Ballast reports to a user, and the failure class each names.

Every message names the file, the field (or object) and what would fix it, so that a task log or
`ballast lint` can print it as one line instead of a traceback.

The training package (`training/`, which never imports Ballast) has its own family: every
`training.failure.TrainingFailure` carries a failure class. A stage does not catch those: the runner
translates whatever reaches it once, by class (`from_training`). `failure_class` names the class of
any error that ends a task; the spec's recovery policy (`recovery.policy`, applied by
`ballast.recovery.policy`) decides from it whether the task fails at once or tries again.
"""

from __future__ import annotations

from ballast.training.failure import TrainingFailure


class BallastError(Exception):
    """Base class: a problem a user can act on, reported as one line."""


class SpecError(BallastError):
    """A spec file cannot be read or does not validate."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(SpecError):
    """The training package refused the run config a spec produced (failure class `config`): fix the spec."""


class DataError(BallastError):
    """The data a stage read is missing, malformed or fails its checks (a checkpoint's files included)."""


class CheckpointError(BallastError):
    """No committed, intact checkpoint where one was expected, or one that does not fit its model."""


class LaunchError(BallastError):
    """A training launch failed; carries the failure class the trainer recorded (`unknown` without a record)."""

    def __init__(self, message: str, *, failure_class: str = "unknown"):
        self.failure_class = failure_class
        super().__init__(message)


class StorageError(BallastError):
    """Reading or writing the pipeline's storage failed."""


class Cancelled(BallastError):
    """The task was stopped while training ran (marked failed, timed out): a cancel, not a failure."""


class QualityGateError(BallastError):
    """The evaluated model did not reach the spec's publish threshold."""


# --- the one translation, the one retry decision -------------------------------------------------------

# Failure class (training.failure) -> the Ballast error it becomes; every other class is a LaunchError.
_BY_CLASS: dict[str, type[BallastError]] = {"config": ConfigError, "data": DataError}

def training_error(message: str, failure_class: str) -> BallastError:
    """The Ballast error for a training failure of class `failure_class` (from an exception or a
    failure record), its message on one line (a task log line, not a traceback)."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    cls = _BY_CLASS.get(failure_class)
    return cls(line) if cls is not None else LaunchError(line, failure_class=failure_class)


def from_training(exc: TrainingFailure) -> BallastError:
    """Translate a training failure that reached a stage, by its class (the one place that does)."""
    return training_error(str(exc) or type(exc).__name__, exc.failure_class)


def failure_class(exc: BaseException) -> str:
    """The failure class of an error that ended a task (the recovery policy's key, `recovery.policy`).
    A training try's class is not decided here: `training.failure_patterns.classify_exit` decides it and
    the LaunchError (or ConfigError, DataError) carries it; this names the class of that error and of
    the orchestrator's own errors (a spec, data or storage problem, a task timeout)."""
    if isinstance(exc, LaunchError):
        return exc.failure_class
    if isinstance(exc, SpecError):
        return "config"
    if isinstance(exc, (DataError, CheckpointError)):
        return "data"
    if isinstance(exc, StorageError):
        return "communication"
    if isinstance(exc, TrainingFailure):
        return exc.failure_class
    if type(exc).__name__ == "AirflowTaskTimeout":
        return "hang"
    return "unknown"

